//! `vl serve`: flags, the engine loaded once, then `vl_server::serve` (the OpenAI API over it).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use vl_models::engine::{Engine, EngineOptions, ModelOptions};
use vl_models::sampling::GenerationOptions;
use vl_server::ServerConfig;

use crate::flags::LoadArgs;
use crate::note;

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,
    /// Address to bind (loopback by default; 0.0.0.0 exposes the server to the network).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model id clients send and `/v1/models` lists (default: the --model value).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Another name clients may send for the model (repeatable); `/v1/models` lists each.
    #[arg(long = "alias", value_name = "NAME")]
    aliases: Vec<String>,
    /// Refuse (404) a request whose `model` is neither the served name nor an alias. Without it
    /// any name is answered by the one model served, as llama-server and Ollama do.
    #[arg(long)]
    strict_model_name: bool,
    /// Largest request body in bytes (base64 images included).
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Requests waiting beyond the running ones; more are refused with 503 (at most 4096).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(0..=4096))]
    queue: u32,
    /// Sequences decoded together (continuous batching): each decode step multiplies every
    /// running sequence's row at once, so the weights are read once per step for all of them.
    #[arg(long, default_value_t = vl_models::engine::DEFAULT_PARALLEL)]
    parallel: usize,
    /// Local image paths (and file:// URLs) are read only under this directory.
    #[arg(long)]
    allowed_media_dir: Option<PathBuf>,
    /// Fetch http(s) image URLs (off by default: the server would make requests on clients'
    /// behalf). Each fetch is bounded by --max-image-bytes and --remote-media-timeout.
    #[arg(long)]
    allow_remote_media: bool,
    /// Seconds a remote image fetch may take in all.
    #[arg(long, default_value_t = 20)]
    remote_media_timeout: u64,
    /// Vision features kept for repeated images, in MiB (0 = off).
    #[arg(long, default_value_t = 256)]
    image_cache_mib: usize,
    /// Sampled, preprocessed video frames kept for repeated videos, in MiB (0 = off): a video
    /// sent again (same file path, size and modification time, or the same bytes) is not decoded
    /// again.
    #[arg(long, default_value_t = 256)]
    clip_cache_mib: usize,
    /// `/v1/responses` answers kept for `previous_response_id` and `GET /v1/responses/{id}`, in
    /// MiB (least recently used out first; 0 = none kept: `store: true` is refused).
    #[arg(long, default_value_t = 64)]
    responses_store_mib: usize,
    /// Seconds a request's videos may take to probe and decode, all of them together, before it
    /// is refused (0: no limit); long videos in one request would otherwise hold the server.
    #[arg(long, default_value_t = 120.0)]
    video_decode_timeout: f64,
    /// Prefill every prompt in full (by default a request reuses the KV cache of the longest
    /// prefix it shares with an earlier conversation's; many are kept, least recently used out
    /// first, within --kv-cache-mib).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Default sampling when a request sets none: `greedy`, or `model` (generation_config.json's
    /// temperature, top_k, top_p).
    #[arg(long, default_value = "greedy")]
    sampling: String,
    /// Default reasoning budget when a request sets none (`reasoning_budget`, `reasoning_effort`,
    /// Anthropic's `thinking`): tokens a thinking model's reasoning block may take before the
    /// server closes it and the answer follows; 0 closes it at once. Unbounded when not given.
    #[arg(long, value_name = "N")]
    reasoning_budget: Option<usize>,
    #[command(flatten)]
    speculative: crate::flags::SpeculativeArgs,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (401 otherwise). Also
    /// read from the VL_API_KEY environment variable. Visible ASCII only (what a header carries).
    #[arg(long, env = "VL_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Origins a browser page may call the API from (comma-separated, each `*` or
    /// scheme://host[:port]; blanks around an entry are dropped): preflight requests are answered
    /// and responses carry Access-Control-Allow-Origin. None by default.
    #[arg(long, value_delimiter = ',')]
    cors_origins: Vec<String>,
    /// Do not serve the web chat at `/` (the API only).
    #[arg(long)]
    no_ui: bool,
    /// Open connections at most (default: 1024, or the open-file limit less 128 when that is
    /// lower); one more is answered 503 and closed.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Seconds a client has to send a request's headers; also how long an idle keep-alive
    /// connection stays open.
    #[arg(long, default_value_t = 15.0)]
    header_timeout: f64,
    /// Seconds a client has to send a request's body once its headers are in (408 after).
    #[arg(long, default_value_t = 60.0)]
    body_timeout: f64,
    /// Seconds the server waits, after SIGINT or SIGTERM, for the requests in flight before it
    /// exits anyway.
    #[arg(long, default_value_t = 60.0)]
    shutdown_timeout: f64,
    /// Seconds a streamed answer waits for a client that stopped reading before it is cancelled
    /// and its slot freed (its sequences pause meanwhile; memory stays bounded).
    #[arg(long, default_value_t = 30.0)]
    stall_timeout: f64,
}

