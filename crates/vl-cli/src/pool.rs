//! `vl embed` and `vl rerank`: an embedding model's vectors and a reranker's scores from the
//! terminal (the engine's `pool`, the same prompts `/v1/embeddings` and `/v1/rerank` build).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use vl_models::engine::{ChatMessage, Engine, EngineOptions, Part, PoolOutput, Request};
use vl_models::family::Pooled;

use crate::flags::{check_media, LoadArgs};
use crate::note;

/// Most inputs one command embeds or scores (the server's limit).
const MAX_INPUTS: usize = 2048;

#[derive(Debug, Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// A text to embed (repeatable; each is one input, in the order given with the media).
    #[arg(long = "text", value_name = "TEXT")]
    pub texts: Vec<String>,
    /// An image file to embed (repeatable; each is one input).
    #[arg(long = "image", value_name = "FILE")]
    pub images: Vec<PathBuf>,
    /// A video file or a directory of frames to embed (repeatable; each is one input).
    #[arg(long = "video", value_name = "FILE")]
    pub videos: Vec<PathBuf>,
    /// Embed everything given as one input (one vector), as an image with its caption.
    #[arg(long)]
    pub together: bool,
    /// The instruction, the prompt's system message (default: the model's, "Represent the user's
    /// input.").
    #[arg(long)]
    pub instruction: Option<String>,
    /// Keep the first N dimensions, normalised again (Matryoshka truncation).
    #[arg(long)]
    pub dimensions: Option<usize>,
    /// Print one JSON object (OpenAI's embeddings shape) instead of one line per input.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RerankArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// The query's text.
    #[arg(long)]
    pub query: Option<String>,
    /// An image the query holds (repeatable).
    #[arg(long = "query-image", value_name = "FILE")]
    pub query_images: Vec<PathBuf>,
    /// A text document to score against the query (repeatable).
    #[arg(long = "doc", value_name = "TEXT")]
    pub docs: Vec<String>,
    /// An image document to score against the query (repeatable).
    #[arg(long = "doc-image", value_name = "FILE")]
    pub doc_images: Vec<PathBuf>,
    /// The instruction (default: the model's, "Given a search query, retrieve relevant
    /// candidates that answer the query.").
    #[arg(long)]
    pub instruction: Option<String>,
    /// Print only the N best documents.
    #[arg(long)]
    pub top_n: Option<usize>,
    /// Print one JSON object (the `/v1/rerank` shape) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The engine for `load`, with the options `run` and `chat` use.
fn engine(load: &LoadArgs) -> Result<Engine> {
    let dev = load.model.device()?;
    let dtype = load.model.dtype(&dev);
    let dir = vl_models::hub::resolve(&load.model.model)?;
    let video = load.media.video_options()?;
    let quant = load.model.quant_of(&dir, dtype)?;
    let opts = EngineOptions {
        model: load.model_options(dev, dtype, quant, video),
        kv_cache_bytes: load.limits.kv_cache_bytes()?,
        ..Default::default()
    };
    let t = Instant::now();
    let engine =
        Engine::open(&dir, load.model.mmproj.as_deref(), opts).with_context(|| format!("model {}", dir.display()))?;
    note!("loaded {} in {:.1}s", dir.display(), t.elapsed().as_secs_f64());
    crate::note_load_warnings(&dir, engine.family());
    Ok(engine)
}

fn image(path: &PathBuf) -> Result<Part> {
    check_media("image", path)?;
    Ok(Part::image_file(path)?)
}

/// What a model that does not pool, or pools otherwise, is told.
fn refuse_kind(engine: &Engine, want: &str) -> anyhow::Error {
    let is = match engine.pooled() {
        None => "a chat model (use `vl run` or `vl chat`)",
        Some(Pooled::Embedding { .. }) => "an embedding model (use `vl embed`)",
        Some(Pooled::Score) => "a reranker (use `vl rerank`)",
    };
    anyhow::anyhow!("--model: {} is {is}, not {want}", engine.family().name())
}

/// A request of `parts` with the instruction as its system message.
fn request(instruction: Option<&str>, messages: Vec<ChatMessage>) -> Request {
    let mut all = vec![];
    if let Some(i) = instruction {
        all.push(ChatMessage::text("system", i));
    }
    all.extend(messages);
    Request { messages: all, ..Default::default() }
}

