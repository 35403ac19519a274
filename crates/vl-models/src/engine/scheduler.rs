//! The one decode loop: a thread that owns every sequence's KV cache and, step after step,
//! admits waiting requests (a slot free and their prompt's KV within the budget), prefills one
//! chunk of one prompt, then decodes one token for every running sequence in a single batched
//! call. A sequence leaves when it finishes; its cache is kept for prefix reuse.
//!
//! When a running sequence needs another KV block and the budget is spent (kept prefixes
//! evicted first), the most recently admitted other sequence is preempted: its cache is dropped
//! and it waits at the head of the queue, to be prefilled again with the tokens it generated
//! (the same positions, so the same answer). A sequence alone that cannot grow ends with
//! `Finish::ContextFull`.
//!
//! No sequence holds up the others:
//! - a constrained answer's next token mask is computed on a thread of its own while the batched
//!   forward pass runs; a sequence whose mask is not ready keeps its logits and waits, out of the
//!   next steps, while the others decode (`Seq::held`);
//! - a sequence whose caller has not taken `MAX_UNREAD` of its pieces is paused (left out of the
//!   decode steps) until the caller catches up: a reader that stops reading costs a slot and its
//!   KV, never memory without bound (the caller decides how long it waits: the server's stall
//!   timeout cancels it).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use vl_nn::kv_cache::{blocks_for, BLOCK};

use super::prefix::PrefixStore;
use super::stop::StopFilter;
use super::{lock, Completion, Encoded, EngineStats, Finish, Shared};
use crate::constraint::{Guide, MaskTask};
use crate::error::Result;
use crate::family::{Family, Generator, Identity, PoolInput, Pooler, Prepared, Task};
use crate::reasoning::Split;
use crate::sampling::{TokenLogprob, TokenPicker};
use crate::state::SeqState;
use crate::stream::StreamDecoder;
use crate::tool_calls::{split_tool_calls, CallHold};

/// Pieces a request's caller may leave unread before its sequences are paused.
pub(crate) const MAX_UNREAD: usize = 16;

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

/// Prompt positions pooled in one call at most, jobs together (one job alone may exceed it).
const POOL_BATCH_TOKENS: usize = 16_384;

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
    /// Which choice of its request this is (events carry it).
    pub choice: usize,
    /// The request's other choices, started from this one's prefill.
    pub forks: Vec<Fork>,
    pub stop: Vec<String>,
    pub tools: bool,
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
enum Phase {
    /// Not admitted (or preempted): no cache.
    Waiting,
    /// Prompt positions being prefilled; `resume` after a preemption (the next token is known).
    Prefill {
        resume: bool,
    },
    Decode,
}

struct Seq<'f> {
    job: Box<Job>,
    /// The prompt's tokens, then every generated token fed to the cache.
    ids: Vec<u32>,
    ident: Vec<Identity>,
    prompt_len: usize,
    state: SeqState,
    phase: Phase,
    picker: TokenPicker,
    /// Picked, not yet fed.
    pending: Option<u32>,
    /// The constraint's next mask, being computed beside the forward pass (the guide is with
    /// it meanwhile).
    mask_task: Option<MaskTask>,
    /// Logits of its next position, waiting for that mask.
    held: Option<Vec<f32>>,
    stream: StreamDecoder<'f>,
    out: StopFilter,
    /// Each picked token's log-probabilities (with `logprobs` on), and how many were sent.
    logprobs: Vec<TokenLogprob>,
    sent_logprobs: usize,
    hold: Option<CallHold>,
    /// The reasoning block split from the answer's text, when the family has markers.
    split: Option<Split>,
    /// The closing marker's id while the answer is inside a reasoning block the prompt opened:
    /// the request's constraint applies from the token after it.
    thinking_until: Option<u32>,
    /// Tokens it may generate: max_new_tokens within the context.
    budget: usize,
    cached_tokens: usize,
    prefill_time: Duration,
    first_logits: Vec<f32>,
    ttft: Option<Duration>,
    decode_started: Option<Instant>,
    admitted: u64,
    /// Bytes its prompt's state was admitted with: counted until the state holds them (it
    /// allocates at its first prefill), so that two admitted together cannot both count 0.
    reserved: usize,
}

