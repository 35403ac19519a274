//! Prometheus metrics (`/metrics`): requests by status, tokens, cache hits, the engine's
//! running and waiting sequences and KV memory, time to first token.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use vl_models::engine::Engine;

/// The label of `requests_total`: the answer's HTTP status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StatusLabel {
    status: String,
}

pub(crate) struct Metrics {
    pub(crate) registry: Registry,
    pub(crate) requests: Family<StatusLabel, Counter>,
    pub(crate) prompt_tokens: Counter,
    pub(crate) cached_tokens: Counter,
    pub(crate) completion_tokens: Counter,
    pub(crate) image_cache_hits: Counter,
    pub(crate) video_cache_hits: Counter,
    pub(crate) queue_depth: Gauge,
    pub(crate) running: Gauge,
    pub(crate) ttft: Histogram,
    pub(crate) queue_wait: Histogram,
    pub(crate) kv_cache_bytes: Gauge,
    pub(crate) kv_budget_bytes: Gauge,
    pub(crate) sequences_running: Gauge,
    pub(crate) sequences_waiting: Gauge,
    pub(crate) decode_steps: Gauge,
    pub(crate) decode_rows: Gauge,
    pub(crate) preemptions: Gauge,
    pub(crate) kept_prefixes: Gauge,
    pub(crate) draft_tokens: Gauge,
    pub(crate) accepted_draft_tokens: Gauge,
    pub(crate) forced_tokens: Gauge,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let buckets = || Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]);
        let m = Self {
            registry: Registry::with_prefix("vl"),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            image_cache_hits: Counter::default(),
            video_cache_hits: Counter::default(),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            ttft: buckets(),
            queue_wait: buckets(),
            kv_cache_bytes: Gauge::default(),
            kv_budget_bytes: Gauge::default(),
            sequences_running: Gauge::default(),
            sequences_waiting: Gauge::default(),
            decode_steps: Gauge::default(),
            decode_rows: Gauge::default(),
            preemptions: Gauge::default(),
            kept_prefixes: Gauge::default(),
            draft_tokens: Gauge::default(),
            accepted_draft_tokens: Gauge::default(),
            forced_tokens: Gauge::default(),
        };
        let mut m = m;
        let r = &mut m.registry;
        r.register("requests", "Chat completion requests by HTTP status", m.requests.clone());
        r.register("prompt_tokens", "Prompt tokens of answered requests", m.prompt_tokens.clone());
        r.register("cached_prompt_tokens", "Prompt tokens served from the prefix cache", m.cached_tokens.clone());
        r.register("completion_tokens", "Generated tokens", m.completion_tokens.clone());
        r.register("image_cache_hits", "Images whose features came from the feature cache", m.image_cache_hits.clone());
        r.register("video_cache_hits", "Videos whose features came from the feature cache", m.video_cache_hits.clone());
        r.register("queue_depth", "Requests waiting for the engine", m.queue_depth.clone());
        r.register("requests_running", "Requests being generated", m.running.clone());
        r.register("time_to_first_token_seconds", "Time from queueing to the first token", m.ttft.clone());
        r.register("queue_wait_seconds", "Time a request waited in the queue", m.queue_wait.clone());
        r.register(
            "kv_cache_bytes",
            "KV cache bytes held (running sequences and kept prefixes)",
            m.kv_cache_bytes.clone(),
        );
        r.register("kv_cache_budget_bytes", "The engine's KV cache budget", m.kv_budget_bytes.clone());
        r.register("sequences_running", "Sequences being prefilled or decoded", m.sequences_running.clone());
        r.register("sequences_waiting", "Sequences waiting for a slot or KV memory", m.sequences_waiting.clone());
        r.register("decode_steps", "Batched decode steps run", m.decode_steps.clone());
        r.register(
            "decode_rows",
            "Sequence rows decoded (decode_rows / decode_steps = mean batch)",
            m.decode_rows.clone(),
        );
        r.register("preemptions", "Sequences preempted for KV memory", m.preemptions.clone());
        r.register("kept_prefixes", "Finished conversations' caches kept for prefix reuse", m.kept_prefixes.clone());
        r.register("draft_tokens", "Tokens drafted for verification (speculative)", m.draft_tokens.clone());
        r.register("accepted_draft_tokens", "Drafted tokens the verification kept", m.accepted_draft_tokens.clone());
        r.register("forced_tokens", "Tokens a constraint forced, written without sampling", m.forced_tokens.clone());
        m
    }

    /// An answer with `status` counted.
    pub(crate) fn count(&self, status: StatusCode) {
        self.requests.get_or_create(&StatusLabel { status: status.as_u16().to_string() }).inc();
    }

    /// The `/metrics` answer: every metric, `engine`'s figures read now, in Prometheus' text
    /// format.
    pub(crate) fn render(&self, engine: &Engine) -> Response {
        let st = engine.stats();
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set(&self.kv_cache_bytes, st.kv_cache_bytes as u64);
        set(&self.kv_budget_bytes, st.kv_budget_bytes as u64);
        set(&self.sequences_running, st.running as u64);
        set(&self.sequences_waiting, st.waiting as u64);
        set(&self.decode_steps, st.decode_steps);
        set(&self.decode_rows, st.decode_rows);
        set(&self.preemptions, st.preemptions);
        set(&self.kept_prefixes, st.cached_prefixes as u64);
        set(&self.draft_tokens, st.draft_tokens);
        set(&self.accepted_draft_tokens, st.accepted_draft_tokens);
        set(&self.forced_tokens, st.forced_tokens);
        let mut text = String::new();
        if encode(&mut text, &self.registry).is_err() {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
        ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
    }
}