pub fn embed(args: EmbedArgs) -> Result<()> {
    // Each input with its label, texts then images then videos.
    let mut inputs: Vec<(String, Part)> = args.texts.iter().map(|t| (t.clone(), Part::text(t.clone()))).collect();
    for p in &args.images {
        inputs.push((p.display().to_string(), image(p)?));
    }
    for p in &args.videos {
        check_media("video", p)?;
        inputs.push((p.display().to_string(), Part::video_file(p.clone())));
    }
    if inputs.is_empty() {
        bail!("nothing to embed: give --text, --image or --video");
    }
    if inputs.len() > MAX_INPUTS {
        bail!("{} inputs: at most {MAX_INPUTS} in one command", inputs.len());
    }
    if args.dimensions == Some(0) {
        bail!("--dimensions 0: must be at least 1");
    }
    let engine = engine(&args.load)?;
    let Some(Pooled::Embedding { dims }) = engine.pooled() else {
        return Err(refuse_kind(&engine, "an embedding model"));
    };
    if let Some(d) = args.dimensions.filter(|&d| d > dims) {
        bail!("--dimensions {d}: the model's embeddings have {dims}");
    }
    let instruction = args.instruction.as_deref();
    let (labels, reqs): (Vec<String>, Vec<Request>) = if args.together {
        let label = inputs.iter().map(|(l, _)| l.as_str()).collect::<Vec<_>>().join(" + ");
        let parts = inputs.into_iter().map(|(_, p)| p).collect();
        (vec![label], vec![request(instruction, vec![ChatMessage::user(parts)])])
    } else {
        inputs.into_iter().map(|(l, p)| (l, request(instruction, vec![ChatMessage::user(vec![p])]))).unzip()
    };
    let t = Instant::now();
    let out = engine.pool(&reqs)?;
    let secs = t.elapsed().as_secs_f64();
    let vectors: Vec<Vec<f32>> = out
        .iter()
        .map(|p| match args.dimensions {
            Some(d) => vl_models::engine::truncated(&p.values, d),
            None => Ok(p.values.clone()),
        })
        .collect::<vl_models::Result<_>>()?;
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let data: Vec<_> = vectors
            .iter()
            .zip(&labels)
            .enumerate()
            .map(|(i, (v, l))| json!({"object": "embedding", "index": i, "input": l, "embedding": v}))
            .collect();
        let tokens: usize = out.iter().map(|p| p.prompt_tokens).sum();
        let body = json!({"object": "list", "data": data, "model": args.load.model.model,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
        writeln!(stdout, "{body}")?;
    } else {
        for v in &vectors {
            let line: Vec<String> = v.iter().map(|x| format!("{x:.6}")).collect();
            writeln!(stdout, "{}", line.join(" "))?;
        }
    }
    stdout.flush()?;
    note!(
        "{} inputs, {} prompt tokens, {:.2} s ({:.1} inputs/s)",
        out.len(),
        tokens(&out),
        secs,
        out.len() as f64 / secs
    );
    note!("{} of the prompt tokens from kept prefixes", cached(&out));
    if vectors.len() > 1 && vectors.len() <= 16 {
        note!("cosine similarities:");
        for (i, a) in vectors.iter().enumerate() {
            let row: Vec<String> =
                vectors.iter().map(|b| format!("{:6.3}", a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>())).collect();
            note!("  [{i}] {}  {}", row.join(" "), labels[i]);
        }
    }
    Ok(())
}

fn tokens(out: &[PoolOutput]) -> usize {
    out.iter().map(|p| p.prompt_tokens).sum()
}

/// Prompt positions served from prefixes the engine kept (shared instructions and queries).
fn cached(out: &[PoolOutput]) -> usize {
    out.iter().map(|p| p.cached_tokens).sum()
}

pub fn rerank(args: RerankArgs) -> Result<()> {
    let mut query: Vec<Part> = vec![];
    for p in &args.query_images {
        query.push(image(p)?);
    }
    query.extend(args.query.iter().map(|q| Part::text(q.clone())));
    if query.is_empty() {
        bail!("no query: give --query (and/or --query-image)");
    }
    let mut docs: Vec<(String, Part)> = args.docs.iter().map(|d| (d.clone(), Part::text(d.clone()))).collect();
    for p in &args.doc_images {
        docs.push((p.display().to_string(), image(p)?));
    }
    if docs.is_empty() {
        bail!("no documents: give --doc or --doc-image");
    }
    if docs.len() > MAX_INPUTS {
        bail!("{} documents: at most {MAX_INPUTS} in one command", docs.len());
    }
    if args.top_n == Some(0) {
        bail!("--top-n 0: must be at least 1");
    }
    let engine = engine(&args.load)?;
    let instruction = args.instruction.as_deref();
    let t = Instant::now();
    let tokens_of;
    let scores: Vec<f32> = match engine.pooled() {
        Some(Pooled::Score) => {
            let reqs: Vec<Request> = docs
                .iter()
                .map(|(_, d)| {
                    request(
                        instruction,
                        vec![ChatMessage::new("query", query.clone()), ChatMessage::new("document", vec![d.clone()])],
                    )
                })
                .collect();
            let out = engine.pool(&reqs)?;
            tokens_of = (tokens(&out), cached(&out));
            out.iter().map(|p| p.values[0]).collect()
        }
        // An embedding model ranks by cosine similarity.
        Some(Pooled::Embedding { .. }) => {
            let mut reqs = vec![request(instruction, vec![ChatMessage::user(query.clone())])];
            reqs.extend(docs.iter().map(|(_, d)| Request::user(vec![d.clone()])));
            let out = engine.pool(&reqs)?;
            tokens_of = (tokens(&out), cached(&out));
            out[1..].iter().map(|d| out[0].values.iter().zip(&d.values).map(|(x, y)| x * y).sum()).collect()
        }
        None => return Err(refuse_kind(&engine, "a reranker or an embedding model")),
    };
    let secs = t.elapsed().as_secs_f64();
    let mut order: Vec<usize> = (0..docs.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(args.top_n.unwrap_or(order.len()));
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let results: Vec<_> = order
            .iter()
            .map(|&i| json!({"index": i, "relevance_score": scores[i], "document": {"text": docs[i].0}}))
            .collect();
        writeln!(stdout, "{}", json!({"model": args.load.model.model, "results": results}))?;
    } else {
        for (rank, &i) in order.iter().enumerate() {
            writeln!(stdout, "{:>3}. {:.4}  [{i}] {}", rank + 1, scores[i], docs[i].0)?;
        }
    }
    stdout.flush()?;
    note!("{} documents scored in {:.2} s", docs.len(), secs);
    note!("{} prompt tokens, {} of them from kept prefixes", tokens_of.0, tokens_of.1);
    Ok(())
}
