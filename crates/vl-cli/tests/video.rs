//! `vl run --video` end to end on tiny-a: sampling and grids reported by `--json` (values
//! computed by hand from the reference's formulas, see docs/video.md), the reference's greedy ids
//! for a video + image prompt, input without ffmpeg (animated PNG/GIF, frame directories), and
//! one clear line per bad input or flag. The video files are the lossless golden clips
//! (goldens/videos, FFV1 in Matroska); decoding them needs `ffmpeg` on PATH (.ci/run installs it).

use std::path::{Path, PathBuf};
use std::process::Command;

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

fn checkpoint() -> String {
    goldens().join("tiny-a/checkpoint").display().to_string()
}

fn clip(name: &str) -> String {
    goldens().join("videos").join(name).display().to_string()
}

/// Runs `vl` offline with a private HF cache; `path` replaces PATH when given.
fn vl(args: &[&str], path: Option<&str>) -> (i32, String, String) {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vl"));
    cmd.args(args).env("HF_HOME", home.path()).env_remove("HF_HUB_CACHE").env("HF_HUB_OFFLINE", "1");
    if let Some(p) = path {
        cmd.env("PATH", p);
    }
    let out = cmd.output().expect("run vl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn run_json(extra: &[&str], path: Option<&str>) -> serde_json::Value {
    let ck = checkpoint();
    let mut args = vec!["run", "--model", &ck, "--max-new-tokens", "2", "--json"];
    args.extend_from_slice(extra);
    let (code, out, err) = vl(&args, path);
    assert_eq!(code, 0, "{extra:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Fails with exit code 1 and one `error:` line holding every needle.
fn fails(extra: &[&str], path: Option<&str>, needles: &[&str]) {
    let ck = checkpoint();
    let mut args = vec!["run", "--model", &ck, "--max-new-tokens", "2"];
    args.extend_from_slice(extra);
    let (code, out, err) = vl(&args, path);
    let err = err.trim_end();
    assert!(code == 1 || code == 2, "{extra:?}: exit {code}: {err}");
    assert_eq!(err.lines().count(), 1, "{extra:?}: one line expected: {err}");
    assert!(err.starts_with("error: ") || err.starts_with("error:"), "{err}");
    assert!(!err.contains("internal error") && !err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{extra:?}: {err:?} lacks {n:?}");
    }
    assert!(out.is_empty(), "junk on stdout: {out}");
}

fn frames_dir(sizes: &[(u32, u32)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (i, &(w, h)) in sizes.iter().enumerate() {
        let mut data = Vec::new();
        for y in 0..h {
            for x in 0..w {
                data.extend_from_slice(&[(x * 4) as u8, (y * 4) as u8, (i * 40) as u8]);
            }
        }
        let f = std::fs::File::create(dir.path().join(format!("frame{i:03}.png"))).unwrap();
        let mut enc = png::Encoder::new(f, w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.write_header().unwrap().write_image_data(&data).unwrap();
    }
    dir
}

#[test]
fn a_video_file_is_sampled_and_reported_as_the_reference_does() {
    // fps15.mkv: 45 frames of 80x56 at 15 fps. At 2 fps: int(45 / 15 * 2) = 6 frames at
    // linspace(0, 44, 6).round() = [0, 9, 18, 26, 35, 44]; pairs at (0+9)/15/2 = 0.3 s, ...
    // Within tiny-a's video budget (4096..25165824 pixels over the clip) 56x80 rounds to 64x64
    // (1.75 -> 2, 2.5 -> 2 by half to even): grid [3, 4, 4], 3 x 16 / 4 = 12 tokens.
    let j = run_json(&["--video", &clip("fps15.mkv")], None);
    let v = &j["videos"][0];
    assert_eq!(v["decoder"], "ffmpeg");
    assert_eq!((v["width"].as_u64(), v["height"].as_u64(), v["frames"].as_u64()), (Some(80), Some(56), Some(45)));
    assert_eq!(v["fps"].as_f64(), Some(15.0));
    assert_eq!(v["frame_indices"], serde_json::json!([0, 9, 18, 26, 35, 44]));
    let ts: Vec<f64> = v["timestamps"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect();
    assert_eq!(ts, vec![9.0 / 15.0 / 2.0, (18.0 / 15.0 + 26.0 / 15.0) / 2.0, (35.0 / 15.0 + 44.0 / 15.0) / 2.0]);
    assert_eq!(v["grid_thw"], serde_json::json!([3, 4, 4]));
    assert_eq!((v["resized_width"].as_u64(), v["resized_height"].as_u64()), (Some(64), Some(64)));
    assert_eq!(v["tokens"].as_u64(), Some(12));
    assert_eq!(j["video_tokens"].as_u64(), Some(12));
    assert_eq!(v["scaled_below_checkpoint_budget"], false);

    // The frame limit: 3 frames at linspace(0, 44, 3) = [0, 22, 44], the odd one paired with itself.
    let j = run_json(&["--video", &clip("fps15.mkv"), "--video-max-frames", "3"], None);
    assert_eq!(j["videos"][0]["frame_indices"], serde_json::json!([0, 22, 44]));
    assert_eq!(j["videos"][0]["grid_thw"], serde_json::json!([2, 4, 4]));
    // Another sampling rate: int(45 / 15 * 4) = 12 frames.
    let j = run_json(&["--video", &clip("fps15.mkv"), "--video-fps", "4"], None);
    assert_eq!(j["videos"][0]["sampled_frames"].as_u64(), Some(12));
    // A pixel budget below the clip's: 6 x 64 x 64 = 24576 > 12288 scales the frames down
    // (beta = sqrt(6 * 56 * 80 / 12288) = 1.48: floor(37.8 / 32) = 1, floor(54.0 / 32) = 1 -> 32x32).
    let ck = checkpoint();
    let fps15 = clip("fps15.mkv");
    let args =
        ["run", "--model", &ck, "--max-new-tokens", "1", "--json", "--video", &fps15, "--video-max-pixels", "12288"];
    let (code, out, err) = vl(&args, None);
    assert_eq!(code, 0, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["videos"][0]["grid_thw"], serde_json::json!([3, 2, 2]));
    assert_eq!(j["videos"][0]["scaled_below_checkpoint_budget"], true);
    assert!(
        err.contains("scaled to 32x32 (3 visual tokens) by --video-max-pixels 12288; the checkpoint's budget would give 64x64 (12 tokens)"),
        "{err}"
    );
}

#[test]
fn image_and_video_enter_the_prompt_in_flag_order_with_the_reference_greedy_ids() {
    // goldens/tiny-a/cases/video_image: [image square, video odd5, text].
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join("tiny-a/cases/video_image.json")).unwrap())
            .unwrap();
    let want: Vec<u64> = meta["greedy"]["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let image = goldens().join("images/square.png").display().to_string();
    // The user's text as the golden prompt has it (goldens/prompts/video_image.json).
    let prompts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join("prompts/video_image.json")).unwrap()).unwrap();
    let content = prompts["messages"][0]["content"].as_array().unwrap();
    let prompt = content.iter().find(|c| c["type"] == "text").unwrap()["text"].as_str().unwrap().to_string();
    let prompt = prompt.as_str();
    let steps = want.len().to_string();
    let ck = checkpoint();
    let ids = |order: &[&str]| -> Vec<u64> {
        let mut args = vec!["run", "--model", &ck, "--json", "--max-new-tokens", &steps, "--prompt", prompt];
        args.extend_from_slice(order);
        let (code, out, err) = vl(&args, None);
        assert_eq!(code, 0, "{err}");
        let j: serde_json::Value = serde_json::from_str(&out).unwrap();
        j["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
    };
    let odd5 = clip("odd5.mkv");
    assert_eq!(ids(&["--image", &image, "--video", &odd5]), want);
    assert_ne!(ids(&["--video", &odd5, "--image", &image]), want, "the order of --video and --image must matter");
}

#[test]
fn animated_images_and_frame_directories_need_no_ffmpeg() {
    let empty = tempfile::tempdir().unwrap();
    let no_path = empty.path().to_str().unwrap();
    // anim.png: an 8-frame APNG at 125 ms a frame (8 fps): int(8 / 8 * 2) = 2 -> min_frames 4,
    // linspace(0, 7, 4).round() = [0, 2, 5, 7].
    let j = run_json(&["--video", &clip("anim.png")], Some(no_path));
    let v = &j["videos"][0];
    assert_eq!(v["decoder"], "apng");
    assert_eq!((v["frames"].as_u64(), v["fps"].as_f64()), (Some(8), Some(8.0)));
    assert_eq!(v["frame_indices"], serde_json::json!([0, 2, 5, 7]));
    // Six frames taken at --video-fps 3: all six sampled, pairs at (0 + 1/3) / 2, ...
    let dir = frames_dir(&[(64, 48); 6]);
    std::fs::write(dir.path().join("notes.txt"), b"not a frame").unwrap();
    let j = run_json(&["--video", dir.path().to_str().unwrap(), "--video-fps", "3"], Some(no_path));
    let v = &j["videos"][0];
    assert_eq!(v["decoder"], "frames");
    assert_eq!(v["frame_indices"], serde_json::json!([0, 1, 2, 3, 4, 5]));
    let ts: Vec<f64> = v["timestamps"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect();
    assert_eq!(ts, vec![(1.0 / 3.0) / 2.0, (2.0 / 3.0 + 1.0) / 2.0, (4.0 / 3.0 + 5.0 / 3.0) / 2.0]);
    // A video file without ffmpeg: how to install it.
    fails(&["--video", &clip("fps15.mkv")], Some(no_path), &["fps15.mkv", "needs `ffmpeg`", "apt-get install ffmpeg"]);
}

#[test]
fn bad_videos_and_flags_get_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let full = std::fs::read(goldens().join("videos/fps15.mkv")).unwrap();
    let cut = tmp.path().join("cut.mkv");
    std::fs::write(&cut, &full[..full.len() / 3]).unwrap();
    let empty = tmp.path().join("empty.mp4");
    std::fs::write(&empty, b"").unwrap();
    let text = tmp.path().join("notes.mp4");
    std::fs::write(&text, b"this is not a video at all\n".repeat(20)).unwrap();
    let s = |p: &Path| p.display().to_string();
    // A truncated file still decodes its first frames; whatever it yields, it is not a crash and
    // never junk: either an answer (exit 0) or one line naming the file.
    let (code, _, err) = vl(&["run", "--model", &checkpoint(), "--max-new-tokens", "1", "--video", &s(&cut)], None);
    assert!(code == 0 || (code == 1 && err.trim().lines().count() == 1 && err.contains("cut.mkv")), "{code}: {err}");
    fails(&["--video", &s(&empty)], None, &["empty.mp4"]);
    fails(&["--video", &s(&text)], None, &["notes.mp4"]);
    fails(&["--video", "/nonexistent/clip.mp4"], None, &["/nonexistent/clip.mp4"]);
    // A playlist naming another file is not a video (ffmpeg would open that file).
    let list = tmp.path().join("list.mp4");
    let target = goldens().join("videos/fps15.mkv").canonicalize().unwrap();
    std::fs::write(&list, format!("#EXTM3U\n#EXTINF:10.0,\n{}\n#EXT-X-ENDLIST\n", target.display())).unwrap();
    fails(&["--video", &s(&list)], None, &["list.mp4", "cannot read it"]);
    let none = tempfile::tempdir().unwrap();
    fails(&["--video", &s(none.path())], None, &["no frame images"]);
    let one = frames_dir(&[(64, 48)]);
    fails(&["--video", &s(one.path())], None, &["1 frame(s) sampled; a video needs at least 2"]);
    let mixed = frames_dir(&[(64, 48), (64, 48), (48, 64), (64, 48)]);
    fails(&["--video", &s(mixed.path()), "--video-fps", "2"], None, &["frame002.png", "changing size"]);
    let junk = frames_dir(&[(64, 48), (64, 48)]);
    std::fs::write(junk.path().join("frame001.png"), b"not a png").unwrap();
    fails(&["--video", &s(junk.path())], None, &["frame001.png"]);
    // A GIF claiming a 65535 x 65535 canvas: refused from its header.
    let bomb = tmp.path().join("bomb.gif");
    let mut g = b"GIF89a".to_vec();
    g.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00]);
    g.extend_from_slice(&[0x2c, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x00, 0x02, 0x02, 0x4c, 0x01, 0x00, 0x3b]);
    std::fs::write(&bomb, g).unwrap();
    fails(&["--video", &s(&bomb)], None, &["bomb.gif", "65535x65535", "pixels per frame"]);
    let v = clip("odd5.mkv");
    fails(&["--video", &v, "--video-fps", "0"], None, &["--video-fps", "outside"]);
    fails(&["--video", &v, "--video-fps", "NaN"], None, &["--video-fps"]);
    fails(&["--video", &v, "--video-fps", "5000"], None, &["--video-fps", "5000"]);
    fails(&["--video", &v, "--video-max-frames", "0"], None, &["--video-max-frames 0"]);
    fails(&["--video", &v, "--video-max-frames", "100000"], None, &["--video-max-frames 100000"]);
    fails(&["--video", &v, "--video-max-pixels", "0"], None, &["--video-max-pixels"]);
    fails(&["--video", &v, "--video-max-pixels", "99999999999"], None, &["--video-max-pixels 99999999999"]);
}
