//! `vl quantize` on Qwen3.5 checkpoints writes what llama.cpp's converter writes: the pinned
//! converter's own files of the same checkpoints (`goldens/gguf-q35`, `--outtype bf16`) are the
//! expected output, tensor by tensor (names, types, shapes, bytes) and key by key.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device};
use vl_models::qwen3_vl::gguf_write::{save, Recipe};
use vl_models::qwen3_vl::ModelDir;

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

fn open(path: &Path) -> (Content, std::fs::File) {
    let mut f = std::fs::File::open(path).unwrap();
    (Content::read(&mut f).unwrap(), f)
}

/// Keys the converter writes from what `vl quantize` does not read (the model card's name and
/// size, generation_config's sampling) or reads otherwise (the end-of-text id: ours is
/// generation_config's first `eos_token_id`), and keys only ours writes.
const NOT_COMPARED: &[&str] = &[
    "general.name",
    "general.size_label",
    "general.sampling.top_k",
    "general.sampling.top_p",
    "general.sampling.temp",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "clip.vision.image_min_pixels",
    "clip.vision.image_max_pixels",
];

/// Every tensor and compared key of `ours` equals the converter's `theirs`; `ssm_a`
/// (-exp(A_log), computed on both sides) within 1 ulp-scale of f32.
fn same_file(ours: &Path, theirs: &Path) {
    let ((a, mut fa), (b, mut fb)) = (open(ours), open(theirs));
    let names = |c: &Content| c.tensor_infos.keys().cloned().collect::<BTreeSet<_>>();
    assert_eq!(names(&a), names(&b), "{} against {}", ours.display(), theirs.display());
    for name in names(&a) {
        let (x, y) = (&a.tensor_infos[&name], &b.tensor_infos[&name]);
        assert_eq!(x.ggml_dtype, y.ggml_dtype, "{name}: type");
        assert_eq!(x.shape.dims(), y.shape.dims(), "{name}: shape");
        let x = a.tensor(&mut fa, &name, &Device::Cpu).unwrap();
        let y = b.tensor(&mut fb, &name, &Device::Cpu).unwrap();
        if name.ends_with(".ssm_a") {
            let f = |t: candle_core::quantized::QTensor| {
                t.dequantize(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
            };
            for (p, q) in f(x).iter().zip(f(y)) {
                assert!((p - q).abs() <= 1e-6 * q.abs(), "{name}: {p} against {q}");
            }
        } else {
            assert!(x.data().unwrap() == y.data().unwrap(), "{name}: bytes differ");
        }
    }
    let keys = |c: &Content| {
        c.metadata.keys().filter(|k| !NOT_COMPARED.contains(&k.as_str())).cloned().collect::<BTreeSet<_>>()
    };
    assert_eq!(keys(&a), keys(&b), "metadata keys of {}", ours.display());
    let shown = |v: &Value| format!("{v:?}");
    for k in keys(&a) {
        // Compared by their printed form (Value has no equality); arrays of 248,320 strings too.
        assert!(
            shown(&a.metadata[&k]) == shown(&b.metadata[&k]),
            "{k}: {:.200} against {:.200}",
            shown(&a.metadata[&k]),
            shown(&b.metadata[&k])
        );
    }
}

#[test]
fn a_qwen35_checkpoint_is_written_as_the_converter_writes_it() {
    let out = tempfile::tempdir().unwrap();
    let ck = goldens().join("tiny-q35/checkpoint");
    let w = save(&ModelDir::open(&ck).unwrap(), Recipe::Float(DType::BF16), out.path(), false, &mut |_| {}).unwrap();
    assert!(w.text.file_name().unwrap().to_string_lossy().ends_with("-BF16.gguf"), "{}", w.text.display());
    // The MTP block is the sixth (block_count 6, nextn_predict_layers 1), value heads tiled
    // (2 key heads, 4 value heads), norms with +1, A_log as -exp(A_log): as the converter does.
    same_file(&w.text, &goldens().join("gguf-q35/tiny-q35-bf16.gguf"));
    same_file(&w.mmproj, &goldens().join("gguf-q35/mmproj-tiny-q35-bf16.gguf"));
}

#[test]
fn a_qwen35_moe_checkpoint_is_written_as_the_converter_writes_it() {
    let out = tempfile::tempdir().unwrap();
    let ck = goldens().join("tiny-q35-moe/checkpoint");
    // The hub's layout: one tensor per expert, stacked into ffn_{gate,up,down}_exps.
    let w = save(&ModelDir::open(&ck).unwrap(), Recipe::Float(DType::BF16), out.path(), false, &mut |_| {}).unwrap();
    same_file(&w.text, &goldens().join("gguf-q35/tiny-q35-moe-bf16.gguf"));
}
