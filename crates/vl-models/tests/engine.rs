//! The resident engine on the tiny golden checkpoints: the reference's greedy answers, prefix
//! reuse equal to a fresh prefill, the image cache, stop strings, cancellation.

mod common;

use common::*;
use vl_models::engine::{ChatMessage, Engine, EngineOptions, Finish, Part, Request, ToolCall};
use vl_models::qwen3_vl::GenerationOptions;

fn engine(g: &str, reuse: bool) -> Engine {
    let opts = EngineOptions {
        prefix_cache: reuse,
        image_cache_bytes: if reuse { 64 << 20 } else { 0 },
        ..Default::default()
    };
    Engine::load(&goldens().join(g).join("checkpoint"), g, opts).unwrap()
}

fn image(name: &str) -> Part {
    let path = goldens().join("images").join(name);
    Part::Image { data: std::fs::read(&path).unwrap(), name: name.into(), min_pixels: None, max_pixels: None }
}

fn one_image_request(max: usize) -> Request {
    Request {
        messages: vec![ChatMessage::new("user", vec![image("square.png"), Part::Text("Describe this image.".into())])],
        options: GenerationOptions { max_new_tokens: max, ..Default::default() },
        ..Default::default()
    }
}

fn greedy(g: &str, case: &str) -> (String, Vec<u32>, usize) {
    let meta = read_json(&goldens().join(g).join("cases").join(format!("{case}.json")));
    let ids: Vec<u32> = meta["greedy"]["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    (meta["greedy"]["text"].as_str().unwrap().to_string(), ids, meta["num_tokens"].as_u64().unwrap() as usize)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn answers_equal_the_reference_and_streamed_pieces_add_up() {
    for g in GEOMETRIES {
        let e = engine(g, true);
        let (want, ids, prompt_len) = greedy(g, "one_image");
        let mut streamed = String::new();
        let c = e
            .generate(&one_image_request(ids.len()), &mut |p| {
                streamed.push_str(p);
                true
            })
            .unwrap();
        assert_eq!(c.token_ids, ids, "{g}");
        assert_eq!(c.text, want, "{g}");
        assert_eq!(streamed, want, "{g}");
        assert_eq!(c.prompt_tokens, prompt_len);
        assert_eq!((c.finish, c.cached_tokens, c.image_cache_hits), (Finish::Length, 0, 0));
        assert!(c.image_tokens > 0);
        // The same request again: the prompt but its last position is reused, the image's
        // features come from the cache, and the answer is the same.
        let again = e.generate(&one_image_request(ids.len()), &mut |_| true).unwrap();
        assert_eq!(again.token_ids, ids, "{g} (reused)");
        assert_eq!((again.cached_tokens, again.image_cache_hits), (prompt_len - 1, 1), "{g}");
        assert!(max_diff(&again.first_logits, &c.first_logits) <= 1e-4);
    }
}

#[test]
fn a_follow_up_turn_prefills_only_its_new_tokens_and_matches_a_fresh_prefill() {
    for g in GEOMETRIES {
        let warm = engine(g, true);
        let first = warm.generate(&one_image_request(8), &mut |_| true).unwrap();
        // Turn 2 repeats turn 1 and the answer, then asks about a second image.
        let mut req = one_image_request(8);
        req.messages.push(ChatMessage::text("assistant", &first.text));
        req.messages.push(ChatMessage::new("user", vec![image("odd.png"), Part::Text("And this one?".into())]));
        let reused = warm.generate(&req, &mut |_| true).unwrap();
        let fresh = engine(g, false).generate(&req, &mut |_| true).unwrap();
        assert!(reused.cached_tokens >= first.prompt_tokens, "{g}: {} cached", reused.cached_tokens);
        assert_eq!(fresh.cached_tokens, 0);
        assert_eq!(reused.image_cache_hits, 1, "{g}: square.png again");
        let d = max_diff(&reused.first_logits, &fresh.first_logits);
        assert!(d <= 1e-4, "{g}: reused-prefix logits differ from a fresh prefill by {d}");
        assert_eq!(reused.token_ids, fresh.token_ids, "{g}");
        // A different first image: nothing of the image run may be reused.
        let mut other = req.clone();
        other.messages[0].parts[0] = image("small.png");
        let c = warm.generate(&other, &mut |_| true).unwrap();
        let f = engine(g, false).generate(&other, &mut |_| true).unwrap();
        assert!(c.cached_tokens < first.prompt_tokens, "{g}: reused across a changed image");
        assert!(max_diff(&c.first_logits, &f.first_logits) <= 1e-4);
    }
}

/// The golden case's messages (and tools) as an engine request.
fn golden_request(case: &str, max: usize) -> Request {
    let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
    let messages = meta["messages"]
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
                    _ => image(&format!("{}.png", c["image"].as_str().unwrap())),
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
        .collect();
    Request {
        messages,
        options: GenerationOptions { max_new_tokens: max, ..Default::default() },
        tools: meta["tools"].as_array().cloned().unwrap_or_default(),
        ..Default::default()
    }
}

#[test]
fn a_tool_round_matches_the_reference() {
    // tiny-b carries the official template: tool definitions, an assistant call and the tool's
    // answer render to the reference's ids, and the answer is the reference's greedy one (the
    // random weights write no call: the text passes the call hold unchanged).
    let e = engine("tiny-b", true);
    let (want_text, want_ids, prompt_len) = greedy("tiny-b", "tool_round");
    let mut streamed = String::new();
    let c = e
        .generate(&golden_request("tool_round", want_ids.len()), &mut |p| {
            streamed.push_str(p);
            true
        })
        .unwrap();
    assert_eq!(c.prompt_tokens, prompt_len);
    assert_eq!(c.token_ids, want_ids);
    assert_eq!((c.text.as_str(), streamed.as_str()), (want_text.as_str(), want_text.as_str()));
    assert!(c.tool_calls.is_empty());
    assert_eq!(c.finish, Finish::Length);
    let want = load(&goldens().join("tiny-b/cases/tool_round.safetensors"));
    let d = max_diff(&c.first_logits, &want["logits.last"].to_vec1::<f32>().unwrap());
    assert!(d <= 1e-3, "tool_round logits differ from the reference by {d}");
}

#[test]
fn a_three_turn_conversation_matches_the_reference_turn_by_turn() {
    // Turn 1 first (image 1), then the reference's three-turn prompt (turn 1, an assistant
    // answer, turn 3 with image 2): the engine reuses turn 1's prefix and image, and its answer
    // is the reference's.
    let sampled = load(&goldens().join("sampled_vocab_ids.safetensors"))["vocab_ids"].to_vec1::<i64>().unwrap();
    for g in GEOMETRIES {
        let e = engine(g, true);
        let full = golden_request("multi_turn", 1);
        let turn1 = Request { messages: full.messages[..1].to_vec(), ..full.clone() };
        let first = e.generate(&turn1, &mut |_| true).unwrap();
        let (want_text, want_ids, prompt_len) = greedy(g, "multi_turn");
        let c = e.generate(&golden_request("multi_turn", want_ids.len()), &mut |_| true).unwrap();
        assert_eq!(c.prompt_tokens, prompt_len, "{g}: input length");
        assert!(
            c.cached_tokens >= first.prompt_tokens && c.cached_tokens < prompt_len,
            "{g}: {} reused",
            c.cached_tokens
        );
        assert_eq!(c.image_cache_hits, 1, "{g}: the turn-1 image again");
        assert_eq!(c.token_ids, want_ids, "{g}: greedy ids");
        assert_eq!(c.text, want_text);
        let want = load(&goldens().join(g).join("cases/multi_turn.safetensors"));
        let want_last = want["logits.last"].to_vec1::<f32>().unwrap();
        // End to end the engine sees our resized pixels, which differ from the reference's by
        // up to one level (7.8e-3; the processor tolerance is 0.02) for the resized second image;
        // measured: tiny-a 8.3e-3, tiny-b 1.3e-2 (the same images through a fresh engine give the
        // same figures). With the reference's own pixels the model matches within 1e-3 on this
        // prompt (text_parity's multi_turn case), and reuse equals a fresh prefill within 1e-4.
        let d = max_diff(&c.first_logits, &want_last);
        assert!(d <= 3e-2, "{g}: last-position logits differ from the reference by {d}");
        let fresh = engine(g, false).generate(&golden_request("multi_turn", 1), &mut |_| true).unwrap();
        let reuse = max_diff(&c.first_logits, &fresh.first_logits);
        assert!(reuse <= 1e-4, "{g}: reused-prefix logits differ from a fresh prefill by {reuse}");
        assert!(sampled.len() > 100);
        println!(
            "{g}: multi_turn {prompt_len} tokens, {} reused, logits vs reference {d:.2e}, vs fresh prefill {reuse:.2e}",
            c.cached_tokens
        );
    }
}

#[test]
fn stop_strings_cut_the_answer_and_cancelling_leaves_the_engine_usable() {
    let g = "tiny-b";
    let e = engine(g, true);
    let (want, ids, _) = greedy(g, "one_image");
    // Stop at the first character that is not at the start of the answer.
    let cut = want.char_indices().nth(3).map(|(i, _)| i).unwrap();
    let stop: String = want[cut..].chars().take(2).collect();
    let at = want.find(&stop).unwrap();
    let mut req = one_image_request(ids.len());
    req.stop = vec![stop.clone()];
    let mut streamed = String::new();
    let c = e
        .generate(&req, &mut |p| {
            streamed.push_str(p);
            true
        })
        .unwrap();
    assert_eq!(c.finish, Finish::Stop);
    assert_eq!(c.text, want[..at], "stop {stop:?}");
    assert_eq!(streamed, c.text);

    let mut n = 0;
    let c = e
        .generate(&one_image_request(ids.len()), &mut |_| {
            n += 1;
            n < 3
        })
        .unwrap();
    assert_eq!(c.finish, Finish::Cancelled);
    assert!(c.token_ids.len() < ids.len());
    let c = e.generate(&one_image_request(ids.len()), &mut |_| true).unwrap();
    assert_eq!(c.text, want);
}

#[test]
fn bad_requests_are_errors_naming_the_problem() {
    let e = engine("tiny-a", true);
    let mut r = one_image_request(4);
    r.messages[0].parts[0] =
        Part::Image { data: b"not an image".to_vec(), name: "x.png".into(), min_pixels: None, max_pixels: None };
    let err = e.generate(&r, &mut |_| true).unwrap_err().to_string();
    assert!(err.contains("x.png"), "{err}");
    let mut r = one_image_request(4);
    r.messages[0].parts.push(Part::Text("word ".repeat(3000)));
    let err = e.generate(&r, &mut |_| true).unwrap_err().to_string();
    assert!(err.contains("context of 2048"), "{err}");
    let mut r = one_image_request(4);
    r.options.temperature = -1.0;
    assert!(e.generate(&r, &mut |_| true).unwrap_err().to_string().contains("temperature"));
    let mut r = one_image_request(4);
    if let Part::Image { max_pixels, .. } = &mut r.messages[0].parts[0] {
        *max_pixels = Some(1 << 40);
    }
    assert!(e.generate(&r, &mut |_| true).unwrap_err().to_string().contains("max_pixels"));
    // Still answers.
    let (want, ids, _) = greedy("tiny-a", "one_image");
    assert_eq!(e.generate(&one_image_request(ids.len()), &mut |_| true).unwrap().text, want);
}
