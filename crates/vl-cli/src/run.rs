//! `vl run`: load a checkpoint, preprocess images, render the chat prompt, generate with
//! streaming output, and report timings. Its flags beyond the shared groups (`crate::flags`)
//! are here; the files it writes in `output`, what it says at the end in `report`, the
//! progress bar in `progress`.

mod output;
mod progress;
mod report;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use vl_models::engine::{ChatMessage, Engine, EngineOptions, ModelOptions, Part, Request, VideoData};
use vl_models::limits::LimitKind;

use crate::flags::model::QuantArg;
use crate::flags::{check_media, LoadArgs, QuantSource, RunDefaults, SamplingArgs};
use crate::note;
use output::{check_not_input, same_file, BoxesOut, LogitsOut};
use progress::Progress;
use report::{grounding_report, image_size_report, quantized_report, video_report, Report};

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,
    /// An image file (PNG, JPEG, WebP, GIF, BMP); repeat for several, in prompt order.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// A video: a file (mp4, mkv, webm, mov, avi, ...: decoded by ffmpeg on PATH), an animated
    /// GIF/PNG/WebP, or a directory of frame images (name order, at --video-fps); repeat for
    /// several. Images and videos enter the prompt in the order given.
    #[arg(long = "video")]
    videos: Vec<PathBuf>,
    /// The user's message (default: "Describe this image." / "Describe this video.").
    #[arg(long)]
    prompt: Option<String>,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs<RunDefaults>,
    /// Print one JSON object (text, token ids, counts, timings) instead of streaming.
    #[arg(long)]
    json: bool,
    /// Constrain the answer to JSON valid against the JSON schema in FILE (structured output:
    /// the answer always parses and validates).
    #[arg(long, value_name = "FILE", conflicts_with = "json_object")]
    json_schema: Option<PathBuf>,
    /// Constrain the answer to a JSON object (any keys).
    #[arg(long, conflicts_with_all = ["regex", "grammar", "choice"])]
    json_object: bool,
    /// Constrain the answer to text the whole of which matches this regular expression (Rust
    /// regex syntax).
    #[arg(long, value_name = "REGEX", conflicts_with_all = ["json_schema", "grammar", "choice"])]
    regex: Option<String>,
    /// Constrain the answer to the language of the grammar in FILE: llama.cpp's GBNF (`root ::=
    /// ...`; a .gbnf file) or llguidance's Lark (`start: ...`; a .lark file); told from the
    /// extension, else from the text.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json_schema", "choice"])]
    grammar: Option<PathBuf>,
    /// Constrain the answer to exactly one of these strings (repeat the flag: --choice yes
    /// --choice no).
    #[arg(long, value_name = "TEXT", conflicts_with = "json_schema")]
    choice: Vec<String>,
    /// Write the f32 logits of the first generated position to this safetensors file (key "logits").
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Whether this is a grounding prompt (boxes or points): its images are then sized to at
    /// least the model's grounding minimum (Qwen3-VL: 1024 visual tokens, within
    /// --max-image-tokens) and the answer's shapes are reported. `auto`: when the prompt says
    /// bbox, bounding box, point_2d, grounding or coordinates, or --draw-boxes is given.
    #[arg(long, value_enum, default_value = "auto")]
    grounding: Grounding,
    /// Draw the answer's boxes and points (with labels, in distinct colours) on the first image,
    /// at the image's own size, into this PNG file; stderr says how many were drawn. Checked
    /// before any work: never an input file, a directory or in a missing directory; an existing
    /// file only with --force.
    #[arg(long, value_name = "OUT.png")]
    draw_boxes: Option<PathBuf>,
    /// Replace an existing --draw-boxes file (without it, an existing file is refused before the
    /// model is loaded). An input file is never replaced.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    reasoning: crate::reasoning::ReasoningArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Grounding {
    /// When the prompt or schema asks for boxes or points, or --draw-boxes is given.
    Auto,
    /// Always a grounding request.
    On,
    /// Never (images at the plain budget, no shapes reported).
    Off,
}

/// The JSON schema in `path` (within `MAX_SCHEMA_BYTES`).
/// The answer's constraint from --json-schema, --json-object, --regex, --grammar or --choice
/// (clap refuses two at once).
fn constraint(args: &RunArgs) -> Result<Option<vl_models::engine::Constraint>> {
    use vl_models::constraint::{GrammarSyntax, MAX_GRAMMAR_BYTES};
    use vl_models::engine::Constraint;
    if let Some(path) = &args.json_schema {
        return Ok(Some(Constraint::JsonSchema(read_schema(path)?)));
    }
    if args.json_object {
        return Ok(Some(Constraint::JsonObject));
    }
    if let Some(rx) = &args.regex {
        return Ok(Some(Constraint::Regex(rx.clone())));
    }
    if let Some(path) = &args.grammar {
        let text = vl_models::limits::read_text(path, MAX_GRAMMAR_BYTES as u64)
            .map_err(|e| anyhow::anyhow!("--grammar {e}"))?;
        if text.trim().is_empty() {
            bail!("--grammar {}: the file is empty", path.display());
        }
        let syntax = match path.extension().and_then(|e| e.to_str()) {
            Some("gbnf") => GrammarSyntax::Gbnf,
            Some("lark") => GrammarSyntax::Lark,
            _ => GrammarSyntax::detect(&text),
        };
        return Ok(Some(Constraint::Grammar { text, syntax }));
    }
    if !args.choice.is_empty() {
        return Ok(Some(Constraint::Choice(args.choice.clone())));
    }
    Ok(None)
}

