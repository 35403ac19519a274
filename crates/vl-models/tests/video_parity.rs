//! Video parity with transformers' `Qwen3VLVideoProcessor` / `Qwen3VLProcessor` and the model:
//! for every golden clip case (goldens/processor/video-*.json), the clip file decoded here
//! (lossless FFV1 through ffmpeg, or an APNG in-process), sampled, resized and patchified:
//! frame indices, grid and prompt ids identical, pixels within `PIXEL_TOL`; the tiny-a video
//! prompts' logits within 1e-3 and greedy ids identical; the video's vision features within 1e-4.
//! Needs `ffmpeg` on PATH (.ci/run installs it).

mod common;

use candle_core::{DType, Tensor};
use common::*;
use vl_models::qwen3_vl::{
    Content, Message, Processor, Prompt, Qwen3VlModel, VideoOptions, VideoProcessor, VisionInput,
};
use vl_models::video::{VideoLimits, VideoSource};
use vl_models::GenerationOptions;

/// Pixels: torchvision's uint8 antialiased bicubic against our Pillow-order resizer (the image
/// processor's bound; the largest difference seen is printed).
const PIXEL_TOL: f32 = 0.02;
const LOGIT_TOL: f32 = 1e-3;
const FEATURE_TOL: f32 = 1e-4;

fn tiny_a() -> std::path::PathBuf {
    goldens().join("tiny-a/checkpoint")
}

