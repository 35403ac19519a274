//! Shared helpers for the golden parity tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use vl_models::qwen3_vl::{Prompt, Qwen3VlConfig, VisionInput, Weights};

pub const GEOMETRIES: [&str; 2] = ["tiny-a", "tiny-b"];
pub const PROBES: [&str; 6] = ["square", "odd", "small", "large", "wide", "alpha"];
pub const CASES: [&str; 5] = ["text_only", "one_image", "two_images", "image_mid", "multi_turn"];
/// The cases the MLX fixtures were generated with (`tools/hf-reference/generate-mlx`).
/// Cases whose prompt offers tools: only tiny-b carries a template with tools (the official one).
pub const TOOL_CASES: [&str; 1] = ["tool_round"];

/// The golden cases of geometry `g`.
pub fn cases_of(g: &str) -> Vec<&'static str> {
    let mut c = CASES.to_vec();
    if g == "tiny-b" {
        c.extend(TOOL_CASES);
    }
    c
}

pub const MLX_CASES: [&str; 4] = ["text_only", "one_image", "two_images", "image_mid"];

pub fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

/// The device the parity tests run on: `VL_TEST_DEVICE` = `cpu` (the default), `cuda` or
/// `metal` (tools/gpu-check sets it; the build needs the matching feature).
/// Made once: each `Device::new_cuda(0)` is a new device to candle, and tensors of two
/// devices do not mix.
pub fn device() -> Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| match std::env::var("VL_TEST_DEVICE").as_deref() {
            Err(_) | Ok("") | Ok("cpu") => Device::Cpu,
            Ok("cuda") => {
                Device::new_cuda(0).expect("VL_TEST_DEVICE=cuda: no CUDA device (build with --features cuda)")
            }
            Ok("metal") => {
                Device::new_metal(0).expect("VL_TEST_DEVICE=metal: no Metal device (build with --features metal)")
            }
            Ok(other) => panic!("VL_TEST_DEVICE={other}: expected cpu, cuda or metal"),
        })
        .clone()
}

/// How much looser a GPU's f32 tolerances are than the CPU's: its reductions run in another
/// order and cuBLAS picks its own kernels. A first bound, to be replaced by what
/// tools/gpu-check measures (it prints every difference beside its tolerance).
pub const GPU_TOLERANCE_FACTOR: f32 = 10.0;

/// The tolerance `cpu` (a CPU f32 bound) on the test device.
pub fn tol(cpu: f32) -> f32 {
    if device().is_cpu() {
        cpu
    } else {
        cpu * GPU_TOLERANCE_FACTOR
    }
}

/// A golden file's tensors, on the test device.
pub fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &device()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn checkpoint(g: &str) -> (Qwen3VlConfig, Arc<Weights>) {
    let dir = goldens().join(g).join("checkpoint");
    (Qwen3VlConfig::from_dir(&dir).unwrap(), Arc::new(Weights::open(&dir).unwrap()))
}

/// Max absolute difference, both sides in f32.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let b = b.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

pub fn grids(t: &Tensor) -> Vec<[usize; 3]> {
    t.to_vec2::<i64>().unwrap().iter().map(|r| [r[0] as usize, r[1] as usize, r[2] as usize]).collect()
}