fn read_schema(path: &Path) -> Result<serde_json::Value> {
    let max = vl_models::constraint::MAX_SCHEMA_BYTES as u64;
    let text = vl_models::limits::read_text(path, max).map_err(|e| anyhow::anyhow!("--json-schema {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--json-schema {}: not JSON: {e}", path.display()))?;
    if !v.is_object() && !v.is_boolean() {
        bail!("--json-schema {}: a JSON schema is an object", path.display());
    }
    Ok(v)
}

/// Whether each media flag was an image or a video, in command-line order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Media {
    Image,
    Video,
}

/// The order of `--image` and `--video` on the command line (images first when unknown).
pub fn media_order(m: Option<&clap::ArgMatches>) -> Vec<Media> {
    let Some(m) = m else { return vec![] };
    let at = |id: &str| m.indices_of(id).map(|i| i.collect::<Vec<_>>()).unwrap_or_default();
    let mut all: Vec<(usize, Media)> = at("images").into_iter().map(|i| (i, Media::Image)).collect();
    all.extend(at("videos").into_iter().map(|i| (i, Media::Video)));
    all.sort_unstable_by_key(|&(i, _)| i);
    all.into_iter().map(|(_, k)| k).collect()
}

pub fn run(args: RunArgs, order: Vec<Media>) -> Result<()> {
    let t_start = Instant::now();
    // Flags first: a typo costs nothing.
    let options = args.sampling.options()?;
    let constraint = constraint(&args)?;
    let video = args.load.media.video_options()?;
    // Media files exist before the model is resolved (or downloaded).
    for p in &args.images {
        check_media("image", p)?;
    }
    for p in &args.videos {
        check_media("video", p)?;
    }
    // Output files before the model is resolved (or downloaded) and loaded: never an input.
    let mut inputs: Vec<(&str, &Path)> = args.images.iter().map(|p| ("--image", p.as_path())).collect();
    inputs.extend(args.videos.iter().map(|p| ("--video", p.as_path())));
    inputs.extend(args.json_schema.iter().map(|p| ("--json-schema", p.as_path())));
    inputs.extend(args.grammar.iter().map(|p| ("--grammar", p.as_path())));
    inputs.extend(args.load.model.mmproj.iter().map(|p| ("--mmproj", p.as_path())));
    inputs.push(("--model", Path::new(&args.load.model.model)));
    if let Some(p) = &args.logits_out {
        // Created (truncated) before the run: never over an input. An existing file is replaced.
        check_not_input("--logits-out", p, &inputs)?;
    }
    if args.draw_boxes.is_some() && args.images.is_empty() {
        bail!("--draw-boxes draws on the first --image; give one");
    }
    if let (Some(b), Some(l)) = (&args.draw_boxes, &args.logits_out) {
        if same_file(b, l) || b == l {
            bail!("--draw-boxes {}: is the --logits-out file too; name another file", b.display());
        }
    }
    let boxes_out = args.draw_boxes.as_deref().map(|p| BoxesOut::create(p, &inputs, args.force)).transpose()?;
    let dev = args.load.model.device()?;
    let dtype = args.load.model.dtype(&dev);
    let dir = vl_models::hub::resolve(&args.load.model.model)?;
    let logits_out = args.logits_out.as_deref().map(LogitsOut::create).transpose()?;
    let limits = args.load.limits.image_limits();
    let gguf = vl_models::gguf::is_gguf(&dir);
    if !gguf && args.load.model.mmproj.is_some() {
        anyhow::bail!("--mmproj goes with a GGUF text model; {} is a checkpoint directory", dir.display());
    }
    let (quant, quant_source) = args.load.model.quant_choice(&dir, dtype)?;
    let opts = EngineOptions {
        model: ModelOptions {
            draft_vocab: args.sampling.speculative.draft_vocab.map(|n| n as usize),
            ..args.load.model_options(dev, dtype, quant, video)
        },
        image_cache_bytes: usize::MAX,
        clip_cache_bytes: 0,
        prefix_cache: false,
        parallel: 1,
        kv_cache_bytes: args.load.limits.kv_cache_bytes()?,
        prefill_chunk: vl_models::engine::DEFAULT_PREFILL_CHUNK,
    };

    // A progress bar on a terminal (never in a pipe, nor with --json): the tensors loaded, then
    // each stage the engine reports (media, the vision tower's blocks, prefill).
    let progress = Progress::new(std::io::stderr().is_terminal() && !args.json);
    // The family opens in stages: every file of the model is checked and the pixel-budget flags
    // against its preprocessor, before a weight is read.
    let source = vl_models::family::Source {
        model: &dir,
        mmproj: args.load.model.mmproj.as_deref(),
        progress: Some(&progress.load),
    };
    let family = vl_models::registry::open_staged(&source, &opts.model).map_err(|e| match e {
        vl_models::Error::Input { ref what, .. }
            if ["min_pixels", "max_pixels", "max_image_tokens"].contains(&what.as_str()) =>
        {
            anyhow::anyhow!(
                "{}",
                e.to_string()
                    .replace("min_pixels", "--min-pixels")
                    .replace("max_pixels", "--max-pixels")
                    .replace("max_image_tokens", "--max-image-tokens")
            )
        }
        e => anyhow::Error::new(e),
    })?;
    progress.tensors_to_load(family.tensors_to_load() as u64);
    crate::note_load_warnings(&dir, &*family);

    // Image files within the byte limit; their headers, video probes and the prompt's length are
    // checked by the engine before a weight is read.
    let mut parts = Vec::with_capacity(args.images.len() + args.videos.len() + 1);
    let mut sizes = Vec::new();
    let order = if order.len() == args.images.len() + args.videos.len() {
        order
    } else {
        [vec![Media::Image; args.images.len()], vec![Media::Video; args.videos.len()]].concat()
    };
    let (mut images, mut videos) = (args.images.iter(), args.videos.iter());
    for kind in order {
        if kind == Media::Video {
            let p = videos.next().expect("counted");
            parts.push(Part::Video {
                source: VideoData::Path(p.clone()),
                name: p.display().to_string(),
                options: Default::default(),
            });
            continue;
        }
        let p = images.next().expect("counted");
        let data =
            vl_models::limits::read_bytes(p, limits.max_file_bytes, LimitKind::ImageBytes).map_err(|e| match e {
                vl_models::Error::Limit { message, kind, .. } => {
                    vl_models::Error::Limit { what: format!("image {}", p.display()), message, kind }
                }
                other => other,
            })?;
        sizes.push(image_size_report(p, &data, &*family, &args.load.media, &limits)?);
        parts.push(Part::Image { data, name: p.display().to_string(), min_pixels: None, max_pixels: None });
    }
    let default_prompt =
        if args.images.is_empty() && !args.videos.is_empty() { "Describe this video." } else { "Describe this image." };
    let prompt = args.prompt.clone().unwrap_or_else(|| default_prompt.into());
    let grounding = match args.grounding {
        Grounding::On => true,
        Grounding::Off => false,
        Grounding::Auto => {
            let schema = match &constraint {
                Some(vl_models::engine::Constraint::JsonSchema(s)) => s.to_string(),
                _ => String::new(),
            };
            boxes_out.is_some()
                || vl_models::grounding::looks_like_grounding(&prompt)
                || vl_models::grounding::looks_like_grounding(&schema)
        }
    };
    let grounding_spec = family.grounding().filter(|_| grounding);
    if boxes_out.is_some() && grounding_spec.is_none() {
        bail!("--draw-boxes: the {} family has no grounding convention (or --grounding off was given)", family.name());
    }
    if let Some(g) = grounding_spec {
        // The grounding minimum, unless --min-pixels says otherwise.
        for p in parts.iter_mut() {
            if let Part::Image { min_pixels: min @ None, .. } = p {
                if args.load.media.min_pixels.is_none() {
                    *min = Some(g.min_pixels);
                }
            }
        }
    }
    let first_image = args.images.first().cloned();
    let first_image_data = boxes_out.as_ref().and_then(|_| {
        parts.iter().find_map(|p| match p {
            Part::Image { data, .. } => Some(data.clone()),
            _ => None,
        })
    });
    parts.push(Part::Text(prompt));
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::text("system", s));
    }
    messages.push(ChatMessage::new("user", parts));
    let template_kwargs = args.reasoning.chat_template_kwargs.clone().unwrap_or_default();
    let req = Request { messages, options, constraint, template_kwargs, ..Default::default() };

    // The draft model loads whole (it is small beside the model), before the model's stages.
    let draft = args.sampling.speculative.open_draft(&args.load.model, &opts.model)?;
    let mut printer = crate::reasoning::Printer::new(&args.reasoning, std::io::stdout().is_terminal());
    let mut stdout = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let mut started = false;
    let before_load = t_start.elapsed();
    let mut on_text = |d: &vl_models::engine::Delta<'_>| {
        if !started {
            started = true;
            progress.finish();
        }
        if args.json {
            return true;
        }
        if let Err(e) = printer.piece(&mut stdout, d.text, d.reasoning) {
            write_err = Some(e);
            return false;
        }
        true
    };
    let result = Engine::answer_once(family, draft, opts, &req, &mut on_text);
    progress.finish();
    let shot = result.map_err(|e| match e {
        vl_models::Error::Limit {
            kind: kind @ (vl_models::limits::LimitKind::Context | vl_models::limits::LimitKind::KvCache),
            message,
            ..
        } => {
            let mut hints = vec![];
            if kind == vl_models::limits::LimitKind::KvCache {
                hints.push("raise the budget with --kv-cache-mib N");
            }
            if !args.images.is_empty() {
                hints.push("lower --max-image-tokens (or --max-pixels)");
            }
            if !args.videos.is_empty() {
                hints.push("lower --video-max-pixels or --video-max-frames");
            }
            if hints.is_empty() {
                anyhow::anyhow!("{message}")
            } else {
                anyhow::anyhow!("{message}; {}", hints.join(", "))
            }
        }
        vl_models::Error::Input { what, message } if what == "response_format" => {
            match (&args.json_schema, &args.grammar, &args.regex) {
                (Some(p), _, _) => anyhow::anyhow!("--json-schema {}: {message}", p.display()),
                (_, Some(p), _) => anyhow::anyhow!("--grammar {}: {message}", p.display()),
                (_, _, Some(_)) => anyhow::anyhow!("--regex: {message}"),
                _ if !args.choice.is_empty() => anyhow::anyhow!("--choice: {message}"),
                _ => anyhow::anyhow!("--json-object: {message}"),
            }
        }
        e @ (vl_models::Error::Input { .. } | vl_models::Error::Limit { .. }) => anyhow::Error::new(e),
        other => anyhow::Error::new(other).context(format!("model {}", dir.display())),
    })?;
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    let c = &shot.completion;
    let applied = quant.filter(|q| shot.storage.iter().any(|(_, s, _)| s == q.name()));
    // What the stats line and --json say the text decoder ran in.
    let off = args.load.model.quantize == Some(QuantArg::Off);
    let quantized = quantized_report(applied, quant, quant_source, off);
    if let Some(q) = quant.filter(|_| quant_source != QuantSource::CpuDefault) {
        if applied.is_none() {
            note!(
                "note: --quantize {} applied to no tensor: every input dimension must be a multiple of {}; the weights stay {}",
                q.name(),
                q.block(),
                vl_nn::linear::dtype_name(dtype)
            );
        }
    }
    if !args.json {
        printer.end_reasoning(&mut stdout).context("writing to stdout")?;
        writeln!(stdout).and_then(|_| stdout.flush()).context("writing to stdout")?;
    }
    if let Some(out) = logits_out {
        out.write(&c.first_logits)?;
    }
    // The answer's shapes in pixels of each image, for --json and --grounding.
    let shapes_json = grounding_spec.map(|g| grounding_report(&c.text, g, &c.images));
    // Sizes as the engine applied them (a grounding minimum may have raised them).
    for (s, r) in sizes.iter_mut().zip(&c.images) {
        s["resized_width"] = r.resized.1.into();
        s["resized_height"] = r.resized.0.into();
        s["tokens"] = r.tokens.into();
    }
    if let (Some(out), Some(data), Some(name), Some(g)) = (boxes_out, &first_image_data, &first_image, grounding_spec) {
        let resized = c.images.first().map_or((0, 0), |i| i.resized);
        let target = out.path.clone();
        match out.write(g, data, name, &limits, &c.text, resized)? {
            0 => note!(
                "--draw-boxes: the answer has no boxes or points; {} is {} unchanged",
                target.display(),
                name.display()
            ),
            n => note!("--draw-boxes: drew {n} shape(s) on {} into {}", name.display(), target.display()),
        }
    }

    let videos: Vec<serde_json::Value> = c
        .videos
        .iter()
        .zip(&shot.checkpoint_videos)
        .map(|(v, full)| video_report(v, *full, &args.load.media))
        .collect();
    let report = Report {
        model: &dir,
        load: &args.load,
        dtype,
        quant,
        quant_source,
        quantized,
        image_files: args.images.len(),
        video_files: args.videos.len(),
        images: sizes,
        videos,
        grounding: shapes_json,
        started: t_start,
        before_load,
    };
    if args.json {
        let out = report.json(&shot);
        writeln!(stdout, "{out}").and_then(|_| stdout.flush()).context("writing to stdout")?;
    } else {
        note!("{}", report.stats_line(&shot));
    }
    Ok(())
}
