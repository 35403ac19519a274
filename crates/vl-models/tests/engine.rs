//! The resident engine on the tiny golden checkpoints: the reference's greedy answers, prefix
//! reuse equal to a fresh prefill, the image cache, stop strings, cancellation.

mod common;

use common::*;
use vl_models::engine::{ChatMessage, Engine, EngineOptions, Finish, ModelOptions, Part, Request};
use vl_models::GenerationOptions;

fn engine(g: &str, reuse: bool) -> Engine {
    let opts = EngineOptions {
        model: ModelOptions { device: device(), ..Default::default() },
        prefix_cache: reuse,
        image_cache_bytes: if reuse { 64 << 20 } else { 0 },
        ..Default::default()
    };
    Engine::load(&goldens().join(g).join("checkpoint"), opts).unwrap()
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

fn engine_with(g: &str, opts: EngineOptions) -> Engine {
    Engine::load(&goldens().join(g).join("checkpoint"), opts).unwrap()
}

/// Fresh prefills only: no kept prefixes, no feature cache.
fn cold(parallel: usize) -> EngineOptions {
    EngineOptions {
        model: ModelOptions { device: device(), ..Default::default() },
        parallel,
        prefix_cache: false,
        image_cache_bytes: 0,
        ..Default::default()
    }
}

#[test]
fn requests_decoded_together_answer_as_each_would_alone() {
    // Different prompt lengths, images in some and not others, one stopping early (5 tokens),
    // and a sixth request cancelled after its second piece while the others decode.
    let cases = [("text_only", 24), ("one_image", 5), ("two_images", 20), ("image_mid", 28), ("multi_turn", 16)];
    for g in GEOMETRIES {
        let reqs: Vec<Request> = cases.iter().map(|&(c, n)| golden_request(c, n)).collect();
        let solo_engine = engine_with(g, cold(1));
        let solo: Vec<_> = reqs.iter().map(|r| solo_engine.generate(r, &mut |_| true).unwrap()).collect();
        let batched = engine_with(g, cold(4));
        let (together, cancelled) = std::thread::scope(|s| {
            let handles: Vec<_> = reqs
                .iter()
                .map(|r| {
                    let e = &batched;
                    s.spawn(move || answer_streamed(e, r))
                })
                .collect();
            let e = &batched;
            let cancel = s.spawn(move || {
                let mut n = 0;
                e.generate(&golden_request("image_mid", 40), &mut |_| {
                    n += 1;
                    n < 2
                })
                .unwrap()
            });
            let together: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            (together, cancel.join().unwrap())
        });
        for (((case, _), alone), (c, streamed)) in cases.iter().zip(&solo).zip(&together) {
            assert_eq!(c.token_ids, alone.token_ids, "{g} {case}: greedy ids batched vs alone");
            assert_eq!((&c.text, c.finish), (&alone.text, alone.finish), "{g} {case}");
            assert_eq!(streamed, &c.text, "{g} {case}: streamed pieces");
            let d = max_diff(&c.first_logits, &alone.first_logits);
            assert!(d <= 1e-4, "{g} {case}: prefill logits differ from alone by {d}");
        }
        assert_eq!(together[1].0.token_ids.len(), 5, "{g}: the early stop");
        assert_eq!(cancelled.finish, Finish::Cancelled, "{g}");
        assert!(cancelled.token_ids.len() < 40, "{g}");
        let st = batched.stats();
        assert_eq!((st.running, st.waiting), (0, 0), "{g}: nothing left behind");
        println!(
            "{g}: {} decode steps for {} rows (mean batch {:.2})",
            st.decode_steps,
            st.decode_rows,
            st.decode_rows as f64 / st.decode_steps.max(1) as f64
        );
    }
}

#[test]
fn the_kv_budget_refuses_what_cannot_fit_and_queues_what_cannot_fit_yet() {
    let g = "tiny-a";
    let probe = engine_with(g, cold(1));
    let per_position = probe.generator().unwrap().kv_bytes_per_position();
    let block = vl_nn::kv_cache::BLOCK;
    let req = golden_request("one_image", 40);
    let alone = probe.generate(&req, &mut |_| true).unwrap();
    let n = alone.prompt_tokens;
    assert_eq!(alone.token_ids.len(), 40);

    // A budget below the prompt's own cache: refused with the budget named, nothing run.
    let small = engine_with(g, EngineOptions { kv_cache_bytes: per_position * block - 1, ..cold(4) });
    let Err(err) = small.generate(&req, &mut |_| true) else { panic!("a prompt over the KV budget was answered") };
    assert!(matches!(&err, vl_models::Error::Limit { kind: vl_models::limits::LimitKind::KvCache, .. }), "{err}");
    assert!(err.to_string().contains("KV cache") && err.to_string().contains("budget"), "{err}");

    // Room for one whole answer, not two: three requests sent together wait their turn (or are
    // preempted and prefilled again) and each answer is the one it gets alone.
    let one = vl_nn::kv_cache::blocks_for(n + 41) * per_position;
    let tight = engine_with(g, EngineOptions { kv_cache_bytes: one + per_position * block / 2, ..cold(4) });
    let answers: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3).map(|_| s.spawn(|| tight.generate(&req, &mut |_| true).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for c in &answers {
        assert_eq!(c.token_ids, alone.token_ids);
        assert_eq!(c.finish, Finish::Length);
    }
    let st = tight.stats();
    assert!(st.kv_cache_bytes <= st.kv_budget_bytes, "{st:?}");
    assert_eq!((st.running, st.waiting), (0, 0));

    // Room for the prompt and one block more, alone: the answer ends where the budget does.
    let prompt_only = vl_nn::kv_cache::blocks_for(n + 1) * per_position;
    let cut = engine_with(g, EngineOptions { kv_cache_bytes: prompt_only, ..cold(1) });
    let c = cut.generate(&golden_request("one_image", 400), &mut |_| true).unwrap();
    assert_eq!(c.finish, Finish::ContextFull);
    let room = vl_nn::kv_cache::blocks_for(n + 1) - n;
    assert_eq!(c.token_ids.len(), room + 1, "fills the allocated blocks, then one last token");
    let full = probe.generate(&golden_request("one_image", room + 1), &mut |_| true).unwrap();
    assert_eq!(c.token_ids, full.token_ids);
}

#[test]
fn interleaved_conversations_each_keep_their_prefix() {
    // Three conversations, turns interleaved A1 B1 C1 A2 B2 C2 A3: every later turn prefills only
    // what its earlier turn did not hold, and answers as a fresh engine does.
    let g = "tiny-b";
    let e = engine(g, true);
    let fresh = engine_with(g, cold(1));
    let firsts = [
        vec![image("square.png"), Part::Text("Describe this image.".into())],
        vec![Part::Text("Write a haiku about the sea.".into())],
        vec![image("odd.png"), Part::Text("What is in the corner?".into())],
    ];
    let mut convs: Vec<Vec<ChatMessage>> = firsts.iter().map(|p| vec![ChatMessage::new("user", p.clone())]).collect();
    let ask = |msgs: &[ChatMessage]| Request {
        messages: msgs.to_vec(),
        options: GenerationOptions { max_new_tokens: 6, ..Default::default() },
        ..Default::default()
    };
    let mut last_prompt = [0usize; 3];
    for (turn, who) in [0, 1, 2, 0, 1, 2, 0].into_iter().enumerate() {
        let req = ask(&convs[who]);
        let c = e.generate(&req, &mut |_| true).unwrap();
        let f = fresh.generate(&req, &mut |_| true).unwrap();
        assert_eq!(c.token_ids, f.token_ids, "turn {turn}");
        assert!(max_diff(&c.first_logits, &f.first_logits) <= 1e-4, "turn {turn}");
        if turn >= 3 {
            assert!(
                c.cached_tokens >= last_prompt[who],
                "turn {turn} (conversation {who}): {} of {} reused, its last prompt was {}",
                c.cached_tokens,
                c.prompt_tokens,
                last_prompt[who]
            );
        }
        last_prompt[who] = c.prompt_tokens;
        convs[who].push(ChatMessage::text("assistant", &c.text));
        convs[who].push(ChatMessage::text("user", &format!("And then? ({turn})")));
    }
    let st = e.stats();
    assert!(st.cached_prefixes >= 3, "{st:?}");
}

#[test]
fn logit_bias_bans_tokens_and_a_constraint_holds_in_a_batch() {
    let g = "tiny-a";
    let e = engine_with(g, cold(4));
    let (_, ids, _) = greedy(g, "one_image");
    // Every token of the reference's greedy answer banned: none of them comes out.
    let mut req = one_image_request(ids.len());
    let mut banned: Vec<u32> = ids.clone();
    banned.sort_unstable();
    banned.dedup();
    req.options.logit_bias = banned.iter().map(|&t| (t, -100.0)).collect();
    let c = e.generate(&req, &mut |_| true).unwrap();
    assert_eq!(c.token_ids.len(), ids.len());
    assert!(c.token_ids.iter().all(|t| !banned.contains(t)), "{:?} vs banned {banned:?}", c.token_ids);
    // A bias of +100 on one token makes it the answer.
    let mut req = one_image_request(4);
    req.options.logit_bias = vec![(ids[0] + 7, 100.0)];
    let c = e.generate(&req, &mut |_| true).unwrap();
    assert_eq!(c.token_ids, vec![ids[0] + 7; 4]);

    // A constrained request decoding beside unconstrained ones: it validates, and theirs equal
    // the reference.
    let schema = serde_json::json!({"type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"], "additionalProperties": false});
    let (want, ids, _) = greedy(g, "one_image");
    std::thread::scope(|s| {
        let plain: Vec<_> =
            (0..2).map(|_| s.spawn(|| e.generate(&one_image_request(ids.len()), &mut |_| true).unwrap())).collect();
        let mut req = one_image_request(200);
        req.options.temperature = 1.0;
        req.options.seed = 11;
        req.constraint = Some(vl_models::engine::Constraint::JsonSchema(schema.clone()));
        let c = e.generate(&req, &mut |_| true).unwrap();
        assert_eq!(c.finish, Finish::Stop, "{:?}", c.text);
        let v: serde_json::Value = serde_json::from_str(&c.text).unwrap();
        let n = v["n"].as_u64().unwrap();
        assert!(n <= 99 && v["ok"].is_boolean() && v.as_object().unwrap().len() == 2, "{v}");
        for h in plain {
            let p = h.join().unwrap();
            assert_eq!((p.text.as_str(), &p.token_ids), (want.as_str(), &ids));
        }
    });
}

#[test]
fn n_choices_fork_one_prefill_or_wait_for_a_slot() {
    let g = "tiny-a";
    let mut req = one_image_request(6);
    req.options.temperature = 1.0;
    req.options.seed = 9;
    let wide = engine_with(g, cold(4));
    let all = wide.generate_n(&req, 3, &mut |_, _, _| true).unwrap();
    assert_eq!(all.len(), 3);
    // Only the first choice prefilled; the others started from a copy of its cache.
    assert!(all[0].prefill_time > std::time::Duration::ZERO);
    assert!(all[1..].iter().all(|c| c.prefill_time == std::time::Duration::ZERO));
    // Choice i samples with seed + i: the same as that seed alone.
    for (i, c) in all.iter().enumerate() {
        let mut alone = req.clone();
        alone.options.seed = 9 + i as u64;
        assert_eq!(wide.generate(&alone, &mut |_| true).unwrap().token_ids, c.token_ids, "choice {i}");
    }
    // One slot: the other choices wait and prefill themselves, with the same answers.
    let narrow = engine_with(g, cold(1));
    let one_slot = narrow.generate_n(&req, 3, &mut |_, _, _| true).unwrap();
    let ids = |v: &[vl_models::engine::Completion]| v.iter().map(|c| c.token_ids.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&one_slot), ids(&all));
    assert!(narrow.generate_n(&req, 9, &mut |_, _, _| true).is_err());
}

