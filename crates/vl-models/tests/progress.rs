//! The stages an answer reports to a progress observer (`vl run`'s bar): media decoding, the
//! vision tower's blocks one by one, and the prefill's tokens, each ending done == total.
//! Its own test binary: the observer is process-wide.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use vl_models::engine::{ChatMessage, Engine, EngineOptions, Part, Request};
use vl_models::progress::Observer;
use vl_models::sampling::GenerationOptions;

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

struct Log(Mutex<Vec<(&'static str, &'static str, u64, u64)>>);

impl Observer for Log {
    fn report(&self, stage: &'static str, unit: &'static str, done: u64, total: u64) {
        self.0.lock().unwrap().push((stage, unit, done, total));
    }
}

#[test]
fn an_image_answer_reports_media_vision_blocks_and_prefill() {
    let ck = goldens().join("tiny-a/checkpoint");
    let data = std::fs::read(goldens().join("images/square.png")).unwrap();
    let req = Request {
        messages: vec![ChatMessage::new(
            "user",
            vec![
                Part::Image { data, name: "square.png".into(), min_pixels: None, max_pixels: None },
                Part::Text("Describe this image.".into()),
            ],
        )],
        options: GenerationOptions { max_new_tokens: 2, ..Default::default() },
        ..Default::default()
    };
    let opts = EngineOptions { prefill_chunk: 8, ..Default::default() };
    let family = vl_models::registry::open_staged(
        &vl_models::family::Source { model: &ck, mmproj: None, progress: None },
        &opts.model,
    )
    .unwrap();
    let log = Arc::new(Log(Mutex::new(vec![])));
    let shot = {
        let _g = vl_models::progress::install(log.clone());
        Engine::answer_once(family, None, opts, &req, &mut |_| true).unwrap()
    };
    let observer = log;
    let log = observer.0.lock().unwrap().clone();
    let of = |stage: &str| log.iter().filter(|r| r.0 == stage).map(|r| (r.1, r.2, r.3)).collect::<Vec<_>>();
    assert_eq!(of("decoding media"), [("files", 0, 1), ("files", 1, 1)]);
    // tiny-a's vision tower has 4 blocks: 0 before the first, then each one.
    let depth: u64 = 4;
    assert_eq!(of("vision tower"), (0..=depth).map(|i| ("blocks", i, depth)).collect::<Vec<_>>());
    // The prompt prefilled in chunks of 8 tokens, ending at its length.
    let prefill = of("prefill");
    let total = shot.completion.prompt_tokens as u64;
    assert!(prefill.len() as u64 >= 2 * total.div_ceil(8), "{prefill:?}");
    assert!(prefill.iter().all(|&(u, d, t)| u == "tokens" && t == total && d <= total), "{prefill:?}");
    assert_eq!(prefill.last(), Some(&("tokens", total, total)));
    // Stages in order: media, then the tower, then prefill.
    let first = |stage: &str| log.iter().position(|r| r.0 == stage).unwrap();
    assert!(first("decoding media") < first("vision tower") && first("vision tower") < first("prefill"));
    // Nothing reaches it once removed.
    vl_models::progress::report("prefill", "tokens", 1, 1);
    assert_eq!(observer.0.lock().unwrap().len(), log.len());
}
