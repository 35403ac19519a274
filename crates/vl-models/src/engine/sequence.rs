//! One sequence of the scheduler: a request's prompt and answer as they are decoded (its state,
//! token picker, streaming, stop strings, tool-call hold, reasoning split, constraint), and
//! what the scheduler and the caller exchange about it (`Job`, `Fork`, `Event`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::stop::StopFilter;
use super::{Completion, Encoded, Finish};
use crate::constraint::{Guide, MaskTask};
use crate::error::Result;
use crate::family::{Family, Identity, Prepared};
use crate::reasoning::Split;
use crate::request::StepReport;
use crate::sampling::{TokenLogprob, TokenPicker};
use crate::state::{Checkpoint, SeqState};
use crate::stream::StreamDecoder;
use crate::tool_calls::{split_tool_calls, CallHold};

/// Pieces a request's caller may leave unread before its sequences are paused.
pub(crate) const MAX_UNREAD: usize = 16;

/// What a caller hands the scheduler thread.
pub(crate) enum Command {
    Submit(Box<Job>),
    Pool(Box<PoolJob>),
}

/// Prompts to pool (a pooling model's request), each prepared and its media encoded; the rows
/// go back on `reply` in order.
pub(crate) struct PoolJob {
    pub inputs: Vec<(Prepared, Encoded)>,
    pub reply: mpsc::Sender<Result<Vec<super::PoolOutput>>>,
}

/// One `Done` per request, after its texts: its size is no concern.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Event {
    /// A piece of choice `choice`'s answer (of its reasoning block when `reasoning`), with the
    /// log-probabilities of the tokens picked since the last piece (when asked for).
    Text {
        choice: usize,
        text: String,
        reasoning: bool,
        logprobs: Vec<TokenLogprob>,
    },
    Done(usize, Result<Completion>),
}

/// Another choice of the same request (`n` > 1): it shares the first choice's prefill (a copy of
/// its cache) and samples with its own seed and constraint.
pub(crate) struct Fork {
    pub choice: usize,
    pub seed: u64,
    pub guide: Option<Guide>,
}

/// A request as the caller hands it over: prepared, its media encoded.
pub(crate) struct Job {
    pub prepared: Prepared,
    pub encoded: Encoded,
    /// The answer's constraint, compiled.
    pub guide: Option<Guide>,
    /// DRY's sequence breakers as tokens, when the request turns DRY on.
    pub dry: Option<Arc<crate::decoding::dry::Breakers>>,
    /// Which choice of its request this is (events carry it).
    pub choice: usize,
    /// The request's other choices, started from this one's prefill.
    pub forks: Vec<Fork>,
    pub stop: Vec<String>,
    /// The stop string that ended the answer is kept (`Request::include_stop`).
    pub include_stop: bool,
    /// The request's tool definitions (OpenAI's shape); empty without tools.
    pub tools: Vec<serde_json::Value>,
    /// The answer's reasoning block is split off (`Family::reasoning`).
    pub reasoning: bool,
    pub events: mpsc::Sender<Event>,
    /// Pieces sent and not yet taken by the caller (its choices together).
    pub unread: Arc<AtomicUsize>,
    pub cancel: Arc<AtomicBool>,
    /// When the caller began (time to first token counts from here).
    pub t0: Instant,
}

#[derive(PartialEq, Eq)]
pub(super) enum Phase {
    /// Not admitted (or preempted): no cache.
    Waiting,
    /// Prompt positions being prefilled; `resume` after a preemption (the next token is known).
    Prefill {
        resume: bool,
    },
    Decode,
}

