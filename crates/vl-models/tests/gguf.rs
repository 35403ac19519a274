//! GGUF files made by llama.cpp's own converter from the tiny-a golden checkpoint (f32): the
//! hyperparameters, tokenizer and chat template read from the metadata give the reference's
//! input ids; the model gives the reference's logits (<= 1e-3) and greedy ids. Hostile headers
//! are errors naming the file and the field.

mod common;

use std::io::Write;

use candle_core::{DType, Device};
use common::*;
use vl_models::qwen3_vl::gguf::{check_header, find_files, GgufModel};
use vl_models::qwen3_vl::{GenerationOptions, Qwen3VlConfig};

fn pair() -> GgufModel {
    let dir = goldens().join("gguf");
    let (text, mmproj) = find_files(&dir, None).unwrap();
    GgufModel::open(&text, mmproj.as_deref()).unwrap()
}

#[test]
fn metadata_gives_the_checkpoint_config() {
    let g = pair();
    let want = Qwen3VlConfig::from_dir(&goldens().join("tiny-a/checkpoint")).unwrap();
    let mut got = g.config.clone();
    // The GGUF stores eps as f32.
    assert!((got.text.rms_norm_eps - want.text.rms_norm_eps).abs() < 1e-12);
    got.text.rms_norm_eps = want.text.rms_norm_eps;
    got.unknown_keys = want.unknown_keys.clone();
    assert_eq!(got, want);
    assert_eq!(g.eos_token_ids(), vec![151645, 151643]);
}

#[test]
fn tokenizer_and_template_from_the_gguf_give_the_reference_ids() {
    let g = pair();
    let proc = g.processor().unwrap();
    let proc = vl_models::qwen3_vl::Processor {
        images: proc.images.clone().with_pixel_budget(Some(64 * 64), Some(256 * 256)).unwrap(),
        ..proc
    };
    for case in CASES {
        let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
        let want = load(&goldens().join("prompts").join(format!("{case}.safetensors")));
        let want_ids: Vec<u32> = want["input_ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
        // The rendered prompt (image pads expanded as the reference did) through the GGUF's tokenizer.
        let text = meta["prompt"].as_str().unwrap();
        let prompt = prompt(case);
        let mut expanded = String::new();
        let mut rest = text;
        let merge = 4;
        for grid in prompt.images.as_ref().map(|i| i.grids.clone()).unwrap_or_default() {
            let at = rest.find("<|image_pad|>").unwrap();
            expanded.push_str(&rest[..at]);
            expanded.push_str(&"<|image_pad|>".repeat(grid[0] * grid[1] * grid[2] / merge));
            rest = &rest[at + "<|image_pad|>".len()..];
        }
        expanded.push_str(rest);
        assert_eq!(proc.encode(&expanded).unwrap(), want_ids, "{case}: ids from the GGUF tokenizer");
        // The GGUF's chat template renders the golden prompt.
        let msgs: Vec<vl_models::qwen3_vl::Message> = meta["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let content = m["content"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| match c["type"].as_str().unwrap() {
                        "image" => vl_models::qwen3_vl::Content::Image { image: c["image"].as_str().unwrap().into() },
                        _ => vl_models::qwen3_vl::Content::Text { text: c["text"].as_str().unwrap().into() },
                    })
                    .collect();
                vl_models::qwen3_vl::Message::new(m["role"].as_str().unwrap(), content)
            })
            .collect();
        assert_eq!(proc.template.render(&msgs, true).unwrap(), text, "{case}: template");
    }
    // Decoding keeps special tokens as the checkpoint's tokenizer does.
    assert_eq!(proc.decode(&[151644, 872, 151645], false).unwrap(), "<|im_start|>user<|im_end|>");
}

