//! Processor and prompt parity with the reference: grids and token counts identical, pixel
//! values within a measured bound; rendered prompts, input_ids and token types identical;
//! streaming detokenization never splits a character.

mod common;

use candle_core::{DType, Device};
use common::*;
use vl_models::qwen3_vl::positions::token_types;
use vl_models::qwen3_vl::{ImageProcessor, Message, Processor};

/// Max |diff| on the normalized scale ([-1, 1]); mean bound below.
const PIXEL_MAX: f32 = 0.02;
const PIXEL_MEAN: f32 = 0.002;
/// JPEG decoders differ by a few levels after IDCT and chroma upsampling (measured 0.031 with
/// jpeg-decoder against Pillow's libjpeg-turbo; the `image` crate's decoder gave 0.11).
const JPEG_MAX: f32 = 0.04;

fn image_files() -> Vec<(&'static str, String)> {
    let mut v: Vec<(&str, String)> = PROBES.iter().map(|p| (*p, format!("{p}.png"))).collect();
    v.extend([
        ("gray", "gray.png".into()),
        ("palette", "palette.png".into()),
        ("jpeg", "photo.jpg".into()),
        ("webp", "tall.webp".into()),
        ("gif", "anim.gif".into()),
        ("bmp", "plain.bmp".into()),
    ]);
    v
}

fn processor() -> ImageProcessor {
    ImageProcessor::from_dir(&goldens().join("tiny-a/checkpoint")).unwrap()
}

fn compare(name: &str, proc: &ImageProcessor, file: &str, golden: &str) -> (f32, f32) {
    let got = proc.process_file(&goldens().join("images").join(file)).unwrap();
    let want = load(&goldens().join("processor").join(format!("{golden}.safetensors")));
    assert_eq!(vec![got.grid], grids(&want["image_grid_thw"]), "{name}: grid");
    let wp = want["pixel_values"].to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(got.pixels.len(), wp.len(), "{name}: pixel count");
    let diffs: Vec<f32> = got.pixels.iter().zip(&wp).map(|(a, b)| (a - b).abs()).collect();
    let max = diffs.iter().cloned().fold(0.0, f32::max);
    let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
    println!("{name}: grid {:?}, {} tokens, pixel max|diff| {max:.4}, mean {mean:.2e}", got.grid, got.num_tokens(2));
    (max, mean)
}

#[test]
fn pixel_values_match_the_reference_processor() {
    let proc = processor();
    for (name, file) in image_files() {
        let (max, mean) = compare(name, &proc, &file, name);
        let bound = if name == "jpeg" { JPEG_MAX } else { PIXEL_MAX };
        assert!(max <= bound && mean <= PIXEL_MEAN, "{name}: max {max}, mean {mean}");
    }
}

#[test]
fn pixel_budget_overrides_match_the_reference() {
    let p = processor().with_pixel_budget(Some(64 * 64), Some(128 * 128)).unwrap();
    let (max, mean) = compare("large@max16384", &p, "large.png", "large@max16384");
    assert!(max <= PIXEL_MAX && mean <= PIXEL_MEAN);
    let p = processor().with_pixel_budget(Some(128 * 128), Some(256 * 256)).unwrap();
    let (max, mean) = compare("small@min16384", &p, "small.png", "small@min16384");
    assert!(max <= PIXEL_MAX && mean <= PIXEL_MEAN);
    let p = processor().with_pixel_budget(Some(64 * 64), Some(640 * 480)).unwrap();
    let (max, mean) = compare("large@max307200", &p, "large.png", "large@max307200");
    assert!(max <= PIXEL_MAX && mean <= PIXEL_MEAN);
}

fn tools(meta: &serde_json::Value) -> Option<Vec<serde_json::Value>> {
    meta["tools"].as_array().cloned()
}

