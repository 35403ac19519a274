//! Qwen3-VL-Embedding through the engine against the pinned reference (goldens/tiny-embed,
//! made by `tools/hf-reference/generate --embedding` with the official prompt and pooling): the
//! checkpoint is found as an embedding model from its Sentence Transformers files, each case's
//! prompt ids equal the reference's, and its vector is within 1e-4 per component (cosine at
//! least 0.9999), truncated dimensions included.

mod common;

use common::*;
use vl_models::engine::truncated;
use vl_models::engine::{Engine, EngineOptions};
use vl_models::family::Pooled;
use vl_models::{ChatMessage, Part, Request};

fn request(case: &serde_json::Value) -> Request {
    let mut parts: Vec<Part> = case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| Part::image_file(goldens().join("images").join(n.as_str().unwrap())).unwrap())
        .collect();
    // The order the caller gives does not matter: texts first here, the prompt puts images first.
    let texts: Vec<Part> = case["texts"].as_array().unwrap().iter().map(|t| Part::text(t.as_str().unwrap())).collect();
    parts.splice(0..0, texts);
    let mut messages = vec![];
    if let Some(i) = case["instruction"].as_str() {
        messages.push(ChatMessage::text("system", i));
    }
    if !parts.is_empty() {
        messages.push(ChatMessage::user(parts));
    }
    Request { messages, ..Default::default() }
}

#[test]
fn embeddings_match_the_official_pooling() {
    let golden = read_json(&goldens().join("tiny-embed/embeddings.json"));
    let engine = Engine::load(&goldens().join("tiny-embed/checkpoint"), EngineOptions::default()).unwrap();
    let Some(Pooled::Embedding { dims }) = engine.pooled() else { panic!("not loaded as an embedding model") };
    let cases = golden["cases"].as_array().unwrap();
    let reqs: Vec<Request> = cases.iter().map(request).collect();
    let out = engine.pool(&reqs).unwrap();
    for (case, got) in cases.iter().zip(&out) {
        let name = case["case"].as_str().unwrap();
        let want: Vec<f32> = case["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        assert_eq!(got.values.len(), dims);
        assert_eq!(got.prompt_tokens, case["ids"].as_array().unwrap().len(), "{name}: prompt length");
        let worst = got.values.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let cosine: f32 = got.values.iter().zip(&want).map(|(a, b)| a * b).sum();
        println!("{name}: max |diff| {worst:.2e}, cosine {cosine:.6}");
        assert!(worst <= 1e-4 && cosine >= 0.9999, "{name}: max |diff| {worst:e}, cosine {cosine}");
        let d = case["dims"].as_u64().unwrap() as usize;
        let want_cut: Vec<f32> =
            case["truncated"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let cut = truncated(&got.values, d).unwrap();
        let worst = cut.iter().zip(&want_cut).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{name}: truncated to {d}: {worst:e}");
    }
    // The cases with the default instruction share its turn: prefilled once (charged to the
    // one that carried it), and the others above were pooled from it.
    let default = cases.iter().filter(|c| c["instruction"].is_null()).count();
    let served = out.iter().filter(|o| o.cached_tokens >= 8).count();
    assert!(default >= 3 && served + 1 >= default, "{served} of {default} prompts served a shared prefix");
    // It writes no text.
    let err = engine.generate(&reqs[0], &mut |_| true).unwrap_err().to_string();
    assert!(err.contains("is an embedding model"), "{err}");
}

#[test]
fn sentence_transformer_files_decide_the_family_and_unknown_heads_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = goldens().join("tiny-embed/checkpoint");
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        let to = std::fs::canonicalize(e.path()).unwrap();
        std::os::unix::fs::symlink(&to, dir.path().join(e.file_name())).unwrap();
    }
    // A head this build does not run: refused by name.
    std::fs::remove_file(dir.path().join("modules.json")).unwrap();
    std::fs::write(
        dir.path().join("modules.json"),
        r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.models.Dense"}]"#,
    )
    .unwrap();
    let err = Engine::load(dir.path(), EngineOptions::default()).err().unwrap().to_string();
    assert!(err.contains("sentence_transformers.models.Dense") && err.contains("modules.json"), "{err}");
    // A pooling other than the last token (the module in a folder of its own, named in another
    // namespace): refused, naming the file.
    std::fs::create_dir(dir.path().join("2_Pool")).unwrap();
    std::fs::write(dir.path().join("2_Pool/config.json"), r#"{"pooling_mode_mean_tokens": true}"#).unwrap();
    std::fs::write(
        dir.path().join("modules.json"),
        r#"[{"type": "sentence_transformers.base.modules.transformer.Transformer", "path": ""},
            {"type": "sentence_transformers.models.Pooling", "path": "2_Pool"}]"#,
    )
    .unwrap();
    let err = Engine::load(dir.path(), EngineOptions::default()).err().unwrap().to_string();
    assert!(err.contains("pooling_mode_mean_tokens") && err.contains("2_Pool/config.json"), "{err}");
    // A module path that leaves the checkpoint: refused, naming it.
    std::fs::write(
        dir.path().join("modules.json"),
        r#"[{"type": "sentence_transformers.models.Pooling", "path": "/etc"}]"#,
    )
    .unwrap();
    let err = Engine::load(dir.path(), EngineOptions::default()).err().unwrap().to_string();
    assert!(err.contains("\"/etc\"") && err.contains("leaves the checkpoint"), "{err}");
}

/// Videos as the official embedder reads a video file (goldens/tiny-embed/videos.json, made by
/// `tools/hf-reference/generate --embedding-video`): 1 frame a second, an even count, each frame
/// sized alone by qwen-vl-utils' bounds (an odd 5-frame clip takes 4; 48x48 frames grow to 128
/// tokens or more). The prompt's ids (its timestamps and pads) equal the reference's, and the
/// vector is within 1e-4 per component.
#[test]
fn video_embeddings_match_the_official_sizing() {
    let golden = read_json(&goldens().join("tiny-embed/videos.json"));
    let engine = Engine::load(&goldens().join("tiny-embed/checkpoint"), EngineOptions::default()).unwrap();
    for case in golden["cases"].as_array().unwrap() {
        let name = case["case"].as_str().unwrap();
        let mut parts = vec![Part::video_file(goldens().join("videos").join(case["video"].as_str().unwrap()))];
        parts.extend(case["texts"].as_array().unwrap().iter().map(|t| Part::text(t.as_str().unwrap())));
        let mut messages = vec![];
        if let Some(i) = case["instruction"].as_str() {
            messages.push(ChatMessage::text("system", i));
        }
        messages.push(ChatMessage::user(parts));
        let req = Request { messages, ..Default::default() };
        let ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(engine.count_tokens(&req).unwrap(), ids.len(), "{name}: prompt length");
        let got = &engine.pool(std::slice::from_ref(&req)).unwrap()[0];
        let want: Vec<f32> = case["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let worst = got.values.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("{name}: {} video tokens, max |diff| {worst:.2e}", got.video_tokens);
        assert!(worst <= 1e-4, "{name}: max |diff| {worst:e}");
    }
}
