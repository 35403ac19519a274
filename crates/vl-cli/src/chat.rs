//! `vl chat`: a multi-turn conversation in the terminal on the resident engine. The history is
//! kept; prefix reuse makes each turn prefill only its new tokens. `/image PATH` (`/video PATH`)
//! attaches an image (a video) to the next message, `/save FILE` and `/load FILE` write and read
//! the conversation (OpenAI's message list as JSON; a loaded one carries media as data URLs,
//! and reads no local file the user did not attach in this session: `conversation::load`), `/reset` starts
//! over, `/exit` (or end of input) quits. On a terminal the line is edited with rustyline,
//! Ctrl-C stops the answer being written (the conversation keeps what was written), and Ctrl-C
//! twice at the prompt or Ctrl-D exits; piped input is read one message per line.

mod conversation;

use std::collections::HashSet;
use std::io::{BufRead, IsTerminal, Read as _, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use vl_models::engine::{ChatMessage, Engine, EngineOptions, ModelOptions, Part, Request, VideoData};
use vl_models::limits::LimitKind;

use crate::flags::{check_media, ChatDefaults, LoadArgs, SamplingArgs};
use crate::note;
use conversation::{check_image, load, save};

#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs<ChatDefaults>,
    #[command(flatten)]
    reasoning: crate::reasoning::ReasoningArgs,
}

enum Input {
    Editor(rustyline::DefaultEditor),
    Lines(std::io::StdinLock<'static>),
}

/// Longest message line read from a pipe; a longer one is skipped (read through, not kept).
const MAX_LINE_BYTES: usize = 4 << 20;

enum Got {
    Line(String),
    /// A line that cannot be a message (too long, not UTF-8): said, and skipped.
    Skipped(String),
    /// Ctrl-C at the prompt.
    Interrupted,
    End,
}

impl Input {
    fn next(&mut self) -> Result<Got> {
        match self {
            Input::Editor(ed) => match ed.readline("> ") {
                Ok(line) if line.len() > MAX_LINE_BYTES => {
                    Ok(Got::Skipped(format!("a line of more than {MAX_LINE_BYTES} bytes; skipped")))
                }
                Ok(line) => {
                    let _ = ed.add_history_entry(line.as_str());
                    Ok(Got::Line(line))
                }
                Err(rustyline::error::ReadlineError::Interrupted) => Ok(Got::Interrupted),
                Err(rustyline::error::ReadlineError::Eof) => Ok(Got::End),
                Err(e) => Err(e).context("reading the terminal"),
            },
            Input::Lines(stdin) => read_line(stdin, MAX_LINE_BYTES),
        }
    }
}

/// One line of at most `max` bytes from `r`; a longer one is read through in bounded pieces
/// and skipped, and one that is not UTF-8 is skipped too.
fn read_line(r: &mut impl BufRead, max: usize) -> Result<Got> {
    let mut line = Vec::new();
    let n = r.by_ref().take(max as u64 + 1).read_until(b'\n', &mut line).context("reading stdin")?;
    if n == 0 {
        return Ok(Got::End);
    }
    if line.len() > max && line.last() != Some(&b'\n') {
        // Read through the rest of the line without keeping it.
        loop {
            let buf = r.fill_buf().context("reading stdin")?;
            if buf.is_empty() {
                break;
            }
            match buf.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    r.consume(i + 1);
                    break;
                }
                None => {
                    let len = buf.len();
                    r.consume(len);
                }
            }
        }
        return Ok(Got::Skipped(format!("a line of more than {max} bytes; skipped")));
    }
    match String::from_utf8(line) {
        Ok(s) => Ok(Got::Line(s)),
        Err(e) => Ok(Got::Skipped(format!(
            "the line is not UTF-8 (invalid byte at offset {}); skipped",
            e.utf8_error().valid_up_to()
        ))),
    }
}