impl<'f> Seq<'f> {
    fn new(job: Box<Job>, family: &'f dyn Family) -> Self {
        let p = &job.prepared;
        let n = p.ids.len();
        let budget = p.options.max_new_tokens.min(family.context().saturating_sub(n));
        let picker = TokenPicker::new(p.options.clone(), &p.ids);
        let hold = job.tools.then(CallHold::default);
        let out = StopFilter::new(job.stop.clone());
        let markers = family.reasoning().filter(|_| job.reasoning);
        let opened = markers.is_some_and(|m| m.opened_by(family.tokenizer(), &p.ids));
        let split = markers.map(|m| Split::new(m, opened));
        let thinking_until = markers.filter(|_| opened).map(|m| m.close_id);
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
    fn held_bytes(&self) -> usize {
        self.state.bytes().max(self.reserved)
    }

    fn cancelled(&self) -> bool {
        self.job.cancel.load(Ordering::Relaxed)
    }

    /// Its caller has `MAX_UNREAD` pieces or more not taken: it is left out of decode steps.
    fn paused(&self) -> bool {
        self.job.unread.load(Ordering::Relaxed) >= MAX_UNREAD
    }

    /// Whether it waits for its next mask with its logits, and the mask is now ready.
    fn mask_arrived(&mut self) -> bool {
        self.held.is_some() && self.mask_task.as_mut().is_none_or(MaskTask::ready)
    }

    /// Takes the logits of its next position: picks a token and streams its text. Returns the
    /// finish when the answer ends here.
    fn accept(&mut self, logits: Vec<f32>) -> Result<Option<Finish>> {
        let step = self.picker.generated().len();
        let constrained = self.thinking_until.is_none();
        if constrained {
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
        let next = match self.job.guide.as_mut().filter(|_| constrained) {
            Some(g) => {
                let mask = g.mask()?;
                let next = self.picker.pick_among(logits, Some(mask.as_slice()))?;
                g.consume(next)?;
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
        // The grammar can go no further: the answer is complete.
        if constrained && self.job.guide.as_ref().is_some_and(Guide::is_done) {
            return Ok(Some(Finish::Stop));
        }
        if step + 1 >= self.budget {
            let full = self.budget < self.picker.options().max_new_tokens;
            return Ok(Some(if full { Finish::ContextFull } else { Finish::Length }));
        }
        // The next mask is computed while the next forward pass runs.
        if constrained {
            if let Some(g) = self.job.guide.take() {
                self.mask_task = Some(g.next_mask());
            }
        }
        self.pending = Some(next);
        Ok(None)
    }

    /// The request field its constraint stands for, in errors.
    fn what(&self) -> String {
        if self.job.tools { "tool_choice" } else { "response_format" }.to_string()
    }

    /// Sends a piece (nothing when empty); false when the caller has gone.
    fn send(&mut self, text: String, reasoning: bool) -> bool {
        if text.is_empty() {
            return true;
        }
        let logprobs = self.unsent_logprobs();
        self.job.unread.fetch_add(1, Ordering::Relaxed);
        self.job.events.send(Event::Text { choice: self.job.choice, text, reasoning, logprobs }).is_ok()
    }

    /// The log-probabilities picked since the last piece was sent.
    fn unsent_logprobs(&mut self) -> Vec<TokenLogprob> {
        let from = std::mem::replace(&mut self.sent_logprobs, self.logprobs.len());
        self.logprobs[from..].to_vec()
    }

    /// The answer's end: the held-back text flushed, tool calls split off; sends the rest of the
    /// text and returns the completion.
    fn complete(&mut self, mut finish: Finish) -> Result<Completion> {
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
            match split_tool_calls(&text) {
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
        })
    }
}

/// Answers the choices a sequence would have started, when it ends before its prefill did.
fn orphan_forks(seq: &mut Seq<'_>, why: &str) {
    for f in std::mem::take(&mut seq.job.forks) {
        let e = crate::Error::Input { what: "n".into(), message: why.to_string() };
        let _ = seq.job.events.send(Event::Done(f.choice, Err(e)));
    }
}

struct Scheduler<'f> {
    family: &'f dyn Family,
    generator: &'f dyn Generator,
    shared: &'f Shared,
    waiting: VecDeque<Seq<'f>>,
    running: Vec<Seq<'f>>,
    store: PrefixStore,
    /// KV bytes of one position.
    per_position: usize,
    /// Bytes a sequence's state takes whatever its length (recurrent layers).
    fixed: usize,
    admissions: u64,
    decode_steps: u64,
    decode_rows: u64,
    preemptions: u64,
}

/// The scheduler thread's body: runs until the engine closes the queue and nothing is left.
pub(crate) fn run(shared: &Shared, rx: mpsc::Receiver<Command>) {
    let family = &*shared.family;
    let generator = match family.task() {
        Task::Generate(g) => g,
        Task::Pool(p) => return run_pooling(p, &rx),
    };
    let mut s = Scheduler {
        family,
        generator,
        shared,
        waiting: VecDeque::new(),
        running: Vec::new(),
        store: PrefixStore::default(),
        per_position: generator.kv_bytes_per_position().max(1),
        fixed: generator.fixed_state_bytes(),
        admissions: 0,
        decode_steps: 0,
        decode_rows: 0,
        preemptions: 0,
    };
    loop {
        if s.waiting.is_empty() && s.running.is_empty() {
            match rx.recv() {
                Ok(c) => s.take(c),
                Err(_) => return,
            }
        }
        while let Ok(c) = rx.try_recv() {
            s.take(c);
        }
        s.drop_cancelled();
        s.admit();
        let mut busy = s.take_masks();
        busy |= s.prefill_one_chunk();
        busy |= s.decode_step();
        s.publish();
        if !busy {
            // Every running sequence waits (for its mask, or for its caller to read): wait for
            // a new request or a moment, then look again.
            match rx.recv_timeout(Duration::from_millis(2)) {
                Ok(c) => s.take(c),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) if s.running.is_empty() && s.waiting.is_empty() => return,
                Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }
}

/// The loop of a pooling model: the prompts waiting when it looks (up to `POOL_BATCH_TOKENS`
/// positions) go through the model in one call; each job gets its rows.
fn run_pooling(pooler: &dyn Pooler, rx: &mpsc::Receiver<Command>) {
    let mut waiting: VecDeque<Box<PoolJob>> = VecDeque::new();
    loop {
        if waiting.is_empty() {
            match rx.recv() {
                Ok(c) => waiting.push_back(pool_job(c)),
                Err(_) => return,
            }
        }
        while let Ok(c) = rx.try_recv() {
            waiting.push_back(pool_job(c));
        }
        let mut batch = vec![waiting.pop_front().expect("one waits")];
        let mut tokens: usize = batch[0].inputs.iter().map(|(p, _)| p.ids.len()).sum();
        while let Some(next) = waiting.front() {
            let more: usize = next.inputs.iter().map(|(p, _)| p.ids.len()).sum();
            if tokens + more > POOL_BATCH_TOKENS {
                break;
            }
            tokens += more;
            batch.push(waiting.pop_front().expect("front exists"));
        }
        let inputs: Vec<PoolInput<'_>> = batch
            .iter()
            .flat_map(|j| &j.inputs)
            .map(|(p, e)| PoolInput { ids: &p.ids, media: &p.media, features: &e.features })
            .collect();
        let pooled = pooler.pool(&inputs);
        drop(inputs);
        let mut rows = match pooled {
            Ok(rows) if rows.len() == batch.iter().map(|j| j.inputs.len()).sum::<usize>() => Ok(rows.into_iter()),
            Ok(rows) => Err(format!("the model pooled {} rows for {} prompts", rows.len(), tokens)),
            Err(e) => Err(e.to_string()),
        };
        for job in batch {
            let answer = match &mut rows {
                Ok(rows) => Ok(job
                    .inputs
                    .iter()
                    .zip(rows.by_ref())
                    .map(|((p, _), values)| super::PoolOutput {
                        values,
                        prompt_tokens: p.ids.len(),
                        image_tokens: p.image_tokens,
                        video_tokens: p.video_tokens,
                    })
                    .collect()),
                Err(why) => Err(crate::Error::Internal { message: format!("pooling failed: {why}") }),
            };
            let _ = job.reply.send(answer);
        }
    }
}

/// A command to a pooling model's loop: a generation request is answered with an error.
fn pool_job(c: Command) -> Box<PoolJob> {
    match c {
        Command::Pool(job) => job,
        Command::Submit(job) => {
            let _ = job.events.send(Event::Done(
                job.choice,
                Err(crate::Error::Internal { message: "a pooling model got a generation request".into() }),
            ));
            Box::new(PoolJob { inputs: vec![], reply: mpsc::channel().0 })
        }
    }
}

impl<'f> Scheduler<'f> {
    /// Queues a command: a request joins the waiting line; pooling is refused (this model
    /// generates; the engine refuses it before it gets here).
    fn take(&mut self, c: Command) {
        match c {
            Command::Submit(job) => self.waiting.push_back(Seq::new(job, self.family)),
            Command::Pool(job) => {
                let _ = job
                    .reply
                    .send(Err(crate::Error::Internal { message: "a generating model got prompts to pool".into() }));
            }
        }
    }

    fn budget(&self) -> usize {
        self.shared.opts.kv_cache_bytes
    }

    fn used(&self) -> usize {
        self.running.iter().map(Seq::held_bytes).sum::<usize>() + self.store.bytes()
    }

    /// Frees kept prefixes until `bytes` more fit in the budget; false if they cannot.
    fn make_room(&mut self, bytes: usize) -> bool {
        while self.used() + bytes > self.budget() {
            if !self.store.evict() {
                return false;
            }
        }
        true
    }

    fn finish(&mut self, mut seq: Seq<'f>, finish: Finish) {
        let result = seq.complete(finish);
        if self.shared.opts.prefix_cache && result.is_ok() {
            // What the cache holds: the prompt, then each generated token fed to it.
            let mut ident = std::mem::take(&mut seq.ident);
            ident.extend(seq.ids[seq.prompt_len..].iter().map(|&t| Identity::text(t)));
            let mut state = std::mem::take(&mut seq.state);
            if ident.len() == state.len() {
                state.mark();
                self.store.put(ident, state);
            }
            self.make_room(0);
        }
        // The stats a caller reads once answered count this sequence out.
        self.publish();
        let _ = seq.job.events.send(Event::Done(seq.job.choice, result));
        orphan_forks(&mut seq, "the first choice ended before its prompt was prefilled");
    }

    fn fail(&mut self, mut seq: Seq<'f>, e: crate::Error) {
        self.publish();
        let why = e.to_string();
        let _ = seq.job.events.send(Event::Done(seq.job.choice, Err(e)));
        orphan_forks(&mut seq, &why);
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                let seq = self.running.remove(i);
                self.finish(seq, Finish::Cancelled);
            } else {
                i += 1;
            }
        }
        let (keep, gone): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.waiting).into_iter().partition(|s: &Seq| !s.cancelled());
        self.waiting = keep;
        for seq in gone {
            self.finish(seq, Finish::Cancelled);
        }
    }