pub(super) struct Seq<'f> {
    pub(super) job: Box<Job>,
    /// The prompt's tokens, then every generated token fed to the cache.
    pub(super) ids: Vec<u32>,
    pub(super) ident: Vec<Identity>,
    pub(super) prompt_len: usize,
    pub(super) state: SeqState,
    pub(super) phase: Phase,
    pub(super) picker: TokenPicker,
    /// Picked, not yet fed.
    pub(super) pending: Option<u32>,
    /// The constraint's next mask, being computed beside the forward pass (the guide is with
    /// it meanwhile).
    pub(super) mask_task: Option<MaskTask>,
    /// Logits of its next position, waiting for that mask.
    pub(super) held: Option<Vec<f32>>,
    pub(super) stream: StreamDecoder<'f>,
    pub(super) out: StopFilter,
    /// Each picked token's log-probabilities (with `logprobs` on), and how many were sent.
    pub(super) logprobs: Vec<TokenLogprob>,
    pub(super) sent_logprobs: usize,
    pub(super) hold: Option<CallHold>,
    /// The reasoning block split from the answer's text, when the family has markers.
    pub(super) split: Option<Split>,
    /// The closing marker's id while the answer is inside a reasoning block the prompt opened:
    /// the request's constraint applies from the token after it.
    pub(super) thinking_until: Option<u32>,
    /// What closes the reasoning block once `reasoning_budget` is spent (a newline and the
    /// closing marker); empty without a budget, or once queued.
    pub(super) close_block: Vec<u32>,
    /// Tokens the engine writes next for the model, whatever its logits: the close above, or
    /// the tokens a constraint forces (already consumed by its guide).
    pub(super) forced: VecDeque<u32>,
    /// Drafted (or forced) tokens fed in the last forward pass, each with the logits after it,
    /// kept while the picked tokens equal them (`go_on`).
    pub(super) verified: VecDeque<Verified>,
    /// The state before drafted tokens were fed, when it has recurrent layers (which cannot be
    /// cut back to any position).
    pub(super) checkpoint: Option<Checkpoint>,
    /// The draft model's side, while admitted, when the request drafts with one.
    pub(super) draft: Option<super::draft::DraftSeq>,
    /// The model's draft head's side, while admitted, when the request drafts with it.
    pub(super) head: Option<super::head::HeadSeq>,
    pub(super) steps: StepReport,
    /// Tokens it may generate: max_new_tokens within the context.
    pub(super) budget: usize,
    pub(super) cached_tokens: usize,
    pub(super) prefill_time: Duration,
    pub(super) first_logits: Vec<f32>,
    pub(super) ttft: Option<Duration>,
    pub(super) decode_started: Option<Instant>,
    pub(super) admitted: u64,
    /// Bytes its prompt's state was admitted with: counted until the state holds them (it
    /// allocates at its first prefill), so that two admitted together cannot both count 0.
    pub(super) reserved: usize,
}

impl<'f> Seq<'f> {
    pub(super) fn new(job: Box<Job>, family: &'f dyn Family) -> Self {
        let p = &job.prepared;
        let n = p.ids.len();
        let budget = p.options.max_new_tokens.min(family.context().saturating_sub(n));
        let picker = TokenPicker::new(p.options.clone(), &p.ids).with_dry(job.dry.clone());
        let hold = (!job.tools.is_empty()).then(CallHold::default);
        let out = StopFilter::new(job.stop.clone(), job.include_stop);
        let markers = family.reasoning().filter(|_| job.reasoning);
        let opened = markers.is_some_and(|m| m.opened_by(family.tokenizer(), &p.ids));
        let split = markers.map(|m| Split::new(m, opened));
        let thinking_until = markers.filter(|_| opened).map(|m| m.close_id);
        // Past the reasoning budget: a newline, then the closing marker.
        let close_block = markers
            .filter(|_| opened && p.options.reasoning_budget.is_some())
            .map(|m| {
                let mut ids = family.tokenizer().encode("\n", false).map(|e| e.get_ids().to_vec()).unwrap_or_default();
                ids.push(m.close_id);
                ids
            })
            .unwrap_or_default();
        Self {
            ids: p.ids.clone(),
            ident: p.ident.clone(),
            prompt_len: n,
            state: SeqState::default(),
            phase: Phase::Waiting,
            picker,
            pending: None,
            mask_task: None,
            held: None,
            stream: StreamDecoder::new(family.tokenizer()),
            out,
            logprobs: Vec::new(),
            sent_logprobs: 0,
            hold,
            split,
            thinking_until,
            close_block,
            forced: VecDeque::new(),
            verified: VecDeque::new(),
            checkpoint: None,
            draft: None,
            head: None,
            steps: StepReport::default(),
            budget,
            cached_tokens: 0,
            prefill_time: Duration::ZERO,
            first_logits: Vec::new(),
            ttft: None,
            decode_started: None,
            admitted: 0,
            reserved: 0,
            job,
        }
    }

    /// Bytes it holds or was admitted to hold, whichever is more.
    pub(super) fn held_bytes(&self) -> usize {
        let drafts =
            self.draft.as_ref().map_or(0, |d| d.state.bytes()) + self.head.as_ref().map_or(0, |h| h.state.bytes());
        (self.state.bytes() + drafts).max(self.reserved)
    }

    /// Whether it drafts with the model's own head (`speculative: mtp`).
    pub(super) fn uses_head(&self) -> bool {
        self.picker.options().speculative.method == crate::speculative::Method::Mtp
    }

    pub(super) fn cancelled(&self) -> bool {
        self.job.cancel.load(Ordering::Relaxed)
    }