/// The resident engine (what `vl serve --vision-precision bf16` loads): the tower converted to
/// bf16 products at load answers the golden image prompt with the reference's greedy ids (as
/// `vl run` does, crates/vl-cli/tests/run.rs); without AMX-BF16 it is refused before loading.
#[test]
fn a_resident_bf16_vision_tower_answers_or_is_refused() {
    let opts = EngineOptions {
        model: ModelOptions { vision_bf16: true, device: device(), ..Default::default() },
        prefix_cache: false,
        image_cache_bytes: 0,
        ..Default::default()
    };
    let e = Engine::load(&goldens().join("tiny-b").join("checkpoint"), opts);
    if !vl_nn::bf16::available() {
        let err = e.err().expect("refused without AMX or AVX512-BF16").to_string();
        assert!(err.contains("AMX-BF16"), "{err}");
        return;
    }
    let e = e.unwrap();
    let (want, ids, _) = greedy("tiny-b", "one_image");
    let c = e.generate(&one_image_request(ids.len()), &mut |_| true).unwrap();
    assert_eq!(c.token_ids, ids);
    assert_eq!(c.text, want);
}

#[test]
fn a_preempted_answer_of_media_placeholder_ids_is_recomputed_as_text() {
    // Answers made of `<|image_pad|>` / `<|video_pad|>` ids (a logit_bias of +100 on one of them,
    // or on both at once, image and text prompts) under a KV budget that forces preemptions: the
    // recompute reads the generated ids as text, never as media placeholders, and each answer is
    // the one it gets alone.
    let g = "tiny-a";
    let probe = engine_with(g, cold(1));
    let tok = probe.family().tokenizer();
    let pad = |t: &str| tok.token_to_id(t).unwrap_or_else(|| panic!("{t} is not in the vocabulary"));
    let (image_pad, video_pad) = (pad("<|image_pad|>"), pad("<|video_pad|>"));
    let per_position = probe.generator().unwrap().kv_bytes_per_position();
    let block = vl_nn::kv_cache::BLOCK;
    let max = 40;
    let cases: Vec<(Request, Vec<(u32, f32)>)> = [
        ("one_image", vec![(image_pad, 100.0)]),
        ("text_only", vec![(video_pad, 100.0)]),
        ("one_image", vec![(image_pad, 30.0), (video_pad, 30.0)]),
        ("text_only", vec![(image_pad, 100.0)]),
    ]
    .into_iter()
    .map(|(case, bias)| {
        let mut r = golden_request(case, max);
        r.options.logit_bias = bias.clone();
        (r, bias)
    })
    .collect();
    let alone: Vec<_> = cases.iter().map(|(r, _)| probe.generate(r, &mut |_| true).unwrap()).collect();
    for (c, (_, bias)) in alone.iter().zip(&cases) {
        assert_eq!(c.token_ids.len(), max);
        let pads = c.token_ids.iter().filter(|t| bias.iter().any(|b| b.0 == **t)).count();
        assert!(pads >= max / 2, "{pads} placeholder ids of {max}: {:?}", c.token_ids);
    }
    let longest = alone.iter().map(|c| c.prompt_tokens).max().unwrap();
    let one = vl_nn::kv_cache::blocks_for(longest + max + 1) * per_position;
    let tight = engine_with(g, EngineOptions { kv_cache_bytes: one + per_position * block / 2, ..cold(4) });
    let together: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = cases.iter().map(|(r, _)| s.spawn(|| tight.generate(r, &mut |_| true))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (c, a)) in together.iter().zip(&alone).enumerate() {
        let c = c.as_ref().unwrap_or_else(|e| panic!("case {i} lost under load: {e}"));
        assert_eq!((&c.token_ids, c.finish), (&a.token_ids, a.finish), "case {i}");
    }
    let st = tight.stats();
    assert!(st.preemptions > 0, "the budget forced no preemption: {st:?}");
    assert_eq!((st.running, st.waiting), (0, 0));
}

