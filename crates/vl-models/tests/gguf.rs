//! GGUF files made by llama.cpp's own converter from the tiny-a golden checkpoint (f32): the
//! hyperparameters, tokenizer and chat template read from the metadata give the reference's
//! input ids; the model gives the reference's logits (<= 1e-3) and greedy ids. Hostile headers
//! are errors naming the file and the field.

mod common;

use std::io::Write;

use candle_core::{DType, Device};
use common::*;
use vl_models::qwen3_vl::gguf::{check_header, find_files, GgufModel};
use vl_models::qwen3_vl::Qwen3VlConfig;
use vl_models::GenerationOptions;

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
        let msgs = golden_messages(&meta);
        assert_eq!(proc.template.render(&msgs, true).unwrap(), text, "{case}: template");
    }
    // Decoding keeps special tokens as the checkpoint's tokenizer does.
    assert_eq!(proc.decode(&[151644, 872, 151645], false).unwrap(), "<|im_start|>user<|im_end|>");
}

#[test]
fn the_gguf_tokenizer_is_the_checkpoints_tokenizer_json() {
    // The GGUF's vocabulary, merges and added tokens (written by llama.cpp's converter from the
    // checkpoint) against the checkpoint's own tokenizer.json, loaded by the tokenizers crate.
    let g = pair().processor().unwrap().tokenizer;
    let hf = tokenizers::Tokenizer::from_file(goldens().join("tiny-a/checkpoint/tokenizer.json")).unwrap();
    assert_eq!(g.get_vocab_size(true), hf.get_vocab_size(true));
    for id in 0..hf.get_vocab_size(true) as u32 {
        assert_eq!(g.id_to_token(id), hf.id_to_token(id), "token {id}");
    }
    let text = "Hello, world! 你好，世界。 Ça va? 1234567 tabs\tand\nnewlines  <|im_start|>user\n\
                <think>x</think> <|vision_start|><|image_pad|><|vision_end|> émojis 🙂👍 it's we'll";
    for special in [false, true] {
        let want = hf.encode(text, special).unwrap();
        let got = g.encode(text, special).unwrap();
        assert_eq!(got.get_ids(), want.get_ids(), "add_special_tokens {special}");
        assert_eq!(g.decode(got.get_ids(), false).unwrap(), hf.decode(want.get_ids(), false).unwrap());
        assert_eq!(g.decode(got.get_ids(), true).unwrap(), hf.decode(want.get_ids(), true).unwrap());
    }
}

