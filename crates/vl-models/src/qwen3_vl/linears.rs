//! How the text decoder's weights are read: quantized at load (`QuantLoad`), taken as stored
//! (`Prequantized`, `PreExperts`: GGUF files), or in floats; the linear layers built from them.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use vl_nn::{QLinear, QuantType};

use crate::error::Result;

/// How the decoder's weights are quantized at load: to `qtype`, reading each weight in
/// `read_as` first (the checkpoint's own dtype, e.g. bf16, so no f32 copy of a weight is made).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantLoad {
    pub qtype: QuantType,
    pub read_as: DType,
}

/// Weights already quantized, by checkpoint key (`model.language_model.layers.0.mlp.up_proj.weight`),
/// used as stored (GGUF files): no dequantize-requantize round trip.
pub type Prequantized = std::collections::HashMap<String, std::sync::Arc<candle_core::quantized::QTensor>>;
/// A GGUF file's 3-D expert tensors, each as one `[out, in]` tensor per expert: views of the
/// mapped file, or cut as read (`gguf::cut_experts`), so the 3-D bytes are never held beside the
/// experts' own.
pub type PreExperts = std::collections::HashMap<String, Vec<std::sync::Arc<candle_core::quantized::QTensor>>>;

/// How the decoder's weights are built: quantized at load (`quant`) and/or already quantized (`pre`).
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadPlan<'a> {
    pub quant: Option<QuantLoad>,
    pub pre: Option<&'a Prequantized>,
    pub experts: Option<&'a PreExperts>,
}

impl LoadPlan<'_> {
    fn key(vb: &VarBuilder, name: &str) -> String {
        if vb.prefix().is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", vb.prefix())
        }
    }

    pub(super) fn stored(
        &self,
        vb: &VarBuilder,
        name: &str,
    ) -> Option<std::sync::Arc<candle_core::quantized::QTensor>> {
        self.pre.and_then(|p| p.get(&Self::key(vb, name))).cloned()
    }

    pub(super) fn stored_experts(
        &self,
        vb: &VarBuilder,
        name: &str,
    ) -> Option<&[std::sync::Arc<candle_core::quantized::QTensor>]> {
        self.experts.and_then(|p| p.get(&Self::key(vb, name))).map(|v| v.as_slice())
    }
}

/// A weight `vb`'s `name` of `shape`: in `q.read_as` when it will be quantized (its last
/// dimension fits the block), else in the model's dtype.
pub(super) fn weight(
    shape: (usize, usize),
    name: &str,
    vb: &VarBuilder,
    q: Option<QuantLoad>,
) -> Result<(Tensor, Option<QuantType>)> {
    match q {
        Some(q) if shape.1.is_multiple_of(q.qtype.block()) => {
            Ok((vb.get_with_hints_dtype(shape, name, candle_nn::Init::Const(0.), q.read_as)?, Some(q.qtype)))
        }
        _ => Ok((vb.get(shape, name)?, None)),
    }
}

pub(super) fn linear_no_bias(i: usize, o: usize, vb: VarBuilder, q: LoadPlan) -> Result<QLinear> {
    if let Some(t) = q.stored(&vb, "weight") {
        check_stored(&t, (o, i), &vb)?;
        return Ok(QLinear::from_qtensor(t, None)?);
    }
    let (w, qt) = weight((o, i), "weight", &vb, q.quant)?;
    Ok(QLinear::new(candle_nn::Linear::new(w, None), qt)?)
}

pub(super) fn check_stored(t: &candle_core::quantized::QTensor, shape: (usize, usize), vb: &VarBuilder) -> Result<()> {
    if t.shape().dims() != [shape.0, shape.1] {
        return Err(crate::error::Error::Input {
            what: format!("{}.weight", vb.prefix()),
            message: format!("shape {:?}, expected {:?}", t.shape().dims(), [shape.0, shape.1]),
        });
    }
    Ok(())
}
