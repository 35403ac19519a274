//! What the engine checks of a request before it costs anything, whatever the family: the
//! options, the text's size against the context, the constraint compiled with its first mask,
//! the prompt's KV against the budget, and that the model generates at all.

use std::sync::Arc;

use crate::constraint::{Compiler, Constraint, Guide};
use crate::error::{Error, Result};
use crate::family::{Family, Generator, Pooled, Prepared, Task};
use crate::limits::LimitKind;
use crate::request::{Part, Request};

/// Checks what is the engine's to check of a request, whatever the family: the sampling options'
/// ranges, that there is something to answer, the stop strings.
pub(super) fn check_request(req: &Request) -> Result<()> {
    req.options.validate()?;
    if req.prompt.is_none() && req.messages.is_empty() {
        return Err(Error::Input { what: "messages".into(), message: "no messages".into() });
    }
    if let Some(s) = req.stop.iter().find(|s| s.is_empty()) {
        return Err(Error::Input { what: "stop".into(), message: format!("{s:?}: stop strings must not be empty") });
    }
    Ok(())
}

/// Bytes a token stands for on average in ordinary text is about 4; past this many per position
/// of the context, a request's text is measured against the vocabulary's longest token.
const TEXT_BYTES_PER_TOKEN_CHECK: usize = 8;

/// Each token's text, as one id decodes (special tokens included), by id: read once per engine
/// where needed (the longest token, DRY's breakers).
pub(super) fn token_texts(family: &dyn Family) -> Vec<String> {
    let tok = family.tokenizer();
    (0..tok.get_vocab_size(true) as u32).map(|id| tok.decode(&[id], false).unwrap_or_default()).collect()
}

/// Refuses a request whose text (messages and tools) could not fit the context even if every
/// token were the vocabulary's longest, before it is tokenized (a 57 MB message would otherwise
/// be tokenized first). `texts`: the tokens' texts, read at the first long request.
pub(super) fn check_text_fits(
    family: &dyn Family,
    texts: &std::sync::OnceLock<Vec<String>>,
    req: &Request,
) -> Result<()> {
    let text: usize = req
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| match p {
            Part::Text(t) => t.len(),
            _ => 0,
        })
        .sum::<usize>()
        + req.tools.iter().map(|t| t.to_string().len()).sum::<usize>()
        + req.prompt.as_ref().map_or(0, String::len);
    let context = family.context();
    if text <= context.saturating_mul(TEXT_BYTES_PER_TOKEN_CHECK) {
        return Ok(());
    }
    let longest = texts.get_or_init(|| token_texts(family)).iter().map(String::len).max().unwrap_or(1).max(1);
    let most = context.saturating_mul(longest);
    if text > most {
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!(
                "the request's text is {text} bytes: even at {longest} bytes a token (the vocabulary's longest) it cannot fit the model's context of {context} tokens"
            ),
            kind: LimitKind::Context,
        });
    }
    Ok(())
}

pub(super) type CompilerCell = std::sync::OnceLock<std::result::Result<Arc<Compiler>, String>>;

/// `req`'s constraint compiled for `family`, one guide per answer (`n`; all None without a
/// constraint), each holding its first token mask; the error names the field (`tool_choice` for
/// tool calls, `response_format` otherwise). The compiler is in `cell` (built once).
pub(super) fn guides(
    family: &dyn Family,
    generator: &dyn Generator,
    cell: &CompilerCell,
    req: &Request,
    n: usize,
) -> Result<Vec<Option<Guide>>> {
    let Some(c) = &req.constraint else { return Ok((0..n).map(|_| None).collect()) };
    let compiler = cell
        .get_or_init(|| {
            Compiler::new(family.tokenizer(), family.vocab_size(), generator.eos_token_ids())
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|message| Error::Input { what: "constrained decoding".into(), message })?;
    let what = match c {
        Constraint::ToolCalls { .. } => "tool_choice",
        _ => "response_format",
    };
    Ok(compiler.guides(c, what, n, family.tool_call_format())?.into_iter().map(Some).collect())
}

/// Refuses a prompt whose KV cache alone exceeds `budget` bytes (it could never run).
pub(super) fn check_fits(family: &dyn Generator, budget: usize, p: &Prepared) -> Result<()> {
    let need =
        vl_nn::kv_cache::blocks_for(p.ids.len() + 1) * family.kv_bytes_per_position() + family.fixed_state_bytes();
    if need > budget {
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!(
                "the prompt's {} tokens need {:.1} MiB of KV cache, more than the engine's budget of {:.1} MiB",
                p.ids.len(),
                need as f64 / 1048576.0,
                budget as f64 / 1048576.0
            ),
            kind: LimitKind::KvCache,
        });
    }
    Ok(())
}

/// The family's generator, or an error saying that the model pools.
pub(super) fn generator(family: &dyn Family) -> Result<&dyn Generator> {
    match family.task() {
        Task::Generate(g) => Ok(g),
        Task::Pool(p) => Err(Error::Input {
            what: "model".into(),
            message: format!(
                "{} is {} model: it pools prompts (Engine::pool) and does not generate text",
                family.name(),
                match p.pooled() {
                    Pooled::Embedding { .. } => "an embedding",
                    Pooled::Score => "a reranker",
                }
            ),
        }),
    }
}
