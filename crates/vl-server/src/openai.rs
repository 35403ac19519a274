//! OpenAI's chat completions request, typed. Every top-level field is declared: a field this
//! server implements is used, one it accepts but cannot honour in a way that changes the answer
//! (`user`, `metadata`, `store`, `parallel_tool_calls`, `service_tier`, `prompt_cache_key`,
//! `prompt_cache_retention`, `safety_identifier`, `verbosity: medium`, `modalities: ["text"]`,
//! `prediction`) is read, type-checked and
//! ignored (listed in docs/serving.md), one it does not implement (`modalities`, `audio`, ...) is
//! refused by `check_supported`, and an unknown field is refused by serde with its name. Message
//! parts are JSON values walked by `media::part` under the same rule.

use serde::Deserialize;
use serde_json::Value;

/// llama-server's samplers, named as it names them: chat completions and `/v1/responses` take
/// them, and the engine's errors about them name them.
pub(crate) const LLAMA_SAMPLERS: [&str; 11] = [
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
];

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM's convention: -1 disables.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// llama-server's samplers: top-n-sigma and XTC (`GenerationOptions` has their ranges).
    pub top_n_sigma: Option<f64>,
    pub xtc_probability: Option<f64>,
    pub xtc_threshold: Option<f64>,
    /// llama-server's DRY sampler (`GenerationOptions` has the ranges).
    pub dry_multiplier: Option<f64>,
    pub dry_base: Option<f64>,
    pub dry_allowed_length: Option<u64>,
    pub dry_penalty_last_n: Option<i64>,
    pub dry_sequence_breakers: Option<Vec<String>>,
    /// llama-server's mirostat (0 off, 1, 2) with its target surprise and learning rate.
    pub mirostat: Option<u64>,
    pub mirostat_tau: Option<f64>,
    pub mirostat_eta: Option<f64>,
    /// Any 64-bit integer, signed or not.
    pub seed: Option<Seed>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// Checked in `request::response_format`.
    pub response_format: Option<Value>,
    /// The other ways peers' clients constrain the answer, each checked in
    /// `request::format_constraint` (at most one of them, or `response_format`, per request):
    /// vLLM's `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`;
    pub structured_outputs: Option<Value>,
    /// llama-server's GBNF grammar (or llguidance's Lark, after `%llguidance`) and JSON schema;
    pub grammar: Option<Value>,
    pub json_schema: Option<Value>,
    /// SGLang's regular expression and EBNF (GBNF) grammar.
    pub regex: Option<Value>,
    pub ebnf: Option<Value>,
    /// Checked in `request::logit_bias`.
    pub logit_bias: Option<Value>,
    /// Checked in `request::parse`.
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
    /// Ours: whether the request asks for boxes or points (its images are then sized to at
    /// least the family's grounding minimum). Absent: guessed from the user's text and the
    /// response format (`vl_models::grounding::looks_like_grounding`).
    pub grounding: Option<bool>,
    /// Extra variables for the chat template (vLLM's and llama-server's field), e.g.
    /// `{"enable_thinking": false}`; checked in `request::template_kwargs`.
    pub chat_template_kwargs: Option<Value>,
    /// A thinking model's reasoning budget: OpenAI's effort levels (`request::reasoning_budget`
    /// maps them to tokens), or ours in tokens (what Anthropic's `thinking.budget_tokens`
    /// becomes).
    pub reasoning_effort: Option<String>,
    pub reasoning_budget: Option<u64>,
    /// Ours: speculative decoding for this request, `"ngram"` / `"draft"` (a server started with
    /// `--draft-model`) / `"off"` or `{"method": "ngram", "draft_max": N, "ngram_min": N,
    /// "ngram_max": N}` (the server's `--speculative` flags are the defaults); checked in
    /// `request::speculative`.
    pub speculative: Option<Value>,
    /// Ours: a constraint's forced tokens written without sampling (default true;
    /// `--no-forced-tokens` sets the server's default to false).
    pub forced_tokens: Option<bool>,
    /// vLLM's and SGLang's: the answer goes on past end-of-sequence tokens (benchmarks).
    pub ignore_eos: Option<bool>,
    /// vLLM's `include_stop_str_in_output` and SGLang's `no_stop_trim`: the stop string that
    /// ended the answer stays at its end.
    pub include_stop_str_in_output: Option<bool>,
    pub no_stop_trim: Option<bool>,
    /// vLLM's and SGLang's decoding switches, which their routers (vllm-router, sglang-router)
    /// write into every request they forward: accepted at the value that is this server's
    /// behaviour, refused at any other by `check_supported`.
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: how special tokens are joined when written, which they never are here
    /// (`skip_special_tokens: true`): either value gives the same answer, so both are accepted.
    pub spaces_between_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub separate_reasoning: Option<bool>,
    pub stream_reasoning: Option<bool>,
    pub include_reasoning: Option<bool>,
    pub return_hidden_states: Option<bool>,
    // Not implemented: refused by `check_supported` when they ask for anything.
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
    pub prediction: Option<Value>,
    pub web_search_options: Option<Value>,
    // Accepted and ignored: they cannot change the answer. Typed as OpenAI types them, so a
    // wrong type is a 400 naming the field.
    pub user: Option<String>,
    /// String keys to string values.
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
    /// OpenAI keeps a stored completion for its dashboard; this server keeps nothing, which
    /// changes no answer.
    pub store: Option<bool>,
    pub parallel_tool_calls: Option<bool>,
    pub service_tier: Option<String>,
    /// A routing and caching hint (the prefix cache reuses prompts by their tokens anyway).
    pub prompt_cache_key: Option<String>,
    /// How long OpenAI keeps a cached prefix (`in_memory`, `24h`); the prefix cache here keeps
    /// what fits its budget, least recently used out first.
    pub prompt_cache_retention: Option<String>,
    /// An end user's stable id for abuse monitoring.
    pub safety_identifier: Option<String>,
    /// OpenAI's length hint: only `medium` (the default, no change) is accepted; `low` / `high`
    /// would change the answer and are refused in `check_supported`.
    pub verbosity: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// Accepted and ignored (usage is sent once, at the end).
    pub include_obfuscation: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Seed {
    Signed(i64),
    Unsigned(u64),
}