/// Grammars that fail or cost too much are refused when the request is admitted, naming the field
/// and the failing part, and never hold up another client's stream: patterns of growing cost
/// with several choices, self-referencing schemas, and a tool whose parameters are such a schema.
#[test]
fn costly_or_empty_grammars_are_refused_at_admission_and_stall_no_other_stream() {
    use serde_json::json;
    use std::time::{Duration, Instant};
    use vl_models::engine::Constraint;
    let g = "tiny-a";
    let e = engine_with(g, cold(4));
    let string_with =
        |p: &str| json!({"type": "object", "properties": {"s": {"type": "string", "pattern": p}}, "required": ["s"]});
    // (constraint, n, what the message names)
    let bad: Vec<(Constraint, usize, &str)> = vec![
        (Constraint::JsonSchema(string_with("^(a{1000}){1000}$")), 7, "/properties/s/pattern"),
        (Constraint::JsonSchema(string_with("^(a{300}){300}$")), 6, "/properties/s/pattern"),
        (Constraint::JsonSchema(json!({"type": "string", "pattern": "^(b{500}){800}$"})), 3, "#/pattern"),
        (Constraint::JsonSchema(json!({"$ref": "#"})), 2, "no finite instance"),
        (
            Constraint::JsonSchema(
                json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
            ),
            2,
            "no finite instance",
        ),
    ];
    // Another client streams a plain answer the whole time; its pieces' largest gap is measured.
    let stop = std::sync::atomic::AtomicBool::new(false);
    struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = Stop(&stop);
        let other = s.spawn(|| {
            let mut gaps = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut last = Instant::now();
                let mut largest = Duration::ZERO;
                e.generate(&golden_request("text_only", 60), &mut |_| {
                    largest = largest.max(last.elapsed());
                    last = Instant::now();
                    true
                })
                .unwrap();
                gaps.push(largest);
            }
            gaps
        });
        std::thread::sleep(Duration::from_millis(300));
        for (i, (c, n, names)) in bad.iter().enumerate() {
            let mut req = golden_request("text_only", 20);
            req.constraint = Some(c.clone());
            let t = Instant::now();
            let r = e.generate_n(&req, *n, &mut |_, _, _| true);
            let took = t.elapsed();
            let Err(err) = r else { panic!("case {i}: a grammar that cannot be matched was answered") };
            let msg = err.to_string();
            println!("case {i}: refused in {took:.2?}: {msg}");
            assert!(
                matches!(&err, vl_models::Error::Input { what, .. } if what == "response_format"),
                "case {i}: {err:?}"
            );
            assert!(msg.contains(names), "case {i}: {msg:?} does not name {names:?}");
            assert!(took < Duration::from_secs(4), "case {i}: refused after {took:?}");
        }
        // Patterns just under the bound, several choices: answered (each valid) or refused naming
        // the field; either way the other stream goes on.
        for p in ["^(a{99}){100}$", "^([a-c]{50}x){150}$", "^(a|b){9000}$"] {
            let mut req = golden_request("text_only", 24);
            req.constraint = Some(Constraint::JsonSchema(string_with(p)));
            let t = Instant::now();
            match e.generate_n(&req, 4, &mut |_, _, _| true) {
                Ok(all) => println!("{p}: answered in {:.2?}: {:?}", t.elapsed(), all[0].text),
                Err(err) => {
                    println!("{p}: refused in {:.2?}: {err}", t.elapsed());
                    assert!(
                        matches!(&err, vl_models::Error::Input { what, .. } if what == "response_format"),
                        "{err:?}"
                    );
                }
            }
        }
        // A tool whose parameters are a reference cycle: refused naming tool_choice.
        let mut req = golden_request("text_only", 20);
        let params = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"});
        req.constraint = Some(Constraint::ToolCalls { functions: vec![("f".into(), params)], one: true });
        let err = e.generate(&req, &mut |_| true).unwrap_err();
        assert!(matches!(&err, vl_models::Error::Input { what, .. } if what == "tool_choice"), "{err:?}");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let gaps = other.join().unwrap();
        let largest = gaps.iter().max().copied().unwrap_or_default();
        println!("the other stream: {} answers, largest gap between pieces {largest:.2?}", gaps.len());
        assert!(!gaps.is_empty());
        assert!(largest < Duration::from_millis(1500), "another client's stream stalled for {largest:?}");
    });
}