#[test]
fn f32_gguf_logits_and_greedy_ids_match_the_reference() {
    let m = pair().load_model(DType::F32, &Device::Cpu).unwrap();
    for case in CASES {
        let want = load(&goldens().join("tiny-a/cases").join(format!("{case}.safetensors")));
        let p = prompt(case);
        let mut cache = m.new_cache();
        let state = m.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
        let d = max_abs_diff(&m.last_logits(&state).unwrap(), &want["logits.last"]);
        let want_ids: Vec<u32> = want["greedy.ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
        let opts = GenerationOptions { max_new_tokens: want_ids.len(), ..Default::default() };
        let gen = m.generate(&p, &opts, &mut |_| true).unwrap();
        println!("gguf f32 {case}: last logits max|diff| {d:.2e}");
        assert!(d <= 1e-3, "{case}: {d}");
        assert_eq!(gen.tokens, want_ids, "{case}");
    }
}

fn header_error(bytes: &[u8]) -> String {
    let mut f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    f.write_all(bytes).unwrap();
    let e = check_header(f.path()).unwrap_err().to_string();
    assert!(e.contains(&f.path().display().to_string()), "{e}");
    e
}

/// A GGUF v3 header with these counts and raw bytes after them.
fn header(tensors: u64, kvs: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(tensors.to_le_bytes());
    b.extend(kvs.to_le_bytes());
    b.extend(rest);
    b
}

#[test]
fn hostile_and_truncated_headers_are_named_errors() {
    let real = std::fs::read(goldens().join("gguf/mmproj-tiny-a-f32.gguf")).unwrap();
    assert!(header_error(&real[..real.len() - 100]).contains("past the end of the file"));
    assert!(header_error(&real[..2000]).contains("truncated header"));
    assert!(header_error(b"GGML\x03\0\0\0").contains("not a GGUF file"));
    let mut v1 = real[..64].to_vec();
    v1[4] = 1;
    assert!(header_error(&v1).contains("version 1"));
    assert!(header_error(&header(u64::MAX, 0, &[])).contains("tensor count"));
    assert!(header_error(&header(0, u64::MAX, &[])).contains("metadata count"));
    // A key of 2^60 bytes.
    assert!(header_error(&header(0, 1, &(1u64 << 60).to_le_bytes())).contains("exceeds"));
    // An array claiming 2^62 elements.
    let mut kv = 1u64.to_le_bytes().to_vec();
    kv.extend(b"a");
    kv.extend(9u32.to_le_bytes());
    kv.extend(0u32.to_le_bytes());
    kv.extend((1u64 << 62).to_le_bytes());
    assert!(header_error(&header(0, 1, &kv)).contains("longer than the file"));
    // A tensor of an unsupported type (IQ2_XXS), and one past the end.
    let tensor = |ty: u32, offset: u64| {
        let mut t = 1u64.to_le_bytes().to_vec();
        t.extend(b"w");
        t.extend(2u32.to_le_bytes());
        t.extend(256u64.to_le_bytes());
        t.extend(1u64.to_le_bytes());
        t.extend(ty.to_le_bytes());
        t.extend(offset.to_le_bytes());
        header(1, 0, &t)
    };
    assert!(header_error(&tensor(16, 0)).contains("IQ2_XXS"));
    assert!(header_error(&tensor(0, 1 << 40)).contains("past the end"));
    // A text GGUF of another architecture is refused by name.
    let mut other = std::fs::read(goldens().join("gguf/tiny-a-f32.gguf")).unwrap();
    let at = other.windows(7).position(|w| w == b"qwen3vl").unwrap();
    other[at..at + 7].copy_from_slice(b"llama3x");
    let mut f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    f.write_all(&other).unwrap();
    let e = GgufModel::open(f.path(), None).err().unwrap().to_string();
    assert!(e.contains("not a Qwen3-VL text model"), "{e}");
}

#[test]
fn images_without_an_mmproj_are_refused() {
    let dir = goldens().join("gguf");
    let (text, _) = find_files(&dir, None).unwrap();
    let g = GgufModel::open(&text, None).unwrap();
    let e = g.load_vision(DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("mmproj"), "{e}");
}