fn video_cases() -> Vec<(String, serde_json::Value)> {
    let mut out: Vec<(String, serde_json::Value)> = std::fs::read_dir(goldens().join("processor"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            let case = name.strip_prefix("video-")?.strip_suffix(".json")?.to_string();
            Some((case, read_json(&goldens().join("processor").join(&name))))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 4, "video processor goldens missing");
    out
}

/// tiny-a's video processor with a case's call kwargs and processor attributes applied.
fn processor_for(meta: &serde_json::Value) -> VideoProcessor {
    let call = &meta["call_kwargs"];
    let over = &meta["processor_overrides"];
    let opts = VideoOptions {
        fps: call["fps"].as_f64(),
        max_frames: over["max_frames"].as_u64().map(|n| n as usize),
        min_pixels: call["size"]["shortest_edge"].as_u64().map(|n| n as usize),
        max_pixels: call["size"]["longest_edge"].as_u64().map(|n| n as usize),
        cap_pixels_per_frame: call["cap_pixels_per_frame"].as_bool(),
    };
    let mut p = VideoProcessor::from_dir(&tiny_a()).unwrap().with_options(&opts).unwrap();
    if let Some(n) = over["max_video_tokens"].as_u64() {
        p.config.max_video_tokens = n as usize;
    }
    p
}

fn open_clip(meta: &serde_json::Value) -> VideoSource {
    let path = goldens().join(meta["file"].as_str().unwrap());
    VideoSource::open(&path, 2.0, &VideoLimits::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids_of(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect()
}

#[test]
fn video_processing_matches_the_reference() {
    let mut worst = 0f32;
    for (case, meta) in video_cases() {
        let want = load(&goldens().join("processor").join(format!("video-{case}.safetensors")));
        let src = open_clip(&meta);
        let info = src.info();
        assert_eq!(info.frames as u64, meta["total_frames"].as_u64().unwrap(), "{case}: frame count");
        assert_eq!(info.fps, meta["fps"].as_f64().unwrap(), "{case}: frame rate");
        assert_eq!(
            (info.width as u64, info.height as u64),
            (meta["width"].as_u64().unwrap(), meta["height"].as_u64().unwrap())
        );
        let vp = processor_for(&meta);
        let got = vp.process_source(&src).unwrap();
        let want_idx: Vec<usize> =
            want["frames_indices"].to_vec1::<i64>().unwrap().iter().map(|&i| i as usize).collect();
        assert_eq!(got.plan.indices, want_idx, "{case}: sampled frames");
        assert_eq!(vec![got.plan.grid], grids(&want["video_grid_thw"]), "{case}: grid");
        let px = Tensor::from_vec(got.pixels.clone(), want["pixel_values_videos"].dims(), &device()).unwrap();
        let d = max_abs_diff(&px, &want["pixel_values_videos"]);
        worst = worst.max(d);
        // The prompt: the template's video placeholder expanded to the timestamped frame pairs.
        let placeholder = got.plan.placeholder(1);
        for stamp in meta["timestamps"].as_array().unwrap() {
            assert!(placeholder.contains(stamp.as_str().unwrap()), "{case}: {stamp} not in {placeholder}");
        }
        let proc = Processor { videos: vp.clone(), ..Processor::from_dir(&tiny_a()).unwrap() };
        let messages = vec![Message::new(
            "user",
            vec![
                Content::Video { video: meta["clip"].as_str().unwrap().into() },
                Content::Text { text: "Describe this video.".into() },
            ],
        )];
        let prompt = proc.prepare_media(&messages, None, &[], std::slice::from_ref(&got), &device()).unwrap();
        assert_eq!(prompt.input_ids, ids_of(&want["input_ids"]), "{case}: prompt ids");
        let n = proc.prompt_len_media(&messages, None, &Default::default(), &[], &[&got.plan]).unwrap();
        assert_eq!(n, prompt.input_ids.len(), "{case}: counted prompt length");
        println!(
            "{case}: {} of {} frames {:?}, grid {:?}, {} tokens, pixels max|diff| {d:.2e}",
            got.plan.indices.len(),
            info.frames,
            got.plan.indices,
            got.plan.grid,
            prompt.input_ids.len()
        );
        assert!(d <= PIXEL_TOL, "{case}: pixels differ by {d}");
    }
    println!("video pixels: worst max|diff| {worst:.2e} (tolerance {PIXEL_TOL})");
}

/// A golden video case's prompt: ids from prompts/, pixels from the processor goldens of its
/// clips (the reference's own inputs, so the model is compared alone).
fn video_prompt(case: &str) -> Prompt {
    let mut p = prompt(case);
    let t = load(&goldens().join("prompts").join(format!("{case}.safetensors")));
    let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
    let names: Vec<String> =
        meta["videos"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    let px: Vec<Tensor> = names
        .iter()
        .map(|n| {
            load(&goldens().join("processor").join(format!("video-{n}.safetensors")))["pixel_values_videos"].clone()
        })
        .collect();
    p.videos = Some(VisionInput { pixels: Tensor::cat(&px, 0).unwrap(), grids: grids(&t["video_grid_thw"]) });
    p
}

#[test]
fn video_prompts_match_the_reference_logits_and_greedy_ids() {
    let m = Qwen3VlModel::load(&tiny_a(), DType::F32, &device()).unwrap();
    let sampled = load(&goldens().join("sampled_vocab_ids.safetensors"))["vocab_ids"].to_dtype(DType::U32).unwrap();
    for case in ["video", "video_image"] {
        let want = load(&goldens().join("tiny-a/cases").join(format!("{case}.safetensors")));
        let p = video_prompt(case);
        // The video's vision features.
        let out = m.encode_vision(p.videos.as_ref().unwrap()).unwrap();
        let merged = Tensor::cat(&out.merged, 0).unwrap();
        let d_vis = max_abs_diff(&merged, &want["video.merged"]);
        let mut d_ds = 0f32;
        for (i, level) in out.levels.iter().enumerate() {
            d_ds = d_ds.max(max_abs_diff(&Tensor::cat(level, 0).unwrap(), &want[&format!("video.deepstack.{i}")]));
        }
        let mut cache = m.new_cache();
        let state = m.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
        let d_last = max_abs_diff(&m.last_logits(&state).unwrap(), &want["logits.last"]);
        let all = m.text().logits(&state.hidden).unwrap().index_select(&sampled, 1).unwrap();
        let d_all = max_abs_diff(&all, &want["logits.sampled"]);
        let want_ids = ids_of(&want["greedy.ids"]);
        let (gen, _) = greedy(&m, &p, want_ids.len(), &[]).unwrap();
        println!(
            "tiny-a/{case} ({} tokens): video features {d_vis:.2e} (deepstack {d_ds:.2e}), last logits {d_last:.2e}, all positions {d_all:.2e}",
            p.input_ids.len()
        );
        assert!(d_vis <= tol(FEATURE_TOL) && d_ds <= tol(FEATURE_TOL), "{case}: features {d_vis:e} {d_ds:e}");
        assert!(d_last <= tol(LOGIT_TOL) && d_all <= tol(LOGIT_TOL), "{case}: logits {d_last:e} {d_all:e}");
        assert_eq!(gen, want_ids, "{case}: greedy ids");
    }
}

#[test]
fn the_engine_answers_a_video_prompt_with_the_reference_ids() {
    use vl_models::engine::{ChatMessage, Engine, EngineOptions, ModelOptions, Part, Request, VideoData};
    // Our whole path: the clip file decoded, processed, prompt built by the engine.
    let engine = Engine::load(
        &tiny_a(),
        EngineOptions { model: ModelOptions { video_pixel_cap: None, ..Default::default() }, ..Default::default() },
    )
    .unwrap();
    for case in ["video", "video_image"] {
        let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
        let want = load(&goldens().join("tiny-a/cases").join(format!("{case}.safetensors")));
        let mut parts = Vec::new();
        for c in meta["messages"][0]["content"].as_array().unwrap() {
            parts.push(match c["type"].as_str().unwrap() {
                "image" => {
                    let path = goldens().join("images").join(format!("{}.png", c["image"].as_str().unwrap()));
                    Part::Image {
                        data: std::fs::read(&path).unwrap(),
                        name: path.display().to_string(),
                        min_pixels: None,
                        max_pixels: None,
                    }
                }
                "video" => {
                    let v = read_json(
                        &goldens().join("processor").join(format!("video-{}.json", c["video"].as_str().unwrap())),
                    );
                    let path = goldens().join(v["file"].as_str().unwrap());
                    Part::Video {
                        source: VideoData::Path(path.clone()),
                        name: path.display().to_string(),
                        options: Default::default(),
                    }
                }
                _ => Part::Text(c["text"].as_str().unwrap().into()),
            });
        }
        let want_ids = ids_of(&want["greedy.ids"]);
        let req = Request {
            messages: vec![ChatMessage::new("user", parts)],
            options: GenerationOptions { max_new_tokens: want_ids.len(), ..Default::default() },
            ..Default::default()
        };
        let c = engine.generate(&req, &mut |_| true).unwrap();
        let prompt_ids = ids_of(&load(&goldens().join("prompts").join(format!("{case}.safetensors")))["input_ids"]);
        assert_eq!(c.prompt_tokens, prompt_ids.len(), "{case}");
        let d = Tensor::new(c.first_logits.as_slice(), &device()).unwrap();
        let d_last = max_abs_diff(&d, &want["logits.last"]);
        println!("engine tiny-a/{case}: {} video tokens, first logits max|diff| {d_last:.2e}", c.video_tokens);
        assert_eq!(
            c.token_ids[..want_ids.len().min(c.token_ids.len())],
            want_ids[..want_ids.len().min(c.token_ids.len())],
            "{case}"
        );
        assert!(d_last <= tol(LOGIT_TOL), "{case}: {d_last:e}");
    }
}

#[test]
fn a_follow_up_question_reuses_the_video_prefix_and_answers_as_a_fresh_engine() {
    use vl_models::engine::{ChatMessage, Engine, EngineOptions, Part, Request, VideoData};
    let clip = goldens().join("videos/fps15.mkv");
    let video =
        || Part::Video { source: VideoData::Path(clip.clone()), name: "fps15".into(), options: Default::default() };
    let opts = GenerationOptions { max_new_tokens: 4, ..Default::default() };
    let first = vec![ChatMessage::new("user", vec![video(), Part::Text("What happens in the video?".into())])];
    let mut second = first.clone();
    second.push(ChatMessage::text("assistant", "A disk moves."));
    second.push(ChatMessage::text("user", "And the bar?"));
    let req = |messages: Vec<ChatMessage>| Request { messages, options: opts.clone(), ..Default::default() };

    let warm = Engine::load(&tiny_a(), EngineOptions::default()).unwrap();
    let a = warm.generate(&req(first), &mut |_| true).unwrap();
    let b = warm.generate(&req(second.clone()), &mut |_| true).unwrap();
    let cold = Engine::load(&tiny_a(), EngineOptions::default()).unwrap();
    let fresh = cold.generate(&req(second), &mut |_| true).unwrap();
    println!(
        "follow-up: {} of {} prompt tokens reused, {} video feature cache hit(s)",
        b.cached_tokens, b.prompt_tokens, b.video_cache_hits
    );
    // The whole first prompt (video included) is reused, the video's features come from the cache.
    assert!(b.cached_tokens >= a.prompt_tokens - 1, "{} of {}", b.cached_tokens, a.prompt_tokens);
    assert_eq!((a.video_cache_hits, b.video_cache_hits, b.image_cache_hits), (0, 1, 0));
    // The second turn resends the video: its frames come from the clip cache, not ffmpeg.
    assert_eq!((a.videos[0].from_cache, b.videos[0].from_cache, fresh.videos[0].from_cache), (false, true, false));
    assert_eq!(a.videos[0].plan, b.videos[0].plan);
    assert_eq!(b.token_ids, fresh.token_ids);
    let d = b.first_logits.iter().zip(&fresh.first_logits).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(d <= 1e-4, "reused prefix changed the logits by {d}");
}

/// The clip cache knows a file by its path, size and modification time: a file replaced under the
/// same name is decoded again; bytes are known by their hash.
#[test]
fn a_replaced_video_file_is_decoded_again() {
    use vl_models::engine::{ChatMessage, Engine, EngineOptions, Part, Request, VideoData};
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mkv");
    let ask = |engine: &Engine, source: VideoData| {
        let part = Part::Video { source, name: "clip".into(), options: Default::default() };
        let messages = vec![ChatMessage::new("user", vec![part, Part::Text("What happens?".into())])];
        let opts = GenerationOptions { max_new_tokens: 1, ..Default::default() };
        engine.generate(&Request { messages, options: opts, ..Default::default() }, &mut |_| true).unwrap()
    };
    let engine = Engine::load(&tiny_a(), EngineOptions::default()).unwrap();
    std::fs::copy(goldens().join("videos/fps15.mkv"), &clip).unwrap();
    let first = ask(&engine, VideoData::Path(clip.clone()));
    let again = ask(&engine, VideoData::Path(clip.clone()));
    std::fs::copy(goldens().join("videos/odd5.mkv"), &clip).unwrap();
    let replaced = ask(&engine, VideoData::Path(clip.clone()));
    let v = |c: &vl_models::engine::Completion| (c.videos[0].from_cache, c.videos[0].info.frames);
    assert_eq!([v(&first), v(&again), v(&replaced)], [(false, 45), (true, 45), (false, 5)]);
    // Bytes: the same upload twice hits; a cache of 0 bytes never does.
    let bytes = std::fs::read(goldens().join("videos/odd5.mkv")).unwrap();
    assert!(!ask(&engine, VideoData::Bytes(bytes.clone())).videos[0].from_cache);
    assert!(ask(&engine, VideoData::Bytes(bytes.clone())).videos[0].from_cache);
    let off = Engine::load(&tiny_a(), EngineOptions { clip_cache_bytes: 0, ..Default::default() }).unwrap();
    assert!(!ask(&off, VideoData::Bytes(bytes.clone())).videos[0].from_cache);
    assert!(!ask(&off, VideoData::Bytes(bytes)).videos[0].from_cache);
}

#[test]
fn a_rotated_phone_video_is_read_upright_with_its_sides_swapped() {
    // An 80x48 clip whose stream says "display rotated 90 degrees", as phones write them.
    let dir = tempfile::tempdir().unwrap();
    let (plain, clip) = (dir.path().join("plain.mp4"), dir.path().join("rot.mp4"));
    let ffmpeg = |args: &[&str]| {
        let ok = std::process::Command::new("ffmpeg").args(["-v", "error", "-y"]).args(args).status().expect("ffmpeg");
        assert!(ok.success(), "{args:?}");
    };
    let (p, c) = (plain.to_str().unwrap(), clip.to_str().unwrap());
    ffmpeg(&["-f", "lavfi", "-i", "testsrc=size=80x48:rate=10", "-t", "1", "-c:v", "mpeg4", "-q:v", "2", p]);
    // The rotation goes into the container's display matrix on a stream copy.
    ffmpeg(&["-i", p, "-c", "copy", "-metadata:s:v:0", "rotate=90", c]);
    let src = VideoSource::open(&clip, 2.0, &VideoLimits::default()).unwrap();
    assert_eq!((src.info().width, src.info().height, src.info().frames), (48, 80, 10));
    // The frames equal what ffmpeg itself outputs for the stream (turned upright).
    let raw = ffmpeg_first_frame(&clip);
    let mut first = None;
    src.read_frames(&[0, 9], &mut |k, f| {
        if k == 0 {
            first = Some(f.as_raw().clone());
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(first.unwrap(), raw);
}

#[test]
fn a_decode_past_the_time_limit_is_stopped_and_refused() {
    let clip = goldens().join("videos/long.mkv");
    let limits = VideoLimits { max_decode_time: Some(std::time::Duration::from_millis(1)), ..Default::default() };
    // The probe (ffprobe counts every packet, reading the whole file) is bounded too.
    let e = VideoSource::open(&clip, 2.0, &limits).unwrap_err().to_string();
    assert!(
        e.contains("long.mkv") && e.contains("probing it with ffprobe took longer than the decode limit of 0.001 s"),
        "{e}"
    );
    let mut src = VideoSource::open(&clip, 2.0, &VideoLimits::default()).unwrap();
    src.set_max_decode_time(limits.max_decode_time);
    let e = src.read_frames(&[0, 30, 59], &mut |_, _| Ok(())).unwrap_err().to_string();
    assert!(e.contains("long.mkv") && e.contains("decoding took longer than the limit of 0.001 s"), "{e}");
    // Without a limit the same frames decode.
    let src = VideoSource::open(&clip, 2.0, &VideoLimits::default()).unwrap();
    let mut n = 0;
    src.read_frames(&[0, 30, 59], &mut |_, _| {
        n += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(n, 3);
}

/// A copy of `src` (an MP4 with an identity display matrix) whose track says "display rotated
/// `degrees` counter-clockwise": the tkhd matrix written as phones write it, any angle.
fn with_display_rotation(src: &std::path::Path, degrees: f64, out: &std::path::Path) {
    let mut d = std::fs::read(src).unwrap();
    let at = d.windows(4).position(|w| w == b"tkhd").unwrap() + 4 + 40;
    let identity: Vec<u8> = [0x10000i32, 0, 0, 0, 0x10000, 0].iter().flat_map(|v| v.to_be_bytes()).collect();
    assert_eq!(&d[at..at + 24], identity.as_slice(), "not a version-0 tkhd with an identity matrix");
    let (s, c) = degrees.to_radians().sin_cos();
    let fixed = |v: f64| ((v * 65536.0).round() as i32).to_be_bytes();
    for (k, v) in [c, -s, 0.0, s, c].into_iter().enumerate() {
        d[at + 4 * k..at + 4 * k + 4].copy_from_slice(&fixed(v));
    }
    std::fs::write(out, d).unwrap();
}

/// ffmpeg's own RGB output of a clip's first frame (its autorotation applied).
fn ffmpeg_first_frame(clip: &std::path::Path) -> Vec<u8> {
    let o = std::process::Command::new("ffmpeg")
        .args(["-v", "error", "-i"])
        .arg(clip)
        .args(["-frames:v", "1", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"])
        .output()
        .unwrap();
    assert!(o.status.success());
    o.stdout
}

#[test]
fn a_rotation_just_off_a_quarter_turn_reads_as_that_quarter_turn() {
    // Angles phones write a little off (89.6, 90.9, ...): read as the nearest quarter turn, the
    // same frames as a clip rotated by exactly that quarter, as ffmpeg itself outputs those.
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.mp4");
    let ok = std::process::Command::new("ffmpeg")
        .args(["-v", "error", "-y", "-f", "lavfi", "-i", "testsrc=size=80x48:rate=10", "-t", "1"])
        .args(["-c:v", "mpeg4", "-q:v", "2"])
        .arg(&plain)
        .status()
        .unwrap();
    assert!(ok.success());
    for (angle, quarter) in [(89.6, 90.0), (90.9, 90.0), (-90.9, -90.0), (179.4, 180.0), (270.8, 270.0), (-0.7, 0.0)] {
        let (odd, exact) = (dir.path().join("odd.mp4"), dir.path().join("exact.mp4"));
        with_display_rotation(&plain, angle, &odd);
        with_display_rotation(&plain, quarter, &exact);
        let src = VideoSource::open(&odd, 2.0, &VideoLimits::default()).unwrap();
        let sides = if (quarter as i64).rem_euclid(180) == 90 { (48, 80) } else { (80, 48) };
        assert_eq!((src.info().width, src.info().height), sides, "{angle} degrees");
        let mut first = None;
        src.read_frames(&[0, 9], &mut |k, f| {
            if k == 0 {
                first = Some(f.as_raw().clone());
            }
            Ok(())
        })
        .unwrap();
        assert!(first.unwrap() == ffmpeg_first_frame(&exact), "{angle} degrees: not the frame turned {quarter}");
    }
}

#[test]
fn a_ten_minute_clip_samples_its_frames_at_the_default_budget() {
    // 10 minutes at 5 frames a second, each frame's colour its number (lossless FFV1, RGB), read
    // with tiny-a's default video processor. The reference's sampling (Qwen3VLVideoProcessor):
    // min(600 s x 2 fps, max_frames 768) = 768 frames, spread from the first frame to the last.
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("ten-minutes.mkv");
    let ok = std::process::Command::new("ffmpeg")
        .args(["-v", "error", "-y", "-f", "lavfi", "-i"])
        .arg("nullsrc=size=16x16:rate=5:duration=600,format=rgb24,geq=r='mod(N,256)':g='floor(N/256)':b=0")
        .args(["-c:v", "ffv1", "-pix_fmt", "bgr0"])
        .arg(&clip)
        .status()
        .unwrap();
    assert!(ok.success());
    let src = VideoSource::open(&clip, 2.0, &VideoLimits::default()).unwrap();
    assert_eq!(src.info().frames, 3000);
    let plan = VideoProcessor::from_dir(&tiny_a()).unwrap().plan_source(&src).unwrap();
    assert_eq!(plan.indices.len(), 768);
    assert_eq!((plan.indices[0], plan.indices[767]), (0, 2999));
    let mut seen = Vec::new();
    src.read_frames(&plan.indices, &mut |_, f| {
        let p = f.get_pixel(8, 8);
        seen.push(p[0] as usize + 256 * p[1] as usize);
        Ok(())
    })
    .unwrap();
    assert_eq!(seen, plan.indices, "the frames decoded are the frames sampled");
}

/// A GIF of `n` 1x1 frames (0.1 s each) on a `w` x `h` canvas: a few bytes a frame, while a
/// decoder composes each onto the whole canvas.
fn sparse_gif(w: u16, h: u16, n: usize) -> Vec<u8> {
    let mut b = b"GIF89a".to_vec();
    b.extend(w.to_le_bytes());
    b.extend(h.to_le_bytes());
    b.extend([0, 0, 0]);
    for _ in 0..n {
        b.extend([0x21, 0xf9, 0x04, 0x00, 10, 0, 0, 0]);
        b.push(0x2c);
        for v in [0u16, 0, 1, 1] {
            b.extend(v.to_le_bytes());
        }
        // A 2-colour local table, then one pixel: LZW codes clear, 0, end at 3 bits.
        b.extend([0x80, 0, 0, 0, 0xff, 0xff, 0xff, 0x02, 0x02, 0x44, 0x01, 0x00]);
    }
    b.push(0x3b);
    b
}

#[test]
fn sparse_animations_on_huge_canvases_are_bounded_in_pixels_and_time() {
    // Canvases of 8000x8000 and 2000x2000, frame counts just over the 2^30 decoded-pixel
    // budget and far over it: each is refused by the budget (about 4 s of decoding, the
    // budget's cost), whatever the file's few bytes say.
    for (side, n) in [(8000u16, 67usize), (2000, 300)] {
        let bytes = sparse_gif(side, side, n);
        assert!(bytes.len() < 10_000);
        let t = std::time::Instant::now();
        let e = VideoSource::from_bytes(bytes, std::path::Path::new("bomb.gif"), &VideoLimits::default())
            .err()
            .unwrap_or_else(|| panic!("{side}x{side} x {n} frames accepted"))
            .to_string();
        assert!(e.contains("over the limit of 1073741824 decoded pixels per animation"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "{side} x {n}: {:?}", t.elapsed());
    }
    // Within the budget, the decode-time bound covers the in-process decoder too.
    let limits = VideoLimits { max_decode_time: Some(std::time::Duration::from_millis(1)), ..Default::default() };
    let e = VideoSource::from_bytes(sparse_gif(4000, 4000, 20), std::path::Path::new("slow.gif"), &limits)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("slow.gif") && e.contains("decoding took longer than the limit of 0.001 s"), "{e}");
    // And a small one decodes: 20 frames at 10 fps.
    let src = VideoSource::from_bytes(sparse_gif(64, 48, 20), std::path::Path::new("ok.gif"), &VideoLimits::default())
        .unwrap();
    assert_eq!((src.info().width, src.info().height, src.info().frames), (64, 48, 20));
}

#[test]
fn the_decode_time_bound_is_the_request_s_for_all_its_videos() {
    use vl_models::engine::{ChatMessage, Engine, EngineOptions, ModelOptions, Part, Request, VideoData};
    // 60 video parts of a clip that decodes in well under the bound each: without a request-wide
    // budget they would take 60 times one decode; with it the request stops at the bound.
    let limits = VideoLimits { max_decode_time: Some(std::time::Duration::from_millis(300)), ..Default::default() };
    let opts = EngineOptions {
        model: ModelOptions { video_limits: limits, ..Default::default() },
        clip_cache_bytes: 0,
        ..Default::default()
    };
    let engine = Engine::load(&tiny_a(), opts).unwrap();
    let clip = goldens().join("videos/long.mkv");
    let mut parts: Vec<Part> = (0..60)
        .map(|_| Part::Video {
            source: VideoData::Path(clip.clone()),
            name: clip.display().to_string(),
            options: Default::default(),
        })
        .collect();
    parts.push(Part::Text("Describe.".into()));
    let req = Request {
        messages: vec![ChatMessage::new("user", parts)],
        options: GenerationOptions { max_new_tokens: 1, ..Default::default() },
        ..Default::default()
    };
    let t = std::time::Instant::now();
    let e = engine.generate(&req, &mut |_| true).unwrap_err().to_string();
    assert!(e.contains("longer than the") && e.contains("limit of"), "{e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(3), "{:?}: {e}", t.elapsed());
}

/// A clip copied over a cached one keeping its size and modification time (`cp -p`, `rsync -a`,
/// `tar x`), in place or renamed into place, is decoded again: the cache key holds what a copy
/// cannot keep (inode and status-change time).
#[test]
fn a_same_size_clip_copied_in_with_the_old_mtime_is_decoded_again() {
    use vl_models::engine::{ChatMessage, Engine, EngineOptions, Part, Request, VideoData};
    let dir = tempfile::tempdir().unwrap();
    // Two raw-video clips of the same geometry and length: the same size, other pixels.
    let make = |color: &str| {
        let out = dir.path().join(format!("{color}.avi"));
        let src = format!("color=c={color}:s=64x64:d=1:r=4");
        let ok = std::process::Command::new("ffmpeg")
            .args(["-v", "error", "-y", "-f", "lavfi", "-i", &src, "-c:v", "rawvideo", "-pix_fmt", "bgr24"])
            .arg(&out)
            .status()
            .expect("ffmpeg");
        assert!(ok.success());
        out
    };
    let colors = ["red", "blue", "green", "white"];
    let clips: Vec<_> = colors.iter().map(|c| make(c)).collect();
    let size = std::fs::metadata(&clips[0]).unwrap().len();
    assert!(clips.iter().all(|c| std::fs::metadata(c).unwrap().len() == size), "raw clips differ in size");
    let ask = |engine: &Engine, path: &std::path::Path| {
        let part =
            Part::Video { source: VideoData::Path(path.into()), name: "clip".into(), options: Default::default() };
        let messages = vec![ChatMessage::new("user", vec![part, Part::Text("What color is it?".into())])];
        let opts = GenerationOptions { max_new_tokens: 1, ..Default::default() };
        engine.generate(&Request { messages, options: opts, ..Default::default() }, &mut |_| true).unwrap()
    };
    let engine = Engine::load(&tiny_a(), EngineOptions::default()).unwrap();
    let target = dir.path().join("clip.avi");
    std::fs::copy(&clips[0], &target).unwrap();
    let mtime = std::fs::metadata(&target).unwrap().modified().unwrap();
    let first = ask(&engine, &target);
    let again = ask(&engine, &target);
    assert_eq!((first.videos[0].from_cache, again.videos[0].from_cache), (false, true));
    let mut previous = first;
    for (i, clip) in clips.iter().enumerate().skip(1) {
        // Odd rounds copy over the file in place (same inode), even ones rename a copy into place.
        if i % 2 == 1 {
            std::fs::copy(clip, &target).unwrap();
        } else {
            let tmp = dir.path().join("incoming.avi");
            std::fs::copy(clip, &tmp).unwrap();
            std::fs::rename(&tmp, &target).unwrap();
        }
        std::fs::File::options().write(true).open(&target).unwrap().set_modified(mtime).unwrap();
        let meta = std::fs::metadata(&target).unwrap();
        assert_eq!((meta.len(), meta.modified().unwrap()), (size, mtime), "the copy keeps size and mtime");
        let now = ask(&engine, &target);
        assert!(!now.videos[0].from_cache, "round {i} ({}): answered from the old clip", colors[i]);
        let fresh = Engine::load(&tiny_a(), EngineOptions::default()).unwrap();
        let want = ask(&fresh, clip);
        let d = now.first_logits.iter().zip(&want.first_logits).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d <= 1e-4, "round {i}: logits differ from a fresh engine's on the new clip by {d}");
        assert_ne!(now.first_logits, previous.first_logits, "round {i}: the clips should differ");
        previous = now;
    }
}

/// Thirty frame-directory videos of thousands of frames each, named by a client (the server's
/// confined mode: frames must resolve inside their directory), cost a listing each: the request
/// is answered in well under a second of probing, and a frame linked from outside is still
/// refused by name.
#[test]
fn many_large_frame_directories_are_listed_cheaply_and_still_confined() {
    use std::time::{Duration, Instant};
    use vl_models::engine::{ChatMessage, Engine, EngineOptions, ModelOptions, Part, Request, VideoData};
    use vl_models::video::VideoOptions;
    let dir = tempfile::tempdir().unwrap();
    let frames = dir.path().join("frames");
    std::fs::create_dir(&frames).unwrap();
    let first = frames.join("f00000.png");
    image::RgbImage::from_fn(64, 64, |x, y| image::Rgb([(x * 4) as u8, (y * 4) as u8, 90])).save(&first).unwrap();
    for i in 1..5000 {
        std::fs::hard_link(&first, frames.join(format!("f{i:05}.png"))).unwrap();
    }
    let opts = EngineOptions {
        model: ModelOptions {
            video_limits: VideoLimits { confined: true, ..Default::default() },
            ..Default::default()
        },
        prefix_cache: false,
        ..Default::default()
    };
    let engine = Engine::load(&tiny_a(), opts).unwrap();
    let small = VideoOptions { max_frames: Some(4), max_pixels: Some(20_000), ..Default::default() };
    let ask = |dirs: &[std::path::PathBuf]| {
        let mut parts: Vec<Part> = dirs
            .iter()
            .enumerate()
            .map(|(i, d)| Part::Video { source: VideoData::Path(d.clone()), name: format!("v{i}"), options: small })
            .collect();
        parts.push(Part::Text("What happens?".into()));
        let messages = vec![ChatMessage::new("user", parts)];
        let opts = GenerationOptions { max_new_tokens: 1, ..Default::default() };
        engine.generate(&Request { messages, options: opts, ..Default::default() }, &mut |_| true)
    };
    let t = Instant::now();
    let c = ask(&vec![frames.clone(); 30]).unwrap();
    let took = t.elapsed();
    println!("30 directories of 5000 frames: answered in {took:.2?} (media {:.2?})", c.vision_time);
    assert_eq!(c.videos.len(), 30);
    assert!(c.videos.iter().all(|v| v.info.frames == 5000));
    assert!(took < Duration::from_secs(3), "30 frame directories took {took:?}");
    // A frame that is a link to a file outside the directory: refused, naming the directory.
    let outside = dir.path().join("outside.png");
    std::fs::copy(&first, &outside).unwrap();
    std::os::unix::fs::symlink(&outside, frames.join("f99999.png")).unwrap();
    let err = ask(std::slice::from_ref(&frames)).unwrap_err().to_string();
    assert!(err.contains("link to a file outside the directory") && err.contains("f99999.png"), "{err}");
}