/// `--NAME S` as a duration: a number of seconds above 0, at most a day.
fn seconds(name: &str, s: f64) -> Result<Duration> {
    if !(s.is_finite() && s > 0.0 && s <= 86_400.0) {
        anyhow::bail!("--{name} {s}: must be a number of seconds above 0 and at most 86400");
    }
    Ok(Duration::from_secs_f64(s))
}

/// The connection bounds from the flags, checked against the open-file limit.
fn connection_limits(args: &ServeArgs) -> Result<vl_server::ConnectionLimits> {
    let max_connections = match args.max_connections {
        None => vl_server::default_max_connections(),
        Some(n) => {
            let room = vl_server::descriptor_limit().map(|l| l.saturating_sub(vl_server::RESERVED_DESCRIPTORS));
            if n == 0 || room.is_some_and(|r| n as u64 > r) {
                anyhow::bail!(
                    "--max-connections {n}: must be in 1..={} (the open-file limit, ulimit -n, less {} kept for files)",
                    room.unwrap_or(u64::MAX),
                    vl_server::RESERVED_DESCRIPTORS
                );
            }
            n
        }
    };
    Ok(vl_server::ConnectionLimits {
        max_connections,
        header_timeout: seconds("header-timeout", args.header_timeout)?,
        body_timeout: seconds("body-timeout", args.body_timeout)?,
        shutdown_timeout: seconds("shutdown-timeout", args.shutdown_timeout)?,
        stall_timeout: seconds("stall-timeout", args.stall_timeout)?,
    })
}

/// Most sequences `--parallel` may ask to decode together.
const MAX_PARALLEL: usize = 64;