#[test]
fn f32_gguf_logits_and_greedy_ids_match_the_reference() {
    let m = pair().load_model(DType::F32, &Device::Cpu).unwrap();
    for case in CASES {
        let (d, same_greedy) = against_reference(&m, "tiny-a", case);
        println!("gguf f32 {case}: last logits max|diff| {d:.2e}");
        assert!(d <= 1e-3, "{case}: {d}");
        assert!(same_greedy, "{case}: greedy ids differ");
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
    // Arrays that exist but would take 32x their bytes once parsed: refused by the walk, before
    // candle allocates (generated: u8, i32 and string arrays over the 256 MiB budget, split
    // across keys or not).
    for (ty, elem, n, keys) in
        [(0u32, vec![7u8], 6u64 << 20, 1), (5, vec![1, 0, 0, 0], 3 << 20, 2), (8, vec![0u8; 8], 3 << 20, 2)]
    {
        let mut kvs = Vec::new();
        for k in 0..keys {
            kvs.extend(2u64.to_le_bytes());
            kvs.extend(format!("a{k}").as_bytes());
            kvs.extend(9u32.to_le_bytes());
            kvs.extend(ty.to_le_bytes());
            kvs.extend(n.to_le_bytes());
            for _ in 0..n {
                kvs.extend(&elem);
            }
        }
        let e = header_error(&header(0, keys, &kvs));
        assert!(e.contains("would take more than") && e.contains("over the limit of 256 MiB"), "{e}");
    }
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
    assert!(e.contains("not a Qwen3-VL or Qwen3.5 text model") && e.contains("llama3x"), "{e}");
}

#[test]
fn general_alignment_of_any_integer_type_is_checked() {
    // general.alignment stored as each integer type: bad values (0, not a power of two,
    // negative, huge) are named errors, never a division by zero; good ones pass the walk.
    let kv = |ty: u32, raw: &[u8]| {
        let key = b"general.alignment";
        let mut kv = (key.len() as u64).to_le_bytes().to_vec();
        kv.extend(key);
        kv.extend(ty.to_le_bytes());
        kv.extend(raw);
        header(0, 1, &kv)
    };
    let cases: Vec<(u32, Vec<u8>, Option<i64>)> = vec![
        (0, vec![0], Some(0)),
        (0, vec![3], Some(3)),
        (0, vec![32], None),
        (1, vec![0xe0], Some(-32)),
        (2, 0u16.to_le_bytes().to_vec(), Some(0)),
        (2, 64u16.to_le_bytes().to_vec(), None),
        (3, (-1i16).to_le_bytes().to_vec(), Some(-1)),
        (4, 0u32.to_le_bytes().to_vec(), Some(0)),
        (4, 48u32.to_le_bytes().to_vec(), Some(48)),
        (4, 32u32.to_le_bytes().to_vec(), None),
        (5, (-64i32).to_le_bytes().to_vec(), Some(-64)),
        (4, (1u32 << 30).to_le_bytes().to_vec(), Some(1 << 30)),
        (5, 256i32.to_le_bytes().to_vec(), None),
    ];
    for (ty, raw, bad) in cases {
        let bytes = kv(ty, &raw);
        let mut f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
        f.write_all(&bytes).unwrap();
        match (check_header(f.path()), bad) {
            (Err(e), Some(v)) => {
                let e = e.to_string();
                assert!(e.contains(&format!("general.alignment = {v} is not a power of two")), "type {ty}: {e}");
            }
            (Ok(_), None) => {}
            (r, want) => panic!("type {ty} {raw:?}: {:?}, wanted an error for {want:?}", r.map(|_| ())),
        }
    }
    // A float, and a 64-bit integer (candle would ignore it and read the data at 32), are named.
    for (ty, raw) in [(6, 1.0f32.to_le_bytes().to_vec()), (10, 64u64.to_le_bytes().to_vec())] {
        let e = header_error(&kv(ty, &raw));
        assert!(e.contains(&format!("general.alignment has type {ty}, not an integer of 8 to 32 bits")), "{e}");
    }
}

#[test]
fn a_tensor_set_that_does_not_match_the_metadata_is_named() {
    // Rename one tensor of the reference file (same length, so the header stays valid): it is
    // reported as unexpected, and the one it replaced as missing, both by their GGUF names.
    let mut b = std::fs::read(goldens().join("gguf/tiny-a-f32.gguf")).unwrap();
    let at = b.windows(19).position(|w| w == b"blk.1.attn_q.weight").unwrap();
    b[at..at + 19].copy_from_slice(b"blk.1.attn_z.weight");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("m.gguf");
    std::fs::write(&f, &b).unwrap();
    let e = GgufModel::open(&f, None).err().unwrap().to_string();
    assert!(e.contains("blk.1.attn_z.weight") && e.contains("blk.1.attn_q.weight"), "{e}");
}

#[test]
fn images_without_an_mmproj_are_refused() {
    let dir = goldens().join("gguf");
    let (text, _) = find_files(&dir, None).unwrap();
    let g = GgufModel::open(&text, None).unwrap();
    let e = g.load_vision(DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("mmproj"), "{e}");
    // The engine on the text model alone (a directory without an mmproj beside it): it loads,
    // answers text, and refuses an image naming --mmproj.
    use vl_models::engine::{ChatMessage, Engine, EngineOptions, Request};
    let only = tempfile::tempdir().unwrap();
    let file = only.path().join("tiny-a-f32.gguf");
    std::fs::copy(&text, &file).unwrap();
    let e = Engine::open(&file, None, EngineOptions::default()).unwrap();
    let req = Request {
        messages: vec![ChatMessage::text("user", "Hello")],
        options: GenerationOptions { max_new_tokens: 4, ..Default::default() },
        ..Default::default()
    };
    assert_eq!(e.generate(&req, &mut |_| true).unwrap().token_ids.len(), 4);
    let err = e.generate(&one_image(), &mut |_| true).unwrap_err().to_string();
    assert!(err.contains("--mmproj"), "{err}");
}

fn one_image() -> vl_models::engine::Request {
    use vl_models::engine::{ChatMessage, Part, Request};
    let data = std::fs::read(goldens().join("images/square.png")).unwrap();
    Request {
        messages: vec![ChatMessage::new(
            "user",
            vec![
                Part::Image { data, name: "square.png".into(), min_pixels: None, max_pixels: None },
                Part::Text("Describe this image.".into()),
            ],
        )],
        options: GenerationOptions { max_new_tokens: 8, ..Default::default() },
        ..Default::default()
    }
}

#[test]
fn a_saved_gguf_loads_back_bit_identical_and_answers_the_same() {
    use vl_models::engine::{Engine, EngineOptions, ModelOptions};
    use vl_models::qwen3_vl::gguf_write::{save, Recipe};
    use vl_models::qwen3_vl::ModelDir;
    use vl_nn::QuantType;
    let out = tempfile::tempdir().unwrap();
    let ck = goldens().join("tiny-a/checkpoint");
    let w =
        save(&ModelDir::open(&ck).unwrap(), Recipe::Uniform(QuantType::Q8_0), out.path(), false, &mut |_| {}).unwrap();
    let (text, mmproj) = (w.text, w.mmproj);
    assert!(text.file_name().unwrap().to_string_lossy().ends_with("-Q8_0.gguf"));
    assert!(mmproj.file_name().unwrap().to_string_lossy().starts_with("mmproj-"));
    assert!(mmproj.file_name().unwrap().to_string_lossy().ends_with("-F32.gguf"));
    // Stored tensors: the bytes our quantizer makes from the checkpoint's weights.
    let g = GgufModel::open(&text, Some(&mmproj)).unwrap();
    let w = vl_models::qwen3_vl::Weights::open(&ck).unwrap();
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(&text).unwrap();
    for (name, key) in [
        ("blk.1.attn_v.weight", "model.language_model.layers.1.self_attn.v_proj.weight"),
        ("token_embd.weight", "model.language_model.embed_tokens.weight"),
    ] {
        let stored = g.text.content.tensor(&mut f, name, &dev).unwrap();
        let fresh = vl_nn::linear::quantize_rows(&w.load(key, DType::F32, &dev).unwrap(), QuantType::Q8_0).unwrap();
        assert_eq!(stored.data().unwrap(), fresh.data().unwrap(), "{name}");
    }
    // The same answer as quantizing at load: identical logits, identical ids.
    let opts = EngineOptions {
        model: ModelOptions { quant: Some(QuantType::Q8_0), ..Default::default() },
        image_cache_bytes: 0,
        prefix_cache: false,
        ..Default::default()
    };
    let a = Engine::load(&ck, opts.clone()).unwrap().generate(&one_image(), &mut |_| true).unwrap();
    let opts = EngineOptions { image_cache_bytes: 0, prefix_cache: false, ..Default::default() };
    let b = Engine::open(out.path(), None, opts).unwrap().generate(&one_image(), &mut |_| true).unwrap();
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.prompt_tokens, b.prompt_tokens);
    // f32 checkpoint: the mmproj stays f32, so the whole answer is bit-identical.
    let d = a.first_logits.iter().zip(&b.first_logits).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert_eq!(d, 0.0, "logits differ between the saved GGUF and quantizing at load");
}

