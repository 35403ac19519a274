//! `vl quantize`: a checkpoint written once as the GGUF pair llama.cpp publishes (text model,
//! arch `qwen3vl`, quantized; vision projector `mmproj-*-F16.gguf`), with llama.cpp's tensor
//! names, metadata keys and tokenizer fields, so `vl run --model DIR` starts without
//! re-quantizing and llama.cpp's tools read the files.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use vl_nn::linear::quantize_rows;
use vl_nn::QuantType;

use super::gguf_hybrid;
use super::gguf_names::{text_name, vision_name};
use super::plan::{Group, VISION_PREFIX};
use super::preflight::ModelDir;
use crate::error::{Error, Result};
use crate::limits::{read_text, MAX_METADATA_FILE_BYTES};

pub use crate::gguf::{Recipe, Written};

/// llama.cpp's fallback when a row does not fill the type's blocks.
fn fallback(q: QuantType, cols: usize) -> Option<QuantType> {
    if cols.is_multiple_of(q.block()) {
        return Some(q);
    }
    let alt = match q {
        QuantType::Q4K => QuantType::Q5_0,
        QuantType::Q5K => QuantType::Q5_1,
        QuantType::Q6K | QuantType::Q8K => QuantType::Q8_0,
        _ => return None,
    };
    cols.is_multiple_of(alt.block()).then_some(alt)
}

fn f32_tensor(t: &Tensor) -> Result<QTensor> {
    Ok(QTensor::quantize(&t.to_dtype(DType::F32)?.contiguous()?, GgmlDType::F32)?)
}

fn float_tensor(t: &Tensor, d: GgmlDType) -> Result<QTensor> {
    Ok(QTensor::quantize(&t.to_dtype(DType::F32)?.contiguous()?, d)?)
}

/// Where a text tensor of the file comes from: a checkpoint tensor as it is, a fused expert
/// tensor (`rows`: `Some(k)` takes the k-th `out`-row half of `gate_up_proj`, `None` all of
/// `down_proj`), or one tensor per expert (the Qwen3.5 MoE hub), stacked.
enum Source {
    Plain(String),
    Experts { key: String, rows: Option<usize> },
    PerExpert(Vec<String>),
}

/// A text tensor as llama.cpp's file holds it: name, decoder layer, shape `[.., out, in]`.
struct Output {
    name: String,
    layer: Option<usize>,
    shape: Vec<usize>,
    source: Source,
}

/// `<base>.experts.<e>.<part>.weight` -> (`<base>.experts.<part>.weight`, e).
fn per_expert_key(key: &str) -> Option<(String, usize)> {
    let (base, rest) = key.rsplit_once(".experts.")?;
    let (e, part) = rest.split_once('.')?;
    Some((format!("{base}.experts.{part}"), e.parse().ok()?))
}