    /// Moves waiting sequences into free slots while their prompt's KV fits the budget (kept
    /// prefixes evicted as needed), in arrival order.
    fn admit(&mut self) {
        while self.running.len() < self.shared.opts.parallel {
            let Some(seq) = self.waiting.front() else { return };
            let need = blocks_for(seq.ids.len() + 1) * self.per_position + self.fixed;
            let running: usize = self.running.iter().map(Seq::held_bytes).sum();
            if running + need > self.budget() {
                if self.running.is_empty() {
                    // Even alone it cannot fit (a preempted sequence grew past the budget).
                    let seq = self.waiting.pop_front().expect("front exists");
                    self.finish(seq, Finish::ContextFull);
                    continue;
                }
                return;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            let mut ident = seq.ident.clone();
            ident.extend(seq.ids[seq.prompt_len..].iter().map(|&t| Identity::text(t)));
            let reused = if self.shared.opts.prefix_cache { self.store.take(&ident) } else { Ok(None) };
            match reused {
                Ok(Some((state, common))) => {
                    seq.state = state;
                    if seq.admitted == 0 {
                        seq.cached_tokens = common;
                    }
                }
                Ok(None) => seq.state = self.generator.new_state(),
                Err(e) => {
                    self.fail(seq, e);
                    continue;
                }
            }
            let more = need.saturating_sub(seq.state.bytes());
            self.make_room(more);
            seq.reserved = need;
            seq.state.reserve(seq.ids.len() + 1);
            // Its next token known (or its logits held for a mask): only the fed ids are
            // prefilled again.
            let resume = seq.pending.is_some() || seq.held.is_some();
            seq.phase = Phase::Prefill { resume };
            self.admissions += 1;
            seq.admitted = self.admissions;
            self.running.push(seq);
        }
    }

    /// Sequences whose next mask has arrived pick their token from the logits they held.
    /// Returns whether any did.
    fn take_masks(&mut self) -> bool {
        let mut any = false;
        let mut done = Vec::new();
        for (i, seq) in self.running.iter_mut().enumerate() {
            if !seq.mask_arrived() {
                continue;
            }
            any = true;
            let logits = seq.held.take().expect("held");
            if let Some(outcome) = seq.accept(logits).transpose() {
                done.push((i, outcome));
            }
        }
        self.settle(done);
        any
    }

    /// Ends the running sequences at the given indices (ascending), each with its finish or
    /// error.
    fn settle(&mut self, done: Vec<(usize, Result<Finish>)>) {
        for (i, outcome) in done.into_iter().rev() {
            let seq = self.running.remove(i);
            match outcome {
                Ok(f) => self.finish(seq, f),
                Err(e) => self.fail(seq, e),
            }
        }
    }

    /// One chunk of the earliest admitted prompt still prefilling; false when none is.
    fn prefill_one_chunk(&mut self) -> bool {
        let Some(i) = self.running.iter().position(|s| matches!(s.phase, Phase::Prefill { .. })) else { return false };
        let chunk = self.shared.opts.prefill_chunk;
        let mut pending_forks = None;
        let seq = &mut self.running[i];
        let end = (seq.state.len() + chunk).min(seq.ids.len());
        let t = Instant::now();
        let p = &seq.job.prepared;
        crate::progress::report("prefill", "tokens", seq.state.len(), seq.ids.len());
        let result =
            self.generator.prefill(&seq.ids, seq.prompt_len, &p.media, &seq.job.encoded.features, &mut seq.state, end);
        crate::progress::report("prefill", "tokens", end, seq.ids.len());
        // A point a later prompt sharing this prefix may restore (recurrent layers' snapshots).
        if result.is_ok() {
            seq.state.mark();
        }
        seq.prefill_time += t.elapsed();
        let outcome = match result {
            Err(e) => Err(e),
            Ok(None) => Ok(None),
            Ok(Some(logits)) => {
                let resume = seq.phase == Phase::Prefill { resume: true };
                seq.phase = Phase::Decode;
                if resume {
                    Ok(None)
                } else {
                    logits.to_vec1::<f32>().map_err(Into::into).and_then(|l| {
                        seq.first_logits = l.clone();
                        let forks = std::mem::take(&mut seq.job.forks);
                        if !forks.is_empty() {
                            pending_forks = Some((forks, l.clone()));
                        }
                        seq.accept(l)
                    })
                }
            }
        };
        // The other choices start from this prefill (before the first choice's token is fed).
        if let Some((forks, logits)) = pending_forks {
            self.fork(i, forks, &logits);
        }
        match outcome {
            Ok(None) => {}
            Ok(Some(finish)) => {
                let seq = self.running.remove(i);
                self.finish(seq, finish);
            }
            Err(e) => {
                let seq = self.running.remove(i);
                self.fail(seq, e);
            }
        }
        true
    }

    /// Starts `forks` from the prefilled sequence at `i`: each gets a copy of its cache and picks
    /// its first token from `logits` with its own seed. A fork without a free slot or KV room
    /// waits in the queue and prefills itself later.
    fn fork(&mut self, i: usize, forks: Vec<Fork>, logits: &[f32]) {
        for f in forks {
            let (mut seq, copy, bytes) = {
                let parent = &self.running[i];
                let mut prepared = parent.job.prepared.clone();
                prepared.options.seed = f.seed;
                let job = Job {
                    prepared,
                    encoded: parent.job.encoded.clone(),
                    guide: f.guide,
                    choice: f.choice,
                    forks: vec![],
                    stop: parent.job.stop.clone(),
                    tools: parent.job.tools,
                    reasoning: parent.job.reasoning,
                    events: parent.job.events.clone(),
                    unread: parent.job.unread.clone(),
                    cancel: parent.job.cancel.clone(),
                    t0: parent.job.t0,
                };
                let mut seq = Seq::new(Box::new(job), self.family);
                seq.cached_tokens = parent.cached_tokens;
                (seq, parent.state.fork(), parent.state.bytes())
            };
            let fits = self.running.len() < self.shared.opts.parallel && self.make_room(bytes);
            match copy {
                Ok(state) if fits => {
                    seq.state = state;
                    seq.phase = Phase::Decode;
                    self.admissions += 1;
                    seq.admitted = self.admissions;
                    match seq.accept(logits.to_vec()) {
                        Ok(None) => self.running.push(seq),
                        Ok(Some(finish)) => self.finish(seq, finish),
                        Err(e) => self.fail(seq, e),
                    }
                }
                Ok(_) => self.waiting.push_front(seq),
                Err(e) => self.fail(seq, e),
            }
        }
    }

    /// Makes room for one more position in each decoding sequence's cache, preempting the most
    /// recently admitted other sequences when the budget is spent.
    fn grow_caches(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            // Only a sequence fed this step needs room: one waiting for its mask or its caller
            // grows (or preempts another) when it has a token to feed.
            if s.phase != Phase::Decode || s.pending.is_none() || s.paused() || s.state.len() < s.state.capacity() {
                i += 1;
                continue;
            }
            let me = s.admitted;
            let block = BLOCK * self.per_position;
            if self.make_room(block) {
                i += 1;
                continue;
            }
            let victim = self
                .running
                .iter()
                .enumerate()
                .filter(|(_, o)| o.admitted != me)
                .max_by_key(|(_, o)| o.admitted)
                .map(|(j, _)| j);
            match victim {
                Some(j) => {
                    let mut v = self.running.remove(j);
                    v.state = SeqState::default();
                    v.reserved = 0;
                    v.phase = Phase::Waiting;
                    self.waiting.push_front(v);
                    self.preemptions += 1;
                    if j < i {
                        i -= 1;
                    }
                }
                None => {
                    let seq = self.running.remove(i);
                    self.finish(seq, Finish::ContextFull);
                }
            }
        }
    }