    /// Its caller has `MAX_UNREAD` pieces or more not taken: it is left out of decode steps.
    pub(super) fn paused(&self) -> bool {
        self.job.unread.load(Ordering::Relaxed) >= MAX_UNREAD
    }

    /// Whether it waits for its next mask with its logits, and the mask is now ready.
    pub(super) fn mask_arrived(&mut self) -> bool {
        self.held.is_some() && self.mask_task.as_mut().is_none_or(MaskTask::ready)
    }

    /// Takes the logits of its next position: picks a token and streams its text. Returns the
    /// finish when the answer ends here.
    pub(super) fn accept(&mut self, logits: Vec<f32>) -> Result<Option<Finish>> {
        let step = self.picker.generated().len();
        let constrained = self.thinking_until.is_none();
        // A forced token needs no mask (the one being computed is for the position after it).
        if constrained && self.forced.is_empty() {
            if let Some(mut task) = self.mask_task.take() {
                if !task.ready() {
                    // Not computed yet: wait out of the decode steps, the others go on.
                    self.mask_task = Some(task);
                    self.held = Some(logits);
                    return Ok(None);
                }
                self.job.guide = Some(task.finish(&self.what())?);
            }
        }
        // The reasoning budget spent inside the block: the engine closes it for the model.
        let spent = self.picker.options().reasoning_budget.is_some_and(|b| step >= b);
        if self.thinking_until.is_some() && spent && self.forced.is_empty() && !self.close_block.is_empty() {
            self.forced = std::mem::take(&mut self.close_block).into();
        }
        let fast_forward = self.picker.options().forced_tokens;
        let mut sampled = true;
        let next = match self.job.guide.as_mut().filter(|_| constrained) {
            _ if !self.forced.is_empty() => {
                let t = self.forced.pop_front().expect("not empty");
                self.picker.force(&logits, t);
                sampled = false;
                t
            }
            Some(g) => {
                let mask = g.mask()?;
                let next = self.picker.pick_among(logits, Some(mask.as_slice()))?;
                g.consume(next)?;
                if fast_forward && !g.is_done() {
                    // What the grammar allows one way only follows without sampling.
                    let forced = g.take_forced()?;
                    self.steps.forced += forced.len();
                    self.forced.extend(forced);
                }
                next
            }
            None => self.picker.pick(logits)?,
        };
        if self.thinking_until == Some(next) {
            self.thinking_until = None;
        }
        self.ttft.get_or_insert_with(|| self.job.t0.elapsed());
        self.decode_started.get_or_insert_with(Instant::now);
        if self.picker.is_eos(next) {
            return Ok(Some(Finish::Stop));
        }
        if let Some(lp) = self.picker.take_logprob() {
            self.logprobs.push(lp);
        }
        if let Some(piece) = self.stream.push(next)? {
            let (emit, stopped) = self.out.push(&piece);
            let (reasoning, mut content) = match &mut self.split {
                Some(s) => {
                    let p = s.push(&emit);
                    (p.reasoning, p.content)
                }
                None => (String::new(), emit),
            };
            if let Some(h) = &mut self.hold {
                content = h.push(&content);
            }
            if !self.send(reasoning, true) || !self.send(content, false) {
                return Ok(Some(Finish::Cancelled));
            }
            if stopped {
                return Ok(Some(Finish::Stop));
            }
        }
        // The grammar can go no further (its forced tokens written): the answer is complete.
        if constrained && self.forced.is_empty() && self.job.guide.as_ref().is_some_and(Guide::is_done) {
            return Ok(Some(Finish::Stop));
        }
        if step + 1 >= self.budget {
            let full = self.budget < self.picker.options().max_new_tokens;
            return Ok(Some(if full { Finish::ContextFull } else { Finish::Length }));
        }
        // The next mask (after the forced tokens) is computed while the next forward pass runs.
        if constrained && sampled {
            match self.job.guide.take() {
                Some(g) if g.is_done() => self.job.guide = Some(g),
                Some(g) => self.mask_task = Some(g.next_mask()),
                None => {}
            }
        }
        self.pending = Some(next);
        Ok(None)
    }