#[test]
fn prompts_match_the_reference_processor() {
    for g in GEOMETRIES {
        let proc = Processor::from_dir(&goldens().join(g).join("checkpoint")).unwrap();
        for case in cases_of(g) {
            let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
            let want = load(&goldens().join("prompts").join(format!("{case}.safetensors")));
            let msgs = golden_messages(&meta);
            let tools = tools(&meta);
            assert_eq!(
                proc.template.render_with(&msgs, tools.as_deref(), true).unwrap(),
                meta["prompt"].as_str().unwrap(),
                "{g}/{case}: rendered"
            );
            let images: Vec<_> = meta["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| {
                    proc.images
                        .process_file(&goldens().join("images").join(format!("{}.png", n.as_str().unwrap())))
                        .unwrap()
                })
                .collect();
            let prompt = proc.prepare_with(&msgs, tools.as_deref(), &images, &Device::Cpu).unwrap();
            let want_ids: Vec<u32> = want["input_ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
            assert_eq!(prompt.input_ids, want_ids, "{g}/{case}: input_ids");
            let types: Vec<i64> = token_types(&prompt.input_ids, 151655, 151656).iter().map(|&t| t as i64).collect();
            assert_eq!(types, want["mm_token_type_ids"].to_vec1::<i64>().unwrap(), "{g}/{case}: token types");
            if let Some(img) = &prompt.images {
                assert_eq!(img.grids, grids(&want["image_grid_thw"]));
            }
            println!("{g}/{case}: {} tokens identical", want_ids.len());
        }
    }
}

#[test]
fn greedy_text_decodes_like_the_reference() {
    for g in GEOMETRIES {
        let proc = Processor::from_dir(&goldens().join(g).join("checkpoint")).unwrap();
        for case in cases_of(g) {
            let meta = read_json(&goldens().join(g).join("cases").join(format!("{case}.json")));
            let ids: Vec<u32> =
                meta["greedy"]["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(proc.decode(&ids, false).unwrap(), meta["greedy"]["text"].as_str().unwrap(), "{g}/{case}");
        }
    }
}

#[test]
fn streaming_never_splits_a_character() {
    let proc = Processor::from_dir(&goldens().join("tiny-a/checkpoint")).unwrap();
    let text = "Ünïcödé 🌊 漢字かな 👩‍👩‍👧 done.";
    let ids = proc.encode(text).unwrap();
    assert!(ids.len() > 10);
    // At least one character must span several tokens for this test to mean anything.
    let lone: Vec<String> = ids.iter().map(|&i| proc.decode(&[i], false).unwrap()).collect();
    assert!(lone.iter().any(|s| s.contains('\u{FFFD}')), "{lone:?}");
    let mut dec = proc.stream_decoder();
    let mut out = String::new();
    for &id in &ids {
        if let Some(piece) = dec.push(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "broken piece {piece:?}");
            out.push_str(&piece);
        }
    }
    if let Some(rest) = dec.finish().unwrap() {
        out.push_str(&rest);
    }
    assert_eq!(out, text);
}

#[test]
fn bad_images_are_named() {
    let proc = processor();
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join("junk.png");
    std::fs::write(&junk, b"\x89PNG\r\n\x1a\nnot really").unwrap();
    let err = proc.process_file(&junk).unwrap_err().to_string();
    assert!(err.contains("junk.png") && err.contains("decode"), "{err}");
    let txt = tmp.path().join("notes.txt");
    std::fs::write(&txt, b"hello").unwrap();
    let err = proc.process_file(&txt).unwrap_err().to_string();
    assert!(err.contains("notes.txt"), "{err}");
    let thin = tmp.path().join("thin.png");
    image::RgbImage::new(402, 2).save(&thin).unwrap();
    let err = proc.process_file(&thin).unwrap_err().to_string();
    assert!(err.contains("thin.png") && err.contains("aspect ratio"), "{err}");
    let err = proc.process_file(&tmp.path().join("missing.png")).unwrap_err().to_string();
    assert!(err.contains("missing.png"), "{err}");
}

#[test]
fn only_a_template_with_tools_takes_them() {
    let official = Processor::from_dir(&goldens().join("tiny-b/checkpoint")).unwrap();
    assert!(official.template.takes_tools());
    // tiny-a ships the built-in template, which has no `tools` variable: tools are refused with
    // a message that says so, not silently dropped.
    let builtin = Processor::from_dir(&goldens().join("tiny-a/checkpoint")).unwrap();
    assert!(!builtin.template.takes_tools());
    let tool = serde_json::json!({"type": "function", "function": {"name": "f"}});
    let e = builtin.template.render_with(&[Message::text("user", "hi")], Some(&[tool]), true).unwrap_err();
    assert!(e.to_string().contains("no `tools` variable"), "{e}");
    // No tools (or an empty list) renders as without them.
    assert_eq!(
        official.template.render_with(&[Message::text("user", "hi")], Some(&[]), true).unwrap(),
        official.template.render(&[Message::text("user", "hi")], true).unwrap()
    );
}