    /// One token for every decoding sequence (not paused), in one batched call; false when there
    /// was none.
    fn decode_step(&mut self) -> bool {
        self.grow_caches();
        let rows: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let s = &self.running[i];
                s.phase == Phase::Decode && s.pending.is_some() && !s.paused()
            })
            .collect();
        if rows.is_empty() {
            return false;
        }
        let tokens: Vec<u32> = rows.iter().map(|&i| self.running[i].pending.expect("filtered")).collect();
        let mut states: Vec<&mut SeqState> =
            self.running.iter_mut().enumerate().filter(|(i, _)| rows.contains(i)).map(|(_, s)| &mut s.state).collect();
        let logits = self.generator.decode(&tokens, &mut states).and_then(|l| Ok(l.to_vec2::<f32>()?));
        drop(states);
        self.decode_steps += 1;
        self.decode_rows += rows.len() as u64;
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // The batch's caches are in an unknown state: every sequence in it fails.
                let msg = e.to_string();
                for &i in rows.iter().rev() {
                    let seq = self.running.remove(i);
                    let err = crate::Error::Internal { message: format!("a batched decode step failed: {msg}") };
                    self.fail(seq, err);
                }
                return true;
            }
        };
        let mut done = Vec::new();
        for (&i, row) in rows.iter().zip(logits) {
            let seq = &mut self.running[i];
            let fed = seq.pending.take().expect("filtered");
            seq.ids.push(fed);
            if let Some(outcome) = seq.accept(row).transpose() {
                done.push((i, outcome));
            }
        }
        self.settle(done);
        true
    }

    fn publish(&self) {
        let mut st = lock(&self.shared.stats);
        *st = EngineStats {
            kv_cache_bytes: self.used(),
            kv_budget_bytes: self.budget(),
            cached_positions: self.store.positions(),
            cached_prefixes: self.store.len(),
            running: self.running.len(),
            waiting: self.waiting.len(),
            decode_steps: self.decode_steps,
            decode_rows: self.decode_rows,
            preemptions: self.preemptions,
            ..*st
        };
    }
}