/// A golden case file's own prompt (a Qwen3.5 case: its ids and pixels are in the file).
pub fn case_prompt(t: &HashMap<String, Tensor>) -> Prompt {
    let ids = t["input_ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
    let images = t.get("pixel_values").map(|px| VisionInput { pixels: px.clone(), grids: grids(&t["image_grid_thw"]) });
    let videos =
        t.get("pixel_values_videos").map(|px| VisionInput { pixels: px.clone(), grids: grids(&t["video_grid_thw"]) });
    Prompt { input_ids: ids, images, videos, generated_from: None }
}

/// The golden prompt `case`: ids from prompts/, pixels from the processor goldens of its images.
pub fn prompt(case: &str) -> Prompt {
    let t = load(&goldens().join("prompts").join(format!("{case}.safetensors")));
    let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
    let ids: Vec<u32> = t["input_ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
    let names: Vec<String> =
        meta["images"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    let images = (!names.is_empty()).then(|| {
        let px: Vec<Tensor> = names
            .iter()
            .map(|n| load(&goldens().join("processor").join(format!("{n}.safetensors")))["pixel_values"].clone())
            .collect();
        VisionInput { pixels: Tensor::cat(&px, 0).unwrap(), grids: grids(&t["image_grid_thw"]) }
    });
    Prompt { input_ids: ids, images, videos: None, generated_from: None }
}

/// A golden prompt's messages (prompts/<case>.json) as the chat template takes them.
#[allow(dead_code)]
pub fn golden_messages(meta: &serde_json::Value) -> Vec<vl_models::qwen3_vl::Message> {
    use vl_models::qwen3_vl::{Content, Message, TemplateToolCall};
    meta["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let content = m["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| match c["type"].as_str().unwrap() {
                    "image" => Content::Image { image: c["image"].as_str().unwrap().into() },
                    _ => Content::Text { text: c["text"].as_str().unwrap().into() },
                })
                .collect();
            let mut msg = Message::new(m["role"].as_str().unwrap(), content);
            for c in m["tool_calls"].as_array().into_iter().flatten() {
                let f = &c["function"];
                msg.tool_calls.push(TemplateToolCall::function(f["name"].as_str().unwrap(), f["arguments"].clone()));
            }
            msg
        })
        .collect()
}

/// A golden case's messages (its JSON `messages`: text, image and video parts, assistant tool
/// calls) as engine messages: images from goldens/images, videos from goldens/videos.
pub fn chat_messages(messages: &serde_json::Value) -> Vec<vl_models::engine::ChatMessage> {
    use vl_models::engine::{ChatMessage, Part, ToolCall, VideoData};
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let parts = m["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| match c["type"].as_str().unwrap() {
                    "text" => Part::Text(c["text"].as_str().unwrap().into()),
                    "video" => {
                        let name = c["video"].as_str().unwrap();
                        let path = goldens().join("videos").join(format!("{name}.mkv"));
                        Part::Video { source: VideoData::Path(path), name: name.into(), options: Default::default() }
                    }
                    _ => {
                        let name = format!("{}.png", c["image"].as_str().unwrap());
                        let data = std::fs::read(goldens().join("images").join(&name)).unwrap();
                        Part::Image { data, name, min_pixels: None, max_pixels: None }
                    }
                })
                .collect();
            let mut msg = ChatMessage::new(m["role"].as_str().unwrap(), parts);
            for c in m["tool_calls"].as_array().into_iter().flatten() {
                msg.tool_calls.push(ToolCall {
                    name: c["function"]["name"].as_str().unwrap().into(),
                    arguments: c["function"]["arguments"].as_str().unwrap().into(),
                });
            }
            msg
        })
        .collect()
}

/// A golden prompt case (goldens/prompts/<case>.json: messages with text and image parts,
/// assistant tool calls, tools) as an engine request for `max` new tokens.
pub fn golden_request(case: &str, max: usize) -> vl_models::engine::Request {
    let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
    vl_models::engine::Request {
        messages: chat_messages(&meta["messages"]),
        options: vl_models::GenerationOptions { max_new_tokens: max, ..Default::default() },
        tools: meta["tools"].as_array().cloned().unwrap_or_default(),
        ..Default::default()
    }
}

/// The last prompt position's max |logit difference| of `m` against golden geometry `g`'s
/// reference on `case` (goldens/<g>/cases), and whether the greedy ids equal the reference's.
pub fn against_reference(m: &vl_models::qwen3_vl::Qwen3VlModel, g: &str, case: &str) -> (f32, bool) {
    let want = load(&goldens().join(g).join("cases").join(format!("{case}.safetensors")));
    let p = prompt(case);
    let mut cache = m.new_cache();
    let state = m.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
    let d = max_abs_diff(&m.last_logits(&state).unwrap(), &want["logits.last"]);
    let want_ids: Vec<u32> = want["greedy.ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
    (d, greedy(m, &p, want_ids.len(), &[]).unwrap().0 == want_ids)
}

/// Greedy ids of `m` on `p`, at most `n`, driving the model directly (prefill, then one decode
/// step per token; the engine's scheduler is the library's one generation loop): the tokens
/// (an eos id included when it ended them) and whether an eos id ended them.
pub fn greedy(
    m: &vl_models::qwen3_vl::Qwen3VlModel,
    p: &Prompt,
    n: usize,
    eos: &[u32],
) -> vl_models::Result<(Vec<u32>, bool)> {
    let mut cache = m.new_cache();
    let state = m.prefill(p, &mut cache, &mut |_, _| {})?;
    let mut logits = m.last_logits(&state)?;
    let mut out = Vec::with_capacity(n);
    for step in 0..n {
        let v = logits.to_vec1::<f32>()?;
        let next = (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b]).then(b.cmp(&a))).unwrap_or(0) as u32;
        out.push(next);
        if eos.contains(&next) {
            return Ok((out, true));
        }
        if step + 1 < n {
            logits = m.decode_step(next, &state, step, &mut cache)?;
        }
    }
    Ok((out, false))
}

/// `e`'s answer to `r`, and the text its streamed pieces add up to.
pub fn answer_streamed(
    e: &vl_models::engine::Engine,
    r: &vl_models::engine::Request,
) -> (vl_models::engine::Completion, String) {
    let mut streamed = String::new();
    let c = e
        .generate(r, &mut |p| {
            streamed.push_str(p);
            true
        })
        .unwrap();
    (c, streamed)
}