impl Seed {
    /// The generator's seed (a negative seed wraps, as a two's-complement u64).
    pub fn value(&self) -> u64 {
        match *self {
            Seed::Signed(s) => s as u64,
            Seed::Unsigned(u) => u,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// One message. The fields an OpenAI client echoes back from a response (`refusal`,
/// `annotations`, `audio`, `function_call`) are accepted when empty.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool answer's call id (the template orders answers as the calls were made).
    pub tool_call_id: Option<String>,
    /// A participant's name: accepted and ignored (the chat template has no place for it).
    pub name: Option<String>,
    /// An assistant turn's reasoning as this server answered it, sent back: given to the
    /// template (thinking templates show the latest turn's again).
    pub reasoning_content: Option<String>,
    pub refusal: Option<Value>,
    pub annotations: Option<Value>,
    pub audio: Option<Value>,
    pub function_call: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

/// An assistant message's call, `{"id", "type": "function", "function": {"name", "arguments"}}`
/// (`id` and `type` accepted and ignored: the template renders calls by name).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallIn {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: Option<FunctionIn>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionIn {
    pub name: Option<String>,
    /// JSON text, or an object.
    pub arguments: Option<Value>,
}

impl ChatCompletionRequest {
    /// The first field asked of this server that it does not implement, as a message naming it.
    pub fn check_supported(&self) -> Option<String> {
        let present = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        for (name, v) in [("functions", &self.functions), ("function_call", &self.function_call)] {
            if present(v) {
                return Some(format!(
                    "`{name}` (deprecated, as `functions` / `function_call`) is not supported: use `tools`"
                ));
            }
        }
        // Text is the one output modality: `["text"]` asks for what is given.
        if let Some(m) = self.modalities.as_ref().filter(|v| !v.is_null()) {
            let Some(a) = m.as_array().filter(|a| !a.is_empty() && a.iter().all(Value::is_string)) else {
                return Some(format!("`modalities` = {m} must be a list of output modalities: [\"text\"]"));
            };
            if let Some(other) = a.iter().find(|x| *x != "text") {
                return Some(format!(
                    "`modalities`: {other} is not supported: this server answers in text only ([\"text\"])"
                ));
            }
        }
        // A predicted output speeds up an answer, never changes it: accepted when well formed.
        if let Some(p) = self.prediction.as_ref().filter(|v| !v.is_null()) {
            let ok = p.get("type").and_then(Value::as_str) == Some("content")
                && p.get("content").is_some_and(|c| c.is_string() || c.is_array())
                && p.as_object().is_some_and(|o| o.keys().all(|k| k == "type" || k == "content"));
            if !ok {
                return Some("`prediction` must be {\"type\": \"content\", \"content\": text or parts}".into());
            }
        }
        if let Some(v) = self.verbosity.as_deref().filter(|v| *v != "medium") {
            return Some(format!("`verbosity` = {v:?} is not supported: only \"medium\" (the default) is"));
        }
        // The peers' decoding switches accepted at one value only: what this server does.
        for (name, sent, only, why) in [
            (
                "skip_special_tokens",
                self.skip_special_tokens,
                true,
                "special tokens are never written into the answer's text",
            ),
            (
                "add_generation_prompt",
                self.add_generation_prompt,
                true,
                "the assistant's turn is always opened after the messages",
            ),
            ("continue_final_message", self.continue_final_message, false, "the answer is always a new assistant turn"),
            (
                "separate_reasoning",
                self.separate_reasoning,
                true,
                "a reasoning block is always answered apart (`reasoning_content`)",
            ),
            ("stream_reasoning", self.stream_reasoning, true, "a reasoning block is always streamed as it is written"),
            (
                "include_reasoning",
                self.include_reasoning,
                true,
                "a reasoning block is always answered (`reasoning_content`)",
            ),
            (
                "return_hidden_states",
                self.return_hidden_states,
                false,
                "hidden states are not returned (use /v1/embeddings)",
            ),
        ] {
            if sent.is_some_and(|b| b != only) {
                return Some(format!("`{name}` = {} is not supported: only {only} is ({why})", !only));
            }
        }
        for (name, v) in [("audio", &self.audio), ("web_search_options", &self.web_search_options)] {
            if present(v) {
                return Some(format!("`{name}` is not supported by this server"));
            }
        }
        None
    }
}