/// A caller that stops taking its pieces pauses its own sequence (a bounded number of pieces
/// wait for it, never its whole answer), while another caller's stream goes on.
#[test]
fn a_caller_that_stops_reading_pauses_its_sequence_and_no_other() {
    use std::time::{Duration, Instant};
    let g = "tiny-a";
    let e = engine_with(g, cold(4));
    // How far a caller that reads runs in the time the stalled one waits.
    let t = Instant::now();
    let free = e.generate(&golden_request("text_only", 300), &mut |_| true).unwrap();
    let free_time = t.elapsed();
    assert_eq!(free.token_ids.len(), 300);
    for stall in [free_time * 2, free_time * 4] {
        let (stalled, gaps) = std::thread::scope(|s| {
            let stalled = s.spawn(|| {
                let mut first = true;
                e.generate(&golden_request("text_only", 300), &mut |_| {
                    if first {
                        first = false;
                        // Stops reading, then gives up.
                        std::thread::sleep(stall);
                        return false;
                    }
                    true
                })
                .unwrap()
            });
            std::thread::sleep(Duration::from_millis(20));
            let mut last = Instant::now();
            let mut largest = Duration::ZERO;
            let other = e
                .generate(&golden_request("text_only", 200), &mut |_| {
                    largest = largest.max(last.elapsed());
                    last = Instant::now();
                    true
                })
                .unwrap();
            assert_eq!(other.token_ids.len(), 200);
            (stalled.join().unwrap(), largest)
        });
        println!(
            "stalled {stall:.2?}: {} tokens generated for it (300 free in {free_time:.2?}); the other's largest gap {gaps:.2?}",
            stalled.token_ids.len()
        );
        assert_eq!(stalled.finish, Finish::Cancelled);
        // 16 pieces may wait unread (a piece is one token or a few for a split character).
        assert!(
            stalled.token_ids.len() <= 40,
            "{} tokens decoded for a caller that read none",
            stalled.token_ids.len()
        );
        assert!(gaps < Duration::from_millis(500), "the other stream stalled for {gaps:?}");
    }
}