pub fn serve(args: ServeArgs) -> Result<()> {
    let t = args.video_decode_timeout;
    if !(t.is_finite() && t >= 0.0) {
        anyhow::bail!("--video-decode-timeout {t}: must be a number of seconds >= 0 (0: no limit)");
    }
    if args.parallel == 0 || args.parallel > MAX_PARALLEL {
        anyhow::bail!("--parallel {}: must be in 1..={MAX_PARALLEL}", args.parallel);
    }
    let kv_cache_bytes = args.load.limits.kv_cache_bytes()?;
    if let Some(key) = &args.api_key {
        vl_server::check_api_key(key).map_err(|e| anyhow::anyhow!("--api-key (or VL_API_KEY): {e}"))?;
    }
    let cors_origins =
        vl_server::cors_origins(&args.cors_origins).map_err(|e| anyhow::anyhow!("--cors-origins: {e}"))?;
    if let Some(a) = args.aliases.iter().find(|a| a.is_empty() || a.len() > 256 || a.chars().any(char::is_control)) {
        anyhow::bail!("--alias {a:?}: a model name is 1-256 characters without control characters");
    }
    let connections = connection_limits(&args)?;
    let dev = args.load.model.device()?;
    let dtype = args.load.model.dtype(&dev);
    let dir = vl_models::hub::resolve(&args.load.model.model)?;
    let mut defaults = match args.sampling.as_str() {
        "greedy" => GenerationOptions::default(),
        "model" => model_sampling(&dir)?,
        other => anyhow::bail!("--sampling {other}: expected `greedy` or `model`"),
    };
    defaults.reasoning_budget = args.reasoning_budget;
    args.speculative.apply(&mut defaults)?;
    let allowed_media_dir = args
        .allowed_media_dir
        .as_ref()
        .map(|d| vl_server::MediaDir::new(d).with_context(|| format!("--allowed-media-dir {}", d.display())))
        .transpose()?;
    // Bind first: a taken port fails before minutes of loading.
    let addr = format!("{}:{}", args.host, args.port);
    let listener = std::net::TcpListener::bind(&addr).with_context(|| format!("binding {addr}"))?;

    let video = args.load.media.video_options()?;
    let quant = args.load.model.quant_of(&dir, dtype)?;
    let opts = EngineOptions {
        model: ModelOptions {
            video_limits: vl_models::video::VideoLimits {
                max_decode_time: (args.video_decode_timeout > 0.0)
                    .then(|| Duration::from_secs_f64(args.video_decode_timeout.min(86_400.0))),
                confined: true,
                ..Default::default()
            },
            draft_vocab: args.speculative.draft_vocab.map(|n| n as usize),
            ..args.load.model_options(dev, dtype, quant, video)
        },
        image_cache_bytes: args.image_cache_mib << 20,
        clip_cache_bytes: args.clip_cache_mib.saturating_mul(1 << 20),
        prefix_cache: !args.no_prefix_cache,
        parallel: args.parallel,
        kv_cache_bytes,
        prefill_chunk: vl_models::engine::DEFAULT_PREFILL_CHUNK,
    };
    let id = args.served_model_name.clone().unwrap_or_else(|| args.load.model.model.clone());
    let t = Instant::now();
    let draft = args.speculative.open_draft(&args.load.model, &opts.model)?;
    let engine = Arc::new(
        Engine::open_with_draft(&dir, args.load.model.mmproj.as_deref(), draft, opts)
            .with_context(|| format!("model {}", dir.display()))?,
    );
    if defaults.speculative.method == vl_models::speculative::Method::Mtp && !engine.has_draft_head() {
        anyhow::bail!(
            "--speculative mtp: {} has no multi-token-prediction head (Qwen3.5 checkpoints carry one as mtp.*)",
            dir.display()
        );
    }
    let mut precision =
        if args.load.model.vision_bf16() { ", vision products in bf16".to_string() } else { String::new() };
    if let Some(kv) = args.load.model.kv_dtype().filter(|&d| d != dtype) {
        precision += &format!(", KV cache in {}", format!("{kv:?}").to_lowercase());
    }
    note!("loaded {} in {:.1}s{precision}", dir.display(), t.elapsed().as_secs_f64());
    crate::note_load_warnings(&dir, engine.family());
    let config = ServerConfig {
        id,
        defaults,
        allowed_media_dir,
        remote_media: args.allow_remote_media.then(|| Duration::from_secs(args.remote_media_timeout.max(1))),
        max_image_bytes: args.load.limits.max_image_bytes,
        max_body_bytes: args.max_body_bytes,
        queue: args.queue as usize,
        api_key: args.api_key.clone(),
        cors_origins,
        ui: !args.no_ui,
        connections,
        aliases: args.aliases.clone(),
        strict_model_name: args.strict_model_name,
        responses_store_bytes: args.responses_store_mib.saturating_mul(1 << 20),
    };
    vl_server::serve(engine, listener, config)?;
    Ok(())
}

/// generation_config.json's suggested sampling values, for `--sampling model`.
fn model_sampling(dir: &std::path::Path) -> Result<GenerationOptions> {
    let config = vl_models::formats::generation_config::GenerationConfig::from_dir(dir, &[])?;
    config.sampling().with_context(|| format!("{}", dir.join("generation_config.json").display()))
}