#[test]
fn q4k_m_writes_llama_cpp_types_and_runs() {
    use vl_models::qwen3_vl::gguf_write::{save, Recipe};
    use vl_models::qwen3_vl::ModelDir;
    let out = tempfile::tempdir().unwrap();
    let ck = goldens().join("tiny-q-mlx8/checkpoint");
    let w = save(&ModelDir::open(&ck).unwrap(), Recipe::Q4KM, out.path(), false, &mut |_| {}).unwrap();
    // Every matrix fell back (rows of 64 and 128 values), none stayed float.
    assert_eq!(w.fell_back, w.stored.values().sum::<usize>());
    assert!(w.stored.keys().all(|k| k == "Q5_0" || k == "Q8_0"), "{:?}", w.stored);
    let (text, mmproj) = (w.text, w.mmproj);
    let g = GgufModel::open(&text, Some(&mmproj)).unwrap();
    let ty = |n: &str| format!("{:?}", g.text.content.tensor_infos[n].ggml_dtype);
    // Rows of 64 and 128 values cannot hold 256-value k-quant blocks: llama.cpp's fallbacks
    // (Q4_K -> Q5_0, Q6_K -> Q8_0), as llama-quantize writes them.
    assert_eq!(ty("token_embd.weight"), "Q8_0");
    assert_eq!(ty("blk.0.attn_q.weight"), "Q5_0");
    // 2 layers: use_more_bits picks layer 1 (i >= 7n/8), not layer 0.
    assert_eq!(ty("blk.0.attn_v.weight"), "Q5_0");
    assert_eq!(ty("blk.1.attn_v.weight"), "Q8_0");
    assert_eq!(ty("blk.1.ffn_down.weight"), "Q8_0");
    assert_eq!(ty("blk.0.attn_norm.weight"), "F32");
    let m = g.load_model(DType::F32, &Device::Cpu).unwrap();
    let p = prompt("one_image");
    let want = load(&goldens().join("tiny-q-mlx8/cases/one_image.safetensors"));
    let mut cache = m.new_cache();
    let state = m.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
    let got = m.last_logits(&state).unwrap();
    let d = max_abs_diff(&got, &want["logits.last"]);
    let scale = want["logits.last"].abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let top = |t: &candle_core::Tensor| t.argmax(0).unwrap().to_scalar::<u32>().unwrap();
    // Measured, not bounded: tiny random weights amplify 5-bit rounding (the Q8_0 file is 2.0 off
    // on the same prompt); the 2B quality table is in docs/gguf.md.
    println!(
        "q4k_m (fallback types) on tiny-q-mlx8: last logits max|diff| {d:.3e} (max |logit| {scale:.2}), top-1 {} vs {}",
        top(&got),
        top(&want["logits.last"])
    );
    assert!(got.to_vec1::<f32>().unwrap().iter().all(|x| x.is_finite()));
}