/// Under a KV budget that ends every answer at the same position, a constrained answer (whose
/// next mask may or may not be ready when its logits are) always has the same tokens; and a
/// caller that panics in its callback frees its slot.
#[test]
fn mask_timing_changes_no_answer_and_a_panicking_caller_frees_its_slot() {
    use vl_models::engine::Constraint;
    let g = "tiny-a";
    let probe = engine_with(g, cold(1));
    let req = {
        let mut r = golden_request("text_only", 400);
        r.constraint = Some(Constraint::JsonSchema(serde_json::json!({"type": "string"})));
        r
    };
    let alone = probe.generate(&golden_request("text_only", 1), &mut |_| true).unwrap();
    let per_position = probe.generator().unwrap().kv_bytes_per_position();
    let budget = vl_nn::kv_cache::blocks_for(alone.prompt_tokens + 1) * per_position;
    let e = engine_with(g, EngineOptions { kv_cache_bytes: budget, ..cold(1) });
    let answers: Vec<_> = (0..6).map(|_| e.generate(&req, &mut |_| true).unwrap()).collect();
    for (i, c) in answers.iter().enumerate() {
        assert_eq!(c.finish, Finish::ContextFull, "{i}");
        assert_eq!(c.token_ids, answers[0].token_ids, "run {i} differs from run 0");
    }
    // A callback that panics on its third piece: the engine answers the next request.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut n = 0;
        let _ = e.generate(&golden_request("text_only", 300), &mut |_| {
            n += 1;
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(n < 3, "the caller fails");
            true
        });
    }));
    assert!(r.is_err());
    let t = std::time::Instant::now();
    let next = e.generate(&golden_request("text_only", 4), &mut |_| true).unwrap();
    assert_eq!(next.token_ids.len(), 4);
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "the next request waited {:?}", t.elapsed());
}

/// A request renders its chat template once: the prompt's length is checked against the context
/// and its ids made from the same rendered text.
#[test]
fn a_request_renders_its_template_once() {
    let e = engine("tiny-a", false);
    let before = vl_models::template::renders_in_this_thread();
    let c = e.generate(&one_image_request(2), &mut |_| true).unwrap();
    assert_eq!(c.token_ids.len(), 2);
    assert_eq!(vl_models::template::renders_in_this_thread() - before, 1);
}
