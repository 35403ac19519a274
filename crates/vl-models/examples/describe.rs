//! The library in a dozen lines: load a checkpoint into the resident engine, ask about an image,
//! stream the greedy reply, then ask a follow-up that reuses the conversation's prefix. Run from
//! the repository root:
//!   cargo run --release -p vl-models --example describe -- goldens/tiny-a/checkpoint goldens/images/square.png

use std::io::Write;
use std::path::Path;

use vl_models::engine::{ChatMessage, Engine, EngineOptions, Part, Request};
use vl_models::qwen3_vl::GenerationOptions;

fn main() -> vl_models::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (dir, image) = (Path::new(&args[1]), &args[2]);
    let engine = Engine::load(dir, "describe", EngineOptions::default())?;
    let data =
        std::fs::read(image).map_err(|e| vl_models::Error::Input { what: image.clone(), message: e.to_string() })?;
    let mut messages = vec![ChatMessage::new(
        "user",
        vec![
            Part::Image { data, name: image.clone(), min_pixels: None, max_pixels: None },
            Part::Text("Describe this image.".into()),
        ],
    )];
    let options = GenerationOptions { max_new_tokens: 32, ..Default::default() };
    for follow_up in ["What stands out most?", ""] {
        let req = Request { messages: messages.clone(), options: options.clone(), ..Default::default() };
        let c = engine.generate(&req, &mut |piece| {
            print!("{piece}");
            std::io::stdout().flush().is_ok()
        })?;
        println!("\n[{} prompt tokens, {} reused, {} generated]", c.prompt_tokens, c.cached_tokens, c.token_ids.len());
        if follow_up.is_empty() {
            break;
        }
        messages.push(ChatMessage::text("assistant", &c.text));
        messages.push(ChatMessage::text("user", follow_up));
    }
    Ok(())
}