    /// Tokens to verify after the pending one in the next forward pass: the forced ones, then
    /// drafts (`GenerationOptions::speculative`) after them (a JSON key forced, its value copied
    /// from the prompt); none while its state lacks fed tokens, never past its token budget nor
    /// `MAX_DRAFT`.
    pub(super) fn drafts(&self) -> Vec<u32> {
        let Some(pending) = self.pending else { return vec![] };
        if self.state.len() != self.ids.len() {
            return vec![];
        }
        let room = self.draft_budget();
        let mut out: Vec<u32> = self.forced.iter().take(room).copied().collect();
        let spec = &self.picker.options().speculative;
        if spec.method == crate::speculative::Method::Off || out.len() < self.forced.len() || out.len() == room {
            return out;
        }
        let mut history = Vec::with_capacity(self.ids.len() + 1 + out.len());
        history.extend_from_slice(&self.ids);
        history.push(pending);
        history.extend_from_slice(&out);
        out.extend(spec.draft(&history, room - out.len()));
        out
    }

    /// How many tokens its draft model or head may propose after `fixed` tokens to verify
    /// (`drafts`): none unless it drafts with one and every forced token is among them; within
    /// `draft_max`, its token budget and `MAX_DRAFT` in all.
    pub(super) fn model_draft_room(&self, fixed: usize) -> usize {
        use crate::speculative::Method;
        let spec = &self.picker.options().speculative;
        let drafter = match spec.method {
            Method::Draft => self.draft.is_some(),
            Method::Mtp => self.head.is_some(),
            Method::Off | Method::Ngram => false,
        };
        let ready = drafter && self.pending.is_some() && self.state.len() == self.ids.len();
        if !ready || fixed < self.forced.len() {
            return 0;
        }
        spec.draft_max.min(self.draft_budget().saturating_sub(fixed))
    }

    /// Prefills a chunk of its draft model's state towards `end` (`DraftSeq::catch_up`); nothing
    /// when it drafts with no model.
    pub(super) fn draft_catch_up(&mut self, g: &dyn crate::family::Generator, end: usize, chunk: usize) -> Result<()> {
        let (Some(features), Some(d)) = (&self.job.encoded.draft, self.draft.as_mut()) else { return Ok(()) };
        let p = super::draft::Prompt {
            ids: &self.ids,
            prompt_len: self.prompt_len,
            media: &self.job.prepared.media,
            features,
        };
        d.catch_up(g, &p, end, chunk)
    }

    /// Its head caught up with the rows its model state kept (after a prefill chunk); nothing
    /// when it drafts with no head.
    pub(super) fn head_catch_up(&mut self, h: &dyn crate::family::DraftHead, vocab: usize) -> Result<()> {
        let Some(head) = self.head.as_mut() else { return Ok(()) };
        let mut tokens = self.ids.clone();
        tokens.extend(self.pending);
        let work = super::head::Work { head, model: &mut self.state, tokens, forced: vec![], want: 0 };
        super::head::propose(h, vocab, &[], vec![work]).map(|_| ())
    }

    /// Its draft's state cut back to the tokens it kept (`DraftSeq::sync`).
    pub(super) fn draft_sync(&mut self) -> Result<()> {
        let len = self.ids.len();
        self.draft.as_mut().map_or(Ok(()), |d| d.sync(len))
    }

    /// Tokens it may verify after the pending one: one less than the tokens it may still pick
    /// (the last pick ends the answer, whatever it is), within `MAX_DRAFT`.
    fn draft_budget(&self) -> usize {
        let left = self.budget.saturating_sub(self.picker.generated().len());
        left.saturating_sub(1).min(crate::speculative::MAX_DRAFT)
    }

    /// Takes a forward pass's rows: `rows[0]` the logits after the pending token, `rows[j]`
    /// after `drafts[j - 1]`. Returns the finish when the answer ends here.
    pub(super) fn take_step(&mut self, drafts: Vec<u32>, mut rows: VecDeque<Vec<f32>>) -> Result<Option<Finish>> {
        let fed = self.pending.take().expect("a fed sequence has a pending token");
        self.ids.push(fed);
        self.steps.forward_passes += 1;
        // The forced tokens lead; the rest are drafts (counted, and counted as kept when kept).
        let forced = self.forced.len().min(drafts.len());
        self.steps.drafted += drafts.len() - forced;
        let first = rows.pop_front().expect("a row per fed token");
        self.verified = drafts
            .into_iter()
            .zip(rows)
            .enumerate()
            .map(|(j, (token, logits))| Verified { token, logits, drafted: j >= forced })
            .collect();
        let out = self.accept(first);
        self.go_on(out)
    }

