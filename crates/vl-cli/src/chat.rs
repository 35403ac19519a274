//! `vl chat`: a multi-turn conversation in the terminal on the resident engine. The history is
//! kept; prefix reuse makes each turn prefill only its new tokens. `/image PATH` (`/video PATH`)
//! attaches an image (a video) to the next message, `/reset` starts over, `/exit` (or end of input) quits. On a
//! terminal the line is edited with rustyline; piped input is read one message per line.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use vl_models::engine::{ChatMessage, Engine, EngineOptions, Part, Request};
use vl_models::limits::LimitKind;
use vl_models::sampling::GenerationOptions;

use crate::note;
use crate::run::{device, dtype, quant_of, LoadArgs};

#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 1024)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Drop tokens below min_p times the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f64,
    /// Penalize tokens already seen (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

enum Input {
    Editor(rustyline::DefaultEditor),
    Lines(std::io::Lines<std::io::StdinLock<'static>>),
}

impl Input {
    /// The next line, None at the end of input.
    fn next(&mut self) -> Result<Option<String>> {
        match self {
            Input::Editor(ed) => match ed.readline("> ") {
                Ok(line) => {
                    let _ = ed.add_history_entry(line.as_str());
                    Ok(Some(line))
                }
                Err(rustyline::error::ReadlineError::Eof | rustyline::error::ReadlineError::Interrupted) => Ok(None),
                Err(e) => Err(e).context("reading the terminal"),
            },
            Input::Lines(lines) => lines.next().transpose().context("reading stdin"),
        }
    }
}

pub fn chat(args: ChatArgs) -> Result<()> {
    let options = GenerationOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..Default::default()
    };
    options.validate().map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))?;
    let dev = device(args.load.device)?;
    let dtype = dtype(args.load.dtype, &dev);
    let dir = crate::hub::resolve(&args.load.model)?;
    let limits = args.load.image_limits();
    let (video, video_pixel_cap) = args.load.video_options()?;
    let opts = EngineOptions {
        dtype,
        device: dev,
        quant: quant_of(args.load.quantize, &dir)?,
        min_pixels: args.load.min_pixels,
        max_pixels: args.load.max_pixels,
        max_image_tokens: args.load.max_image_tokens(),
        image_limits: limits,
        video,
        video_pixel_cap,
        ..Default::default()
    };
    let t = Instant::now();
    let engine = Engine::open(&dir, args.load.mmproj.as_deref(), &args.load.model, opts)
        .with_context(|| format!("model {}", dir.display()))?;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        note!(
            "loaded {} in {:.1}s. /image PATH attaches an image, /video PATH a video, /reset forgets, /exit quits.",
            dir.display(),
            t.elapsed().as_secs_f64()
        );
    }
    let mut input = if interactive {
        Input::Editor(rustyline::DefaultEditor::new().context("starting the line editor")?)
    } else {
        Input::Lines(std::io::stdin().lock().lines())
    };

    let start = || args.system.iter().map(|s| ChatMessage::text("system", s)).collect::<Vec<_>>();
    let mut history = start();
    let mut pending: Vec<Part> = Vec::new();
    let mut out = std::io::stdout().lock();
    while let Some(line) = input.next()? {
        let line = line.trim_end_matches(['\r', '\n']);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = line.strip_prefix('/') {
            let (name, arg) = cmd.split_once(' ').map_or((cmd, ""), |(a, b)| (a, b.trim()));
            match name {
                "exit" | "quit" => break,
                "reset" => {
                    history = start();
                    pending.clear();
                    note!("(conversation reset)");
                }
                "image" if !arg.is_empty() => {
                    let path = PathBuf::from(arg);
                    match vl_models::limits::read_bytes(&path, limits.max_file_bytes, LimitKind::ImageBytes) {
                        Ok(data) => {
                            pending.push(Part::Image {
                                data,
                                name: arg.to_string(),
                                min_pixels: None,
                                max_pixels: None,
                            });
                            note!("(image {arg} attached to the next message)");
                        }
                        Err(e) => note!("error: {arg}: {e}"),
                    }
                }
                "video" if !arg.is_empty() => {
                    let path = PathBuf::from(arg);
                    if path.exists() {
                        pending.push(Part::Video {
                            source: vl_models::engine::VideoData::Path(path),
                            name: arg.to_string(),
                            options: Default::default(),
                        });
                        note!("(video {arg} attached to the next message)");
                    } else {
                        note!("error: {arg}: no such file or directory");
                    }
                }
                _ => note!("commands: /image PATH, /video PATH, /reset, /exit"),
            }
            continue;
        }
        let mut parts = std::mem::take(&mut pending);
        parts.push(Part::Text(line.to_string()));
        history.push(ChatMessage::new("user", parts));
        let req = Request { messages: history.clone(), options: options.clone(), ..Default::default() };
        let mut write_err = None;
        let result =
            engine.generate(&req, &mut |piece| match out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                Ok(()) => true,
                Err(e) => {
                    write_err = Some(e);
                    false
                }
            });
        if let Some(e) = write_err {
            return Err(e).context("writing to stdout");
        }
        match result {
            Ok(c) => {
                writeln!(out).context("writing to stdout")?;
                let decode = c.decode_time.as_secs_f64();
                note!(
                    "[{} prompt tokens, {} reused | prefill {:.2}s | {} tokens, {:.1} tok/s]",
                    c.prompt_tokens,
                    c.cached_tokens,
                    c.prefill_time.as_secs_f64(),
                    c.token_ids.len(),
                    if decode > 0.0 { c.token_ids.len().saturating_sub(1) as f64 / decode } else { 0.0 }
                );
                history.push(ChatMessage::text("assistant", &c.text));
            }
            Err(e) => {
                // The turn is dropped; the conversation goes on without it.
                history.pop();
                note!("error: {}", e.to_string().split_whitespace().collect::<Vec<_>>().join(" "));
            }
        }
    }
    Ok(())
}
