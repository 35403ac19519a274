//! `QEmbedding`: a token embedding table, dense or quantized (rows dequantized on lookup).

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{DType, Tensor};
use candle_nn::Linear;

use super::{dtype_name, quantize_rows, QLinear, QuantType};
use crate::dispatch::{own_kernel, DeviceKind, Op};
use crate::{Error, Result};

/// A token embedding table, dense or quantized. A quantized table dequantizes only the rows it
/// looks up, so a tied lm_head and the embedding can share one quantized copy.
#[derive(Debug, Clone)]
pub enum QEmbedding {
    Dense(Tensor),
    Quant { table: Arc<QTensor>, qtype: QuantType, rows: usize, dim: usize },
}

impl QEmbedding {
    pub fn new(table: Tensor, qtype: Option<QuantType>) -> Result<Self> {
        let (rows, dim) = table.dims2()?;
        match qtype {
            // Row lookups read the quantized bytes in place on CPU; a GPU table stays dense.
            Some(q)
                if dim % q.block() == 0
                    && own_kernel(Op::QuantEmbedding, DeviceKind::of(table.device()), table.dtype()) =>
            {
                let t = quantize_rows(&table, q)?;
                Ok(QEmbedding::Quant { table: Arc::new(t), qtype: q, rows, dim })
            }
            _ => Ok(QEmbedding::Dense(table)),
        }
    }

    /// A table already quantized (e.g. read from a GGUF file), used as stored.
    /// Off the CPU the table is dequantized once, to `dtype` (the model's compute dtype, so a
    /// tied lm_head multiplies in it; candle 0.11 reads a GPU table's bytes back to the host for
    /// each lookup): a dense table, its lm_head a dense product.
    pub fn from_qtensor(t: Arc<QTensor>, dtype: DType) -> Result<Self> {
        let dev = t.device();
        if !own_kernel(Op::QuantEmbedding, DeviceKind::of(&dev), DType::F32) {
            return Ok(QEmbedding::Dense(t.dequantize(&dev)?.to_dtype(dtype)?));
        }
        let (rows, dim) = t.shape().dims2()?;
        let qtype = QuantType::from_ggml(t.dtype()).ok_or_else(|| Error::Shape {
            layer: "QEmbedding",
            message: format!("no kernel for block type {:?}", t.dtype()),
        })?;
        Ok(QEmbedding::Quant { table: t, qtype, rows, dim })
    }

    /// Rows for `ids` as [n, dim] in `dtype`.
    pub fn lookup(&self, ids: &[u32], dtype: DType) -> Result<Tensor> {
        match self {
            QEmbedding::Dense(t) => {
                let idx = Tensor::from_slice(ids, ids.len(), t.device())?;
                Ok(t.index_select(&idx, 0)?.to_dtype(dtype)?)
            }
            QEmbedding::Quant { table, qtype, rows, dim } => {
                let data = table.data()?;
                let row_bytes = data.len() / rows;
                let mut buf = Vec::with_capacity(ids.len() * row_bytes);
                for &i in ids {
                    let i = i as usize;
                    if i >= *rows {
                        return Err(Error::Shape { layer: "QEmbedding", message: format!("id {i} >= {rows} rows") });
                    }
                    buf.extend_from_slice(&data[i * row_bytes..(i + 1) * row_bytes]);
                }
                let dev = table.device();
                let storage = QStorage::from_data(Cow::Owned(buf), &dev, qtype.ggml())?;
                let q = QTensor::new(storage, (ids.len(), *dim))?;
                Ok(q.dequantize(&dev)?.to_dtype(dtype)?)
            }
        }
    }

    /// The table as an lm_head (logits = x @ table^T).
    pub fn as_linear(&self) -> Result<QLinear> {
        match self {
            QEmbedding::Dense(t) => Ok(QLinear::Dense(Linear::new(t.clone(), None))),
            QEmbedding::Quant { table, qtype, .. } => {
                Ok(QLinear::Quant { w: QMatMul::from_arc(table.clone())?, qtype: *qtype, bias: None })
            }
        }
    }

    pub fn storage(&self) -> String {
        match self {
            QEmbedding::Dense(t) => dtype_name(t.dtype()).into(),
            QEmbedding::Quant { qtype, .. } => qtype.name().into(),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        match self {
            QEmbedding::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            QEmbedding::Quant { table, .. } => table.storage_size_in_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn quantized_embedding_rows_match_the_dequantized_table() {
        let dev = Device::Cpu;
        let t = crate::testing::randn(103, 1., (10, 256)).unwrap();
        let e = QEmbedding::new(t.clone(), Some(QuantType::Q6K)).unwrap();
        let QEmbedding::Quant { table, .. } = &e else { panic!("not quantized") };
        let full = table.dequantize(&dev).unwrap();
        let rows = e.lookup(&[7, 2, 7], DType::F32).unwrap();
        let idx = Tensor::new(&[7u32, 2, 7], &dev).unwrap();
        assert_eq!(max_diff(&rows, &full.index_select(&idx, 0).unwrap()), 0.0);
        assert!(max_diff(&rows, &t.index_select(&idx, 0).unwrap()) < 0.1);
        assert!(e.lookup(&[10], DType::F32).is_err());
        // The same table as an lm_head.
        let x = crate::testing::randn(104, 1., (2, 256)).unwrap();
        let want = x.matmul(&full.t().unwrap()).unwrap();
        let scale = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(max_diff(&e.as_linear().unwrap().forward(&x).unwrap(), &want) < 0.025 * scale);
    }
}