#[test]
fn q8_0_gguf_from_llama_cpp_stays_within_its_measured_bound() {
    // llama.cpp's converter quantized the weights (its own Q8_0 code); our kernels run them.
    let text = goldens().join("gguf-q8_0/tiny-a-q8_0.gguf");
    let g = GgufModel::open(&text, Some(&goldens().join("gguf/mmproj-tiny-a-f32.gguf"))).unwrap();
    let q8 = g.text.content.tensor_infos.values().filter(|i| format!("{:?}", i.ggml_dtype) == "Q8_0").count();
    assert!(q8 >= 20, "{q8} Q8_0 tensors");
    let m = g.load_model(DType::F32, &Device::Cpu).unwrap();
    let mut worst = 0f32;
    let mut same_greedy = 0;
    for case in CASES {
        let (d, same) = against_reference(&m, "tiny-a", case);
        same_greedy += usize::from(same);
        println!("gguf q8_0 {case}: last logits max|diff| {d:.3e}, greedy ids equal: {same}");
        worst = worst.max(d);
    }
    println!("gguf q8_0: worst {worst:.3e}, {same_greedy}/{} greedy sequences identical", CASES.len());
    assert!(worst <= Q8_0_BOUND, "{worst}");
    assert!(same_greedy >= 3, "{same_greedy}");
}

/// Measured 2026-11-30 (docs/gguf.md): the worst last-position logit difference of llama.cpp's
/// Q8_0 tiny-a file against the f32 reference over the golden prompts is 1.41 (tiny random
/// weights with logits of +-20 amplify 8-bit rounding; on the 2B geometry Q8_0 moves them 0.22);
/// the bound keeps 40% headroom.
const Q8_0_BOUND: f32 = 2.0;