/// The text tensors of the file, in the plan's order, then Qwen3.5's MTP head (`mtp.*`) as the
/// block after the decoder's. Fused experts become llama.cpp's `ffn_gate_exps` /
/// `ffn_up_exps` `[E, moe_inter, hidden]` and `ffn_down_exps` `[E, hidden, moe_inter]`, and so do
/// experts stored one tensor each. A MoE checkpoint with dense layers among the sparse ones is
/// refused: llama.cpp's `qwen3vlmoe` has routed experts in every layer, so no file of it holds one.
fn text_outputs(model: &ModelDir) -> Result<Vec<Output>> {
    let cfg = &model.config;
    let t = &cfg.text;
    if let Some(m) = &t.moe {
        let dense: Vec<String> = (0..t.num_hidden_layers).filter(|&i| !m.is_sparse(i)).map(|i| i.to_string()).collect();
        if !dense.is_empty() {
            return Err(Error::Input {
                what: model.dir.join("config.json").display().to_string(),
                message: format!(
                    "layers {} are dense MLPs among routed experts (mlp_only_layers / decoder_sparse_step); llama.cpp's qwen3vlmoe GGUF has experts in every layer and cannot hold them: load the checkpoint with --quantize instead",
                    dense.join(", ")
                ),
            });
        }
    }
    let no_name = |key: &str| Error::Input { what: key.into(), message: "no llama.cpp name for this tensor".into() };
    let layers = t.num_hidden_layers;
    let hybrid = t.hybrid.is_some();
    let name_of = |key: &str| -> Result<(String, Option<usize>)> {
        let (name, layer) = text_name(key).ok_or_else(|| no_name(&gguf_hybrid::checkpoint_key(key, layers)))?;
        // Qwen3.5's norm after attention keeps its own name (Qwen3-VL's is `ffn_norm`).
        Ok(match name.strip_suffix(".ffn_norm.weight") {
            Some(b) if hybrid => (format!("{b}.post_attention_norm.weight"), layer),
            _ => (name, layer),
        })
    };
    // The plan, then the MTP head's layers as the decoder layers after the last would be named.
    let mut plan: Vec<_> = model.plan.clone();
    let mut mtp_top = vec![];
    if hybrid {
        for (k, e) in model.weights.entries() {
            if let Some(key) = gguf_hybrid::as_decoder_key(k, layers) {
                plan.push(super::plan::PlannedTensor {
                    key,
                    shape: e.shape.clone(),
                    group: Group::Text,
                    required: true,
                    alt_shape: None,
                });
            } else if let Some(name) = gguf_hybrid::mtp_top_name(k, layers) {
                mtp_top.push(Output {
                    name,
                    layer: Some(layers),
                    shape: e.shape.clone(),
                    source: Source::Plain(k.clone()),
                });
            }
        }
    }
    let mut out: Vec<Output> = Vec::new();
    // Experts stored one tensor each: the stacked tensor's index in `out`, by its key.
    let mut stacked = std::collections::HashMap::<String, usize>::new();
    // The plan with the experts stacked per matrix, as the file holds them; a checkpoint that
    // fuses them (transformers, the hub) gives each from its fused tensor.
    for p in super::plan::split_experts(plan) {
        if p.group == Group::Vision || (p.group == Group::LmHead && cfg.tie_word_embeddings) {
            continue;
        }
        let stored = gguf_hybrid::checkpoint_key(&p.key, layers);
        if let Some((key, _)) = per_expert_key(&p.key) {
            if let Some(&i) = stacked.get(&key) {
                let o = &mut out[i];
                o.shape[0] += 1;
                if let Source::PerExpert(keys) = &mut o.source {
                    keys.push(stored);
                }
                continue;
            }
            let (name, layer) = name_of(&key)?;
            stacked.insert(key, out.len());
            let shape = [&[1], p.shape.as_slice()].concat();
            out.push(Output { name, layer, shape, source: Source::PerExpert(vec![stored]) });
            continue;
        }
        let (name, layer) = name_of(&p.key)?;
        let source = match model.weights.get(&stored) {
            Some(_) => None,
            None => fused_source(&stored),
        };
        let source = source.unwrap_or(Source::Plain(stored));
        out.push(Output { name, layer, shape: p.shape, source });
    }
    out.extend(mtp_top);
    Ok(out)
}

/// The fused tensor a stacked expert key (`<base>.experts.<part>.weight`) is cut from: gate and
/// up are the first and second row halves of `gate_up_proj`, down is all of `down_proj`.
fn fused_source(key: &str) -> Option<Source> {
    let (base, part) = key.strip_suffix(".weight")?.rsplit_once(".experts.")?;
    let (fused, rows) = match part {
        "gate_proj" => ("gate_up_proj", Some(0)),
        "up_proj" => ("gate_up_proj", Some(1)),
        "down_proj" => ("down_proj", None),
        _ => return None,
    };
    Some(Source::Experts { key: format!("{base}.experts.{fused}"), rows })
}

/// `w` `[.., in]` quantized row by row into `q`, keeping its shape (a 3-D expert tensor is one
/// run of rows, each expert's after the previous one's, as llama.cpp stores it).
fn quantize_stacked(w: &Tensor, q: QuantType) -> Result<QTensor> {
    if w.rank() == 2 {
        return Ok(quantize_rows(w, q)?);
    }
    let cols = w.dims()[w.rank() - 1];
    let flat = quantize_rows(&w.reshape(((), cols))?, q)?;
    let dev = w.device();
    Ok(candle_core::quantized::ggml_file::qtensor_from_ggml(flat.dtype(), &flat.data()?, w.dims().to_vec(), dev)?)
}