pub fn chat(args: ChatArgs) -> Result<()> {
    let options = args.sampling.options()?;
    let dev = args.load.model.device()?;
    let dtype = args.load.model.dtype(&dev);
    let dir = vl_models::hub::resolve(&args.load.model.model)?;
    let limits = args.load.limits.image_limits();
    let video = args.load.media.video_options()?;
    let quant = args.load.model.quant_of(&dir, dtype)?;
    // The clip cache at its default: the history, videos included, is sent again every turn.
    let opts = EngineOptions {
        model: ModelOptions {
            draft_vocab: args.sampling.speculative.draft_vocab.map(|n| n as usize),
            ..args.load.model_options(dev, dtype, quant, video)
        },
        kv_cache_bytes: args.load.limits.kv_cache_bytes()?,
        ..Default::default()
    };
    let t = Instant::now();
    let draft = args.sampling.speculative.open_draft(&args.load.model, &opts.model)?;
    let engine = Engine::open_with_draft(&dir, args.load.model.mmproj.as_deref(), draft, opts)
        .with_context(|| format!("model {}", dir.display()))?;
    crate::note_load_warnings(&dir, engine.family());
    let interactive = std::io::stdin().is_terminal();
    // Ctrl-C while an answer is written stops that answer (the terminal is not in raw mode
    // then, so it arrives as SIGINT); at the prompt the line editor reads it as a key.
    let interrupted = Arc::new(AtomicBool::new(false));
    if interactive {
        // A second Ctrl-C before the first took effect (a long prefill or video decode, where no
        // token comes to stop at) exits, as a terminal program's Ctrl-C would.
        signal_hook::flag::register_conditional_shutdown(signal_hook::consts::SIGINT, 130, interrupted.clone())
            .context("installing the Ctrl-C handler")?;
        signal_hook::flag::register(signal_hook::consts::SIGINT, interrupted.clone())
            .context("installing the Ctrl-C handler")?;
        note!(
            "loaded {} in {:.1}s. /image PATH attaches an image, /video PATH a video, /save FILE and /load FILE keep the conversation, /reset forgets, /exit quits; Ctrl-C stops an answer.",
            dir.display(),
            t.elapsed().as_secs_f64()
        );
    }
    let mut input = if interactive {
        Input::Editor(rustyline::DefaultEditor::new().context("starting the line editor")?)
    } else {
        Input::Lines(std::io::stdin().lock())
    };

    let start = || args.system.iter().map(|s| ChatMessage::text("system", s)).collect::<Vec<_>>();
    let mut history = start();
    let mut pending: Vec<Part> = Vec::new();
    // The media files attached in this session (canonical): the only local files `/load` reads.
    let mut attached: HashSet<PathBuf> = HashSet::new();
    let out_is_terminal = std::io::stdout().is_terminal();
    let mut out = std::io::stdout().lock();
    let mut interrupted_at_prompt = false;
    loop {
        let line = match input.next()? {
            Got::Line(l) => l,
            Got::Skipped(why) => {
                note!("error: {why}");
                continue;
            }
            Got::End => break,
            Got::Interrupted if interrupted_at_prompt => break,
            Got::Interrupted => {
                interrupted_at_prompt = true;
                note!("(Ctrl-C again, or Ctrl-D, exits)");
                continue;
            }
        };
        interrupted_at_prompt = false;
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
                    let read = check_media("image", &path).and_then(|_| {
                        let data = vl_models::limits::read_bytes(&path, limits.max_file_bytes, LimitKind::ImageBytes)?;
                        // Refused here, not by every later turn.
                        check_image(data, arg, &limits)
                    });
                    match read {
                        Ok(data) => {
                            attached.extend(std::fs::canonicalize(&path));
                            pending.push(Part::Image {
                                data,
                                name: arg.to_string(),
                                min_pixels: None,
                                max_pixels: None,
                            });
                            note!("(image {arg} attached to the next message)");
                        }
                        Err(e) => note!("error: {e}"),
                    }
                }
                "video" if !arg.is_empty() => {
                    let path = PathBuf::from(arg);
                    match check_media("video", &path) {
                        Ok(()) => {
                            attached.extend(std::fs::canonicalize(&path));
                            pending.push(Part::Video {
                                source: VideoData::Path(path),
                                name: arg.to_string(),
                                options: Default::default(),
                            });
                            note!("(video {arg} attached to the next message)");
                        }
                        Err(e) => note!("error: {e}"),
                    }
                }
                "save" if !arg.is_empty() => match save(Path::new(arg), &history) {
                    Ok(()) => note!("(saved {} messages to {arg})", history.len()),
                    Err(e) => note!("error: /save {arg}: {e:#}"),
                },
                "load" if !arg.is_empty() => match load(Path::new(arg), &limits, &attached) {
                    Ok(messages) => {
                        note!("(loaded {} messages from {arg})", messages.len());
                        history = messages;
                        pending.clear();
                    }
                    Err(e) => note!("error: /load {arg}: {e:#}"),
                },
                _ => note!("commands: /image PATH, /video PATH, /save FILE, /load FILE, /reset, /exit"),
            }
            continue;
        }
        let mut parts = std::mem::take(&mut pending);
        parts.push(Part::Text(line.to_string()));
        history.push(ChatMessage::new("user", parts));
        let req = Request {
            messages: history.clone(),
            options: options.clone(),
            template_kwargs: args.reasoning.chat_template_kwargs.clone().unwrap_or_default(),
            ..Default::default()
        };
        let mut write_err = None;
        let mut stopped = false;
        // What was written: a stopped answer keeps exactly this.
        let mut shown = String::new();
        let mut printer = crate::reasoning::Printer::new(&args.reasoning, out_is_terminal);
        interrupted.store(false, Ordering::Relaxed);
        let result = engine.stream(&req, 1, &mut |d| {
            if interrupted.swap(false, Ordering::Relaxed) {
                stopped = true;
                return false;
            }
            match printer.piece(&mut out, d.text, d.reasoning) {
                Ok(()) => {
                    if !d.reasoning {
                        shown.push_str(d.text);
                    }
                    true
                }
                Err(e) => {
                    write_err = Some(e);
                    false
                }
            }
        });
        if let Some(e) = write_err {
            return Err(e).context("writing to stdout");
        }
        // A Ctrl-C that came after the last piece still counts as a stop of this answer.
        stopped |= interrupted.swap(false, Ordering::Relaxed);
        match result.map(|mut all| all.remove(0)) {
            Ok(c) => {
                printer.end_reasoning(&mut out).context("writing to stdout")?;
                writeln!(out).context("writing to stdout")?;
                if stopped {
                    note!("(stopped; the conversation keeps the answer so far)");
                }
                let decode = c.decode_time.as_secs_f64();
                note!(
                    "[{} prompt tokens, {} reused | prefill {:.2}s | {} tokens, {:.1} tok/s]",
                    c.prompt_tokens,
                    c.cached_tokens,
                    c.prefill_time.as_secs_f64(),
                    c.token_ids.len(),
                    if decode > 0.0 { c.token_ids.len().saturating_sub(1) as f64 / decode } else { 0.0 }
                );
                let mut answer = ChatMessage::text("assistant", if stopped { &shown } else { &c.text });
                answer.reasoning = c.reasoning.clone();
                history.push(answer);
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
