//! The library as a downstream crate uses it: load a checkpoint into the resident engine, ask
//! about an image, stream the greedy reply, then ask a follow-up that reuses the conversation's
//! prefix. Run from the repository root:
//!   cargo run --release -p vl-models --example describe -- goldens/tiny-a/checkpoint goldens/images/square.png

use std::io::Write;

use vl_models::{ChatMessage, Engine, Part, Request};

fn main() -> vl_models::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, image] = args.as_slice() else {
        eprintln!("usage: describe MODEL IMAGE");
        std::process::exit(2);
    };
    let engine = Engine::builder(model).build()?;
    let mut req = Request::user(vec![Part::image_file(image)?, Part::text("Describe this image.")]).max_new_tokens(32);
    for follow_up in ["What stands out most?", ""] {
        let answer = engine.generate(&req, &mut |piece| {
            print!("{piece}");
            std::io::stdout().flush().is_ok()
        })?;
        println!(
            "\n[{} prompt tokens, {} reused, {} generated]",
            answer.prompt_tokens,
            answer.cached_tokens,
            answer.token_ids.len()
        );
        if follow_up.is_empty() {
            break;
        }
        req.messages.push(ChatMessage::text("assistant", &answer.text));
        req.messages.push(ChatMessage::text("user", follow_up));
    }
    Ok(())
}