/// Token strings and types (llama.cpp: 1 normal, 3 control, 4 user-defined, 5 unused) and the
/// merges, from the checkpoint's tokenizer.json, typed as llama.cpp's converter types them.
fn vocabulary(dir: &Path, vocab_size: usize) -> Result<(Vec<String>, Vec<i32>, Vec<String>)> {
    let path = dir.join("tokenizer.json");
    let json: serde_json::Value = serde_json::from_str(&read_text(&path, MAX_METADATA_FILE_BYTES)?)
        .map_err(|source| Error::Json { path: path.clone(), source })?;
    let bad = |m: &str| Error::Input { what: path.display().to_string(), message: m.into() };
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let vocab = json["model"]["vocab"].as_object().ok_or_else(|| bad("model.vocab is not an object"))?;
    for (s, id) in vocab {
        let id = id.as_u64().ok_or_else(|| bad("a vocab id is not an integer"))? as usize;
        if let Some(slot) = tokens.get_mut(id) {
            *slot = Some((s.clone(), 1));
        }
    }
    for t in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(s)) = (t["id"].as_u64(), t["content"].as_str()) else { continue };
        if let Some(slot) = tokens.get_mut(id as usize) {
            *slot = Some((s.to_string(), if t["special"].as_bool() == Some(true) || looks_special(s) { 3 } else { 4 }));
        }
    }
    let (strings, types) =
        tokens.into_iter().enumerate().map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), 5))).unzip();
    let merges = json["model"]["merges"]
        .as_array()
        .ok_or_else(|| bad("model.merges is not a list"))?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Array(p) if p.len() == 2 => {
                Ok(format!("{} {}", p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or("")))
            }
            _ => Err(bad("a merge is neither \"a b\" nor [a, b]")),
        })
        .collect::<Result<_>>()?;
    Ok((strings, types, merges))
}

/// An added token the converter marks as control although the tokenizer does not call it special
/// (`does_token_look_special`: `<|...|>` and a few other models' forms).
fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The temporary name `path` is written under until both files are complete.
fn partial(path: &Path) -> PathBuf {
    path.with_extension("gguf.partial")
}

/// Writes the file to its temporary name (`partial`); errors name the file.
fn write_partial(path: &Path, meta: &[(String, Value)], tensors: &[(String, QTensor)]) -> Result<()> {
    let tmp = partial(path);
    let named = |e: String| Error::Input { what: tmp.display().to_string(), message: format!("cannot write: {e}") };
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?);
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    candle_core::quantized::gguf_file::write(&mut f, &meta, &tensors).map_err(|e| named(e.to_string()))?;
    use std::io::Write;
    f.flush().map_err(|e| named(e.to_string()))?;
    f.into_inner().map_err(|e| named(e.to_string()))?.sync_all().map_err(|e| named(e.to_string()))?;
    Ok(())
}

/// Removes the temporary files when the write fails before both are renamed.
struct Partials(Vec<PathBuf>);