    /// After a pick (`out`): while the picked token is the next verified one, feeds it and
    /// picks from the logits after it. Once it stops (another token, the end, or a mask to
    /// wait for), the rest is dropped and the state cut back to the fed tokens.
    pub(super) fn go_on(&mut self, mut out: Result<Option<Finish>>) -> Result<Option<Finish>> {
        while matches!(out, Ok(None)) && self.held.is_none() {
            match (self.pending, self.verified.front()) {
                (Some(p), Some(v)) if p == v.token => {
                    let v = self.verified.pop_front().expect("front");
                    self.pending = None;
                    self.ids.push(v.token);
                    self.steps.accepted += usize::from(v.drafted);
                    out = self.accept(v.logits);
                }
                _ => break,
            }
        }
        if self.held.is_some() && matches!(out, Ok(None)) {
            return out;
        }
        self.verified.clear();
        if self.state.len() > self.ids.len() {
            let cp = self.checkpoint.take();
            self.state.take_back(self.ids.len(), cp.as_ref())?;
        }
        self.checkpoint = None;
        out
    }

    /// The request field its constraint stands for, in errors.
    pub(super) fn what(&self) -> String {
        if !self.job.tools.is_empty() { "tool_choice" } else { "response_format" }.to_string()
    }

    /// Sends a piece (nothing when empty); false when the caller has gone.
    pub(super) fn send(&mut self, text: String, reasoning: bool) -> bool {
        if text.is_empty() {
            return true;
        }
        let logprobs = self.unsent_logprobs();
        self.job.unread.fetch_add(1, Ordering::Relaxed);
        self.job.events.send(Event::Text { choice: self.job.choice, text, reasoning, logprobs }).is_ok()
    }

    /// The log-probabilities picked since the last piece was sent.
    pub(super) fn unsent_logprobs(&mut self) -> Vec<TokenLogprob> {
        let from = std::mem::replace(&mut self.sent_logprobs, self.logprobs.len());
        self.logprobs[from..].to_vec()
    }

    /// The answer's end: the held-back text flushed, tool calls split off; sends the rest of the
    /// text and returns the completion.
    pub(super) fn complete(&mut self, mut finish: Finish) -> Result<Completion> {
        let mut tail = String::new();
        if finish != Finish::Cancelled && !self.out.stopped {
            if let Some(rest) = self.stream.finish()? {
                tail.push_str(&self.out.push(&rest).0);
            }
            tail.push_str(&self.out.flush());
        }
        let all = std::mem::take(&mut self.out.text);
        let (reasoning_tail, mut tail, mut text, reasoning) = match &mut self.split {
            Some(s) => {
                let (p, f) = (s.push(&tail), s.finish());
                let thought = s.thought.then(|| std::mem::take(&mut s.reasoning));
                (p.reasoning + &f.reasoning, p.content + &f.content, std::mem::take(&mut s.content), thought)
            }
            None => (String::new(), tail, all, None),
        };
        let mut tool_calls = vec![];
        if let Some(h) = &mut self.hold {
            tail = h.push(&tail);
            match split_tool_calls(&text, &self.job.tools) {
                Some((content, calls)) if finish != Finish::Cancelled => {
                    text = content;
                    tool_calls = calls;
                    finish = Finish::ToolCalls;
                }
                // Not a call after all: what was held back is text.
                _ => tail.push_str(&h.take()),
            }
        }
        if finish != Finish::Cancelled {
            self.send(reasoning_tail, true);
            self.send(tail, false);
        }
        let p = &self.job.prepared;
        let e = &self.job.encoded;
        Ok(Completion {
            text,
            reasoning,
            tool_calls,
            token_ids: self.picker.generated().to_vec(),
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached_tokens,
            image_tokens: p.image_tokens,
            video_tokens: p.video_tokens,
            videos: p.videos.clone(),
            images: p.images.clone(),
            image_cache_hits: e.image_hits,
            video_cache_hits: e.video_hits,
            finish,
            vision_time: e.time,
            prefill_time: self.prefill_time,
            decode_time: self.decode_started.map_or(Duration::ZERO, |t| t.elapsed()),
            time_to_first_token: self.ttft.unwrap_or_default(),
            first_logits: std::mem::take(&mut self.first_logits),
            logprobs: std::mem::take(&mut self.logprobs),
            kv_cache_bytes: self.state.bytes(),
            steps: self.steps,
        })
    }
}

/// A token fed after the pending one in a forward pass, with the logits after it.
pub(super) struct Verified {
    token: u32,
    logits: Vec<f32>,
    /// Drafted (`speculative`), not forced by the constraint.
    drafted: bool,
}

/// Answers the choices a sequence would have started, when it ends before its prefill did.
pub(super) fn orphan_forks(seq: &mut Seq<'_>, why: &str) {
    for f in std::mem::take(&mut seq.job.forks) {
        let e = crate::Error::Input { what: "n".into(), message: why.to_string() };
        let _ = seq.job.events.send(Event::Done(f.choice, Err(e)));
    }
}
