//! The library in a dozen lines: load a checkpoint, prepare a chat prompt with an image, stream a
//! greedy reply. Run from the repository root:
//!   cargo run --release -p vl-models --example describe -- goldens/tiny-a/checkpoint goldens/images/square.png

use std::io::Write;
use std::path::Path;

use candle_core::{DType, Device};
use vl_models::qwen3_vl::{Content, GenerationConfig, GenerationOptions, Message, Processor, Qwen3VlModel};

fn main() -> vl_models::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (dir, image) = (Path::new(&args[1]), Path::new(&args[2]));
    let model = Qwen3VlModel::load(dir, DType::F32, &Device::Cpu)?;
    let proc = Processor::from_dir(dir)?;
    let img = proc.images.process_file(image)?;
    let messages = [Message::new(
        "user",
        vec![Content::Image { image: args[2].clone() }, Content::Text { text: "Describe this image.".into() }],
    )];
    let prompt = proc.prepare(&messages, &[img], &Device::Cpu)?;
    let eos = GenerationConfig::from_dir(dir, &[151_645])?.eos_token_ids;
    let opts = GenerationOptions { max_new_tokens: 32, eos_token_ids: eos, ..Default::default() };
    let mut stream = proc.stream_decoder();
    let gen = model.generate(&prompt, &opts, &mut |id| {
        if let Ok(Some(piece)) = stream.push(id) {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
        true
    })?;
    println!("\n[{} prompt tokens, {} generated]", gen.prompt_tokens, gen.tokens.len());
    Ok(())
}