impl Drop for Partials {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Writes `out/<name>-<TAG>.gguf` and `out/mmproj-<name>-<F16|BF16|F32>.gguf` (the vision
/// weights in the checkpoint's own float type: exact); returns both paths.
/// `progress(name)` is called per tensor written.
pub fn save(
    model: &ModelDir,
    recipe: Recipe,
    out: &Path,
    overwrite: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<Written> {
    let cfg = &model.config;
    let dev = Device::Cpu;
    let base = model
        .dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    // The checkpoint's shape is checked before anything is created.
    let outputs = text_outputs(model)?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let text_path = out.join(format!("{base}-{}.gguf", recipe.file_tag()));
    let (vdtype, vtag, vftype) = match model.weights.vision_float_dtype() {
        DType::F32 => (GgmlDType::F32, "F32", 0),
        DType::BF16 => (GgmlDType::BF16, "BF16", 32),
        _ => (GgmlDType::F16, "F16", 1),
    };
    let mmproj_path = out.join(format!("mmproj-{base}-{vtag}.gguf"));
    if !overwrite {
        if let Some(p) = [&text_path, &mmproj_path].into_iter().find(|p| p.symlink_metadata().is_ok()) {
            return Err(Error::Input {
                what: p.display().to_string(),
                message: "exists; pass --force to replace it".into(),
            });
        }
    }
    // The row lengths decide the block types before any weight is read: a recipe that leaves
    // every matrix in floats is refused (the file would be named by a type it does not hold).
    let mut stored = std::collections::BTreeMap::<String, usize>::new();
    let mut fell_back = 0;
    let mut fell_back_to = std::collections::BTreeMap::<String, usize>::new();
    let (mut left_float, mut narrow_rows) = (0, std::collections::BTreeSet::new());
    let experts = cfg.text.moe.as_ref().map_or(1, |m| m.num_experts);
    // The file's blocks: the decoder's, then the MTP head's.
    let blocks = outputs.iter().filter_map(|o| o.layer).max().map_or(cfg.text.num_hidden_layers, |l| l + 1);
    for o in outputs.iter().filter(|o| is_matrix(o)) {
        let Some(want) = recipe.text_type(&o.name, o.layer, blocks, cfg.tie_word_embeddings, experts) else {
            *stored.entry(float_name(recipe.float().unwrap_or(DType::F32))).or_default() += 1;
            continue;
        };
        let cols = o.shape[o.shape.len() - 1];
        let got = fallback(want, cols);
        if got != Some(want) {
            fell_back += 1;
        }
        if got.is_none() {
            left_float += 1;
            narrow_rows.insert(cols);
        }
        let tag = got.map(|q| ggml_name(q).to_string()).unwrap_or_else(|| float_name(model.weights.text_float_dtype()));
        if got != Some(want) {
            *fell_back_to.entry(tag.clone()).or_default() += 1;
        }
        *stored.entry(tag).or_default() += 1;
    }
    if left_float > 0 && left_float == stored.values().sum::<usize>() {
        let rows: Vec<String> = narrow_rows.iter().map(|r| r.to_string()).collect();
        return Err(Error::Input {
            what: format!("quantization {}", recipe.file_tag()),
            message: format!(
                "applies to no tensor of {}: its rows hold {} values, which fill neither its blocks of {} nor a fallback type's; nothing written",
                model.dir.display(),
                rows.join(", "),
                recipe.text_type("blk.0.attn_q.weight", Some(0), 1, false, 1).map_or(1, |q| q.block())
            ),
        });
    }
    let t = &cfg.text;
    let read_as = model.weights.text_float_dtype();
    let text_float = ggml_float(read_as);

    // Text model.
    let mut tensors = Vec::new();
    // The fused gate/up experts, read once for the two tensors cut from them.
    let mut fused: Option<(String, Tensor)> = None;
    let hybrid = t.hybrid.as_ref();
    for o in &outputs {
        let w = match &o.source {
            Source::Plain(key) => {
                let w = model.weights.load(key, read_as, &dev)?;
                match hybrid {
                    Some(h) => gguf_hybrid::rewrite(key, w, h)?,
                    None => w,
                }
            }
            Source::PerExpert(keys) => {
                let each = keys.iter().map(|k| model.weights.load(k, read_as, &dev)).collect::<Result<Vec<_>>>()?;
                Tensor::stack(&each, 0)?
            }
            Source::Experts { key, rows } => {
                if fused.as_ref().is_none_or(|(k, _)| k != key) {
                    let t = model.weights.load(key, read_as, &dev)?;
                    let (e, inp) = (o.shape[0], o.shape[2]);
                    let out = if rows.is_some() { 2 * o.shape[1] } else { o.shape[1] };
                    fused = Some((key.clone(), super::text::experts_out_in(t, (e, out, inp), key)?));
                }
                let t = &fused.as_ref().expect("read above").1;
                match rows {
                    Some(start) => t.narrow(1, *start * o.shape[1], o.shape[1])?.contiguous()?,
                    None => t.clone(),
                }
            }
        };
        let q = if is_matrix(o) {
            let cols = w.dims()[w.rank() - 1];
            match recipe.text_type(&o.name, o.layer, blocks, cfg.tie_word_embeddings, experts) {
                None => float_tensor(&w, ggml_float(recipe.float().unwrap_or(DType::F32)))?,
                Some(want) => match fallback(want, cols) {
                    Some(q) => quantize_stacked(&w, q)?,
                    // No block type fits the row: kept in the checkpoint's float type, as the
                    // runtime keeps such a layer dense.
                    None => float_tensor(&w, text_float)?,
                },
            }
        } else {
            // Norms, the routers and the DeltaNet convolution, in f32 as llama.cpp keeps them.
            f32_tensor(&w)?
        };
        progress(&o.name);
        tensors.push((o.name.clone(), q));
    }
    drop(fused);
    let (tokens, types, merges) = vocabulary(&model.dir, t.vocab_size)?;
    let s = |v: &str| Value::String(v.into());
    let u = |v: usize| Value::U32(v as u32);
    let arch = match (hybrid.is_some(), t.moe.is_some()) {
        (false, false) => "qwen3vl",
        (false, true) => "qwen3vlmoe",
        (true, false) => "qwen35",
        (true, true) => "qwen35moe",
    };
    let a = |k: &str| format!("{arch}.{k}");
    let mut meta = vec![
        ("general.architecture".to_string(), s(arch)),
        ("general.type".into(), s("model")),
        ("general.name".into(), s(&base)),
        ("general.file_type".into(), Value::U32(recipe.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (a("block_count"), u(blocks)),
        (a("context_length"), u(t.max_position_embeddings)),
        (a("embedding_length"), u(t.hidden_size)),
        (a("attention.head_count"), u(t.num_attention_heads)),
        (a("attention.head_count_kv"), u(t.num_key_value_heads)),
        (
            a("rope.dimension_sections"),
            Value::Array(t.mrope_section.iter().chain(&[0]).map(|&x| Value::I32(x as i32)).collect()),
        ),
        (a("rope.freq_base"), Value::F32(t.rope_theta as f32)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(t.rms_norm_eps as f32)),
        (a("attention.key_length"), u(t.head_dim)),
        (a("attention.value_length"), u(t.head_dim)),
        ("tokenizer.ggml.model".to_string(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s(if hybrid.is_some() { "qwen35" } else { "qwen2" })),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.merges".into(), Value::Array(merges.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
    ];
    // Qwen3.5 MoE files carry no dense width (its converter writes none).
    if !(hybrid.is_some() && t.moe.is_some()) {
        meta.push((a("feed_forward_length"), u(t.intermediate_size)));
    }
    match hybrid {
        Some(h) => meta.extend(gguf_hybrid::metadata(cfg, h, blocks - t.num_hidden_layers, arch)),
        None => meta.push((a("n_deepstack_layers"), u(cfg.vision.deepstack_visual_indexes.len()))),
    }
    if let Some(m) = &t.moe {
        meta.push((a("expert_count"), u(m.num_experts)));
        meta.push((a("expert_used_count"), u(m.top_k)));
        meta.push((a("expert_feed_forward_length"), u(m.moe_intermediate_size)));
    }
    if let Some(&eos) = model.generation.eos_token_ids.first() {
        meta.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
    }
    meta.push(("tokenizer.chat_template".into(), Value::String(model.processor.template.source_text())));
    // Both files go to temporary names and are renamed only once both are complete: a failure
    // (a full disk) leaves neither, and no directory that loads as a text-only model.
    let mut partials = Partials(vec![partial(&text_path), partial(&mmproj_path)]);
    write_partial(&text_path, &meta, &tensors)?;
    let text_count = tensors.len();
    drop(tensors);

    // Vision projector in the checkpoint's float type (norms, biases, the patch embedding and the
    // position table f32, as llama.cpp's converter writes them).
    let v = &cfg.vision;
    let mut tensors = Vec::new();
    for p in &model.plan {
        if p.group != Group::Vision {
            continue;
        }
        let key = p.key.strip_prefix(&format!("{VISION_PREFIX}.")).unwrap_or(&p.key).to_string();
        let w = model.weights.load(&p.key, DType::F32, &dev)?;
        if key == "patch_embed.proj.weight" {
            // The Conv3D kernel [out, in, 2, kh, kw] as two temporal Conv2D slices, in f32 as
            // the converter keeps them.
            for (k, name) in ["v.patch_embd.weight", "v.patch_embd.weight.1"].iter().enumerate() {
                tensors.push((name.to_string(), f32_tensor(&w.narrow(2, k, 1)?.squeeze(2)?)?));
            }
            progress("v.patch_embd.weight");
            continue;
        }
        let name = vision_name(&key, &v.deepstack_visual_indexes)
            .ok_or_else(|| Error::Input { what: p.key.clone(), message: "no llama.cpp name for this tensor".into() })?;
        let q = if w.rank() >= 2 && key != "pos_embed.weight" { float_tensor(&w, vdtype)? } else { f32_tensor(&w)? };
        progress(&name);
        tensors.push((name, q));
    }
    let pp = &model.processor.images.config;
    let side = (v.num_position_embeddings as f64).sqrt().round() as usize * v.patch_size;
    let f32s = |x: &[f32]| Value::Array(x.iter().map(|&f| Value::F32(f)).collect());
    let mut deep = vec![Value::Bool(false); v.depth];
    for &i in &v.deepstack_visual_indexes {
        if let Some(d) = deep.get_mut(i) {
            *d = Value::Bool(true);
        }
    }
    let meta = vec![
        ("general.architecture".to_string(), s("clip")),
        ("general.type".into(), s("mmproj")),
        ("general.name".into(), s(&base)),
        ("general.file_type".into(), Value::U32(vftype)),
        ("general.quantization_version".into(), Value::U32(2)),
        ("clip.has_vision_encoder".into(), Value::Bool(true)),
        ("clip.projector_type".into(), s("qwen3vl_merger")),
        ("clip.use_gelu".into(), Value::Bool(true)),
        ("clip.vision.projection_dim".into(), u(v.out_hidden_size)),
        ("clip.vision.image_size".into(), u(side)),
        ("clip.vision.patch_size".into(), u(v.patch_size)),
        ("clip.vision.embedding_length".into(), u(v.hidden_size)),
        ("clip.vision.feed_forward_length".into(), u(v.intermediate_size)),
        ("clip.vision.block_count".into(), u(v.depth)),
        ("clip.vision.attention.head_count".into(), u(v.num_heads)),
        ("clip.vision.image_mean".into(), f32s(&pp.image_mean)),
        ("clip.vision.image_std".into(), f32s(&pp.image_std)),
        ("clip.vision.spatial_merge_size".into(), u(v.spatial_merge_size)),
        // The checkpoint's pixel budget (llama.cpp's keys; its converter leaves them out).
        ("clip.vision.image_min_pixels".into(), u(pp.min_pixels)),
        ("clip.vision.image_max_pixels".into(), u(pp.max_pixels)),
        ("clip.vision.attention.layer_norm_epsilon".into(), Value::F32(t.rms_norm_eps as f32)),
        ("clip.vision.is_deepstack_layers".into(), Value::Array(deep)),
    ];
    write_partial(&mmproj_path, &meta, &tensors)?;
    // The mmproj first: a failure between the two renames leaves a vision projector alone,
    // which loads as nothing, never a text model without its projector.
    std::fs::rename(partial(&mmproj_path), &mmproj_path).map_err(|e| Error::io(&mmproj_path, e))?;
    if let Err(e) = std::fs::rename(partial(&text_path), &text_path) {
        let _ = std::fs::remove_file(&mmproj_path);
        return Err(Error::io(&text_path, e));
    }
    partials.0.clear();
    let tensors = text_count + tensors.len();
    Ok(Written { text: text_path, mmproj: mmproj_path, tensors, stored, fell_back, fell_back_to })
}

/// llama.cpp's name of a block type.
fn ggml_name(q: QuantType) -> &'static str {
    match q {
        QuantType::Q4K => "Q4_K",
        QuantType::Q5K => "Q5_K",
        QuantType::Q6K => "Q6_K",
        QuantType::Q8_0 => "Q8_0",
        QuantType::Q8K => "Q8_K",
        QuantType::Q4_0 => "Q4_0",
        QuantType::Q4_1 => "Q4_1",
        QuantType::Q5_0 => "Q5_0",
        QuantType::Q5_1 => "Q5_1",
        QuantType::Q2K => "Q2_K",
        QuantType::Q3K => "Q3_K",
    }
}

/// Whether a text tensor is a matrix llama-quantize would quantize: 2-D or more, not a router
/// (`ffn_gate_inp`, and the shared expert's gate, whose one row ggml counts as 1-D) and not the
/// DeltaNet convolution.
fn is_matrix(o: &Output) -> bool {
    o.shape.len() >= 2
        && !o.name.ends_with("ffn_gate_inp.weight")
        && !o.name.ends_with("ffn_gate_inp_shexp.weight")
        && !o.name.ends_with("ssm_conv1d.weight")
}

fn ggml_float(d: DType) -> GgmlDType {
    match d {
        DType::BF16 => GgmlDType::BF16,
        DType::F16 => GgmlDType::F16,
        _ => GgmlDType::F32,
    }
}

fn float_name(d: DType) -> String {
    match d {
        DType::BF16 => "BF16".into(),
        DType::F16 => "F16".into(),
        _ => "F32".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4k_m_follows_llama_cpp_on_28_layers() {
        // The published 2B Q4_K_M: 14 of 28 attn_v and 14 of 28 ffn_down in Q6_K, the tied
        // embedding table Q6_K, the rest Q4_K.
        let r = Recipe::Q4KM;
        let q6: Vec<usize> = (0..28)
            .filter(|&i| r.text_type("blk.0.attn_v.weight", Some(i), 28, true, 1) == Some(QuantType::Q6K))
            .collect();
        assert_eq!(q6, vec![0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        assert_eq!(r.text_type("token_embd.weight", None, 28, true, 1), Some(QuantType::Q6K));
        assert_eq!(r.text_type("token_embd.weight", None, 28, false, 1), Some(QuantType::Q4K));
        assert_eq!(r.text_type("blk.3.attn_q.weight", Some(3), 28, true, 1), Some(QuantType::Q4K));
        // MoE (30B-A3B: 48 layers, 128 experts): the experts' ffn_down_exps follow ffn_down's
        // layer rule; the 8-expert rule (Mixtral's) moves attention K/V to Q8_0, its output to
        // Q5_K, and applies to 8 experts only.
        let down: Vec<usize> = (0..48)
            .filter(|&i| {
                r.text_type(&format!("blk.{i}.ffn_down_exps.weight"), Some(i), 48, false, 128) == Some(QuantType::Q6K)
            })
            .collect();
        assert_eq!(down.len(), 24, "{down:?}");
        assert_eq!(&down[..8], &[0, 1, 2, 3, 4, 5, 8, 11]);
        assert_eq!(r.text_type("blk.4.ffn_gate_exps.weight", Some(4), 48, false, 128), Some(QuantType::Q4K));
        assert_eq!(r.text_type("blk.6.attn_v.weight", Some(6), 48, false, 128), Some(QuantType::Q4K));
        assert_eq!(r.text_type("blk.3.attn_v.weight", Some(3), 48, false, 8), Some(QuantType::Q8_0));
        assert_eq!(r.text_type("blk.3.attn_k.weight", Some(3), 48, false, 8), Some(QuantType::Q8_0));
        assert_eq!(r.text_type("blk.3.attn_output.weight", Some(3), 48, false, 8), Some(QuantType::Q5K));
        assert_eq!(fallback(QuantType::Q4K, 32), Some(QuantType::Q5_0));
        assert_eq!(fallback(QuantType::Q6K, 96), Some(QuantType::Q8_0));
        assert_eq!(fallback(QuantType::Q8_0, 48), None);
    }
}
