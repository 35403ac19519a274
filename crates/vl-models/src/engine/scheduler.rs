//! The one decode loop: a thread that owns every sequence's KV cache and, step after step,
//! admits waiting requests (a slot free and their prompt's KV within the budget), prefills one
//! chunk of one prompt, then decodes one token for every running sequence in a single batched
//! call. A sequence leaves when it finishes; its cache is kept for prefix reuse.
//!
//! A running sequence whose KV cache is full grows it by `vl_nn::kv_cache::growth` positions (an
//! eighth of its length, in blocks) where the budget has room without evicting a kept prefix,
//! else by one block. When even a block does not fit (kept prefixes evicted first), the most
//! recently admitted other sequence is preempted: its cache is dropped and it waits at the head
//! of the queue, to be prefilled again with the tokens it generated (the same positions, so the
//! same answer). A sequence alone that cannot grow ends with `Finish::ContextFull`.
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
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vl_nn::kv_cache::{blocks_for, BLOCK};

use super::draft::{self, DraftSeq};
use super::head::{self, HeadSeq};
use super::prefix::{message_end, PrefixStore};
use super::sequence::{orphan_forks, Command, Event, Fork, Job, Phase, Seq};
use super::{lock, EngineStats, Finish, Shared};
use crate::error::Result;
use crate::family::{DraftHead, Family, Generator, Identity, Task};
use crate::state::SeqState;

#[path = "kv_growth.rs"]
mod kv_growth;

struct Scheduler<'f> {
    family: &'f dyn Family,
    generator: &'f dyn Generator,
    /// The draft model's generating half (`speculative: draft`), and its state's KV bytes per
    /// position and fixed bytes.
    draft: Option<&'f dyn Generator>,
    draft_per_position: usize,
    draft_fixed: usize,
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
    /// Drafted, accepted and forced tokens of the answers ended so far.
    steps: crate::request::StepReport,
}

/// The scheduler thread's body: runs until the engine closes the queue and nothing is left.
pub(crate) fn run(shared: &Shared, rx: mpsc::Receiver<Command>) {
    let family = &*shared.family;
    let generator = match family.task() {
        Task::Generate(g) => g,
        Task::Pool(p) => {
            let settings =
                super::pool::PoolSettings { budget: shared.opts.kv_cache_bytes, reuse: shared.opts.prefix_cache };
            let publish = |bytes, positions, prefixes| {
                let mut st = lock(&shared.stats);
                st.kv_cache_bytes = bytes;
                st.kv_budget_bytes = shared.opts.kv_cache_bytes;
                st.cached_positions = positions;
                st.cached_prefixes = prefixes;
            };
            return super::pool::run_pooling(p, &rx, settings, &publish);
        }
    };
    let draft = shared.draft.as_ref().map(|d| d.generator());
    let mut s = Scheduler {
        family,
        generator,
        draft,
        draft_per_position: draft.map_or(0, |d| d.kv_bytes_per_position()),
        draft_fixed: draft.map_or(0, |d| d.fixed_state_bytes()),
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
        steps: Default::default(),
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
        self.steps.drafted += seq.steps.drafted;
        self.steps.accepted += seq.steps.accepted;
        self.steps.forced += seq.steps.forced;
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
            let mut need = blocks_for(seq.ids.len() + 1) * self.per_position + self.fixed;
            if seq.job.encoded.draft.is_some() {
                need += blocks_for(seq.ids.len() + 1) * self.draft_per_position + self.draft_fixed;
            }
            if seq.uses_head() {
                match self.head() {
                    Some(h) => need += blocks_for(seq.ids.len() + 1) * h.kv_bytes_per_position(),
                    None => {
                        let seq = self.waiting.pop_front().expect("front exists");
                        self.fail(seq, no_head());
                        continue;
                    }
                }
            }
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
            seq.draft = self.draft.filter(|_| seq.job.encoded.draft.is_some()).map(DraftSeq::new);
            seq.head = self.head().filter(|_| seq.uses_head()).map(HeadSeq::new);
            seq.state.keep_hidden(seq.head.is_some());
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
            let out = seq.accept(logits);
            if let Some(outcome) = seq.go_on(out).transpose() {
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
        let mut end = (seq.state.len() + chunk).min(seq.ids.len());
        // Recurrent layers keep a point only where a chunk ends (`mark` below).
        if self.shared.opts.prefix_cache && seq.state.has_recurrent() {
            let prompt = &seq.ids[..seq.prompt_len.min(seq.ids.len())];
            end = message_end(prompt, self.generator.eos_token_ids(), seq.state.len(), end);
        }
        let t = Instant::now();
        let p = &seq.job.prepared;
        crate::progress::report("prefill", "tokens", seq.state.len(), seq.ids.len());
        let mut result =
            self.generator.prefill(&seq.ids, seq.prompt_len, &p.media, &seq.job.encoded.features, &mut seq.state, end);
        // The draft's chunk beside it (catching up a prefix the model reused, a chunk a step).
        if let (Ok(_), Some(d)) = (&result, self.draft) {
            if let Err(e) = seq.draft_catch_up(d, end, chunk) {
                result = Err(e);
            }
        }
        // The head's entries of the chunk's positions.
        if let (Ok(_), Some(h)) = (&result, self.generator.draft_head()) {
            if let Err(e) = seq.head_catch_up(h, self.family.vocab_size()) {
                result = Err(e);
            }
        }
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
                    dry: parent.job.dry.clone(),
                    choice: f.choice,
                    forks: vec![],
                    stop: parent.job.stop.clone(),
                    include_stop: parent.job.include_stop,
                    tools: parent.job.tools.clone(),
                    reasoning: parent.job.reasoning,
                    events: parent.job.events.clone(),
                    unread: parent.job.unread.clone(),
                    cancel: parent.job.cancel.clone(),
                    t0: parent.job.t0,
                };
                let mut seq = Seq::new(Box::new(job), self.family);
                seq.cached_tokens = parent.cached_tokens;
                // Its draft catches up at its decode steps; its head is a copy of the parent's
                // (which caught up with the prompt).
                seq.draft = self.draft.filter(|_| seq.job.encoded.draft.is_some()).map(DraftSeq::new);
                seq.head = match (self.head().filter(|_| seq.uses_head()), &parent.head) {
                    (Some(_), Some(h)) => h.state.fork().ok().map(|state| HeadSeq { state, start: h.start }),
                    (Some(h), None) => Some(HeadSeq::new(h)),
                    (None, _) => None,
                };
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

    /// The tokens to verify after sequence `i`'s pending one (`Seq::drafts`), and how many more
    /// its draft model is to propose (`Seq::model_draft_room`): `spare` rows at most, within
    /// its KV blocks or one more the budget has room for.
    fn plan_drafts(&mut self, i: usize, spare: usize) -> (Vec<u32>, usize) {
        let mut drafts = self.running[i].drafts();
        drafts.truncate(spare);
        let want = self.running[i].model_draft_room(drafts.len()).min(spare - drafts.len());
        if drafts.is_empty() && want == 0 {
            return (drafts, 0);
        }
        let state = &self.running[i].state;
        let mut room = state.capacity().saturating_sub(state.len() + 1);
        if drafts.len() + want > room && self.make_room(BLOCK * self.per_position) {
            room += BLOCK;
        }
        drafts.truncate(room);
        let want = want.min(room - drafts.len());
        (drafts, want)
    }

    /// The draft model's proposals for the rows that want some (`plans[r].1`), appended to their
    /// drafts. A draft lagging more than `draft::CATCH_UP` tokens behind its sequence prefills a
    /// chunk first, and proposes nothing this step if it still lags; so does one whose growth
    /// the budget has no room for. An error names the sequences it stopped.
    fn draft_step(
        &mut self,
        rows: &[usize],
        plans: &mut [(Vec<u32>, usize)],
    ) -> std::result::Result<(), (Vec<usize>, String)> {
        let Some(g) = self.draft else { return Ok(()) };
        let chunk = self.shared.opts.prefill_chunk;
        let mut who = Vec::new();
        for (r, &i) in rows.iter().enumerate() {
            if plans[r].1 == 0 || self.running[i].draft.is_none() {
                continue;
            }
            let lag = |s: &Seq| s.ids.len().saturating_sub(s.draft.as_ref().map_or(0, |d| d.state.len()));
            if lag(&self.running[i]) > draft::CATCH_UP {
                let seq = &mut self.running[i];
                let end = seq.ids.len();
                seq.draft_catch_up(g, end, chunk).map_err(|e| (vec![i], e.to_string()))?;
            }
            let seq = &self.running[i];
            let behind = lag(seq);
            let d = seq.draft.as_ref().expect("a sequence drafting with a model has its draft");
            if d.state.len() > seq.ids.len() {
                // Not cut back yet (its sequence waited for a mask): it drafts next step.
                plans[r].1 = 0;
                continue;
            }
            let grown = d.state.len() + behind + plans[r].0.len() + plans[r].1;
            let more = blocks_for(grown).saturating_sub(d.state.capacity()) * self.draft_per_position;
            if behind > draft::CATCH_UP || (more > 0 && !self.make_room(more)) {
                plans[r].1 = 0;
                continue;
            }
            who.push(r);
        }
        if who.is_empty() {
            return Ok(());
        }
        let vocab = self.family.vocab_size();
        let eos = self.generator.eos_token_ids();
        let mut work = Vec::with_capacity(who.len());
        let mut idx = who.iter().map(|&r| rows[r]).peekable();
        for (i, seq) in self.running.iter_mut().enumerate() {
            if idx.peek() != Some(&i) {
                continue;
            }
            idx.next();
            let r = rows.iter().position(|&x| x == i).expect("a row");
            let d = seq.draft.as_mut().expect("checked above");
            let mut feed = seq.ids[d.state.len()..].to_vec();
            feed.push(seq.pending.expect("a fed sequence"));
            feed.extend_from_slice(&plans[r].0);
            work.push(draft::Work { draft: d, feed, want: plans[r].1 });
        }
        let proposed =
            draft::propose(g, vocab, eos, work).map_err(|e| (who.iter().map(|&r| rows[r]).collect(), e.to_string()))?;
        for (&r, tokens) in who.iter().zip(proposed) {
            plans[r].0.extend(tokens);
        }
        Ok(())
    }

    /// The model's draft head's proposals for the rows that want some and draft with it,
    /// appended to their drafts; a head whose growth the budget has no room for proposes nothing
    /// this step. An error names the sequences it stopped.
    fn head_step(
        &mut self,
        rows: &[usize],
        plans: &mut [(Vec<u32>, usize)],
    ) -> std::result::Result<(), (Vec<usize>, String)> {
        let Some(h) = self.generator.draft_head() else { return Ok(()) };
        let per_position = h.kv_bytes_per_position();
        let mut who = Vec::new();
        for (r, &i) in rows.iter().enumerate() {
            let seq = &self.running[i];
            let Some(head) = seq.head.as_ref().filter(|_| plans[r].1 > 0) else { continue };
            let grown = seq.ids.len() + 1 + plans[r].0.len() + plans[r].1;
            let more = blocks_for(grown).saturating_sub(head.state.capacity()) * per_position;
            if more > 0 && !self.make_room(more) {
                plans[r].1 = 0;
                continue;
            }
            who.push(r);
        }
        if who.is_empty() {
            return Ok(());
        }
        let vocab = self.family.vocab_size();
        let eos = self.generator.eos_token_ids();
        let mut work = Vec::with_capacity(who.len());
        let mut idx = who.iter().map(|&r| rows[r]).peekable();
        for (i, seq) in self.running.iter_mut().enumerate() {
            if idx.peek() != Some(&i) {
                continue;
            }
            idx.next();
            let r = rows.iter().position(|&x| x == i).expect("a row");
            let mut tokens = seq.ids.clone();
            tokens.push(seq.pending.expect("a fed sequence"));
            let head = seq.head.as_mut().expect("checked above");
            work.push(head::Work { head, model: &mut seq.state, tokens, forced: plans[r].0.clone(), want: plans[r].1 });
        }
        let proposed =
            head::propose(h, vocab, eos, work).map_err(|e| (who.iter().map(|&r| rows[r]).collect(), e.to_string()))?;
        for (&r, tokens) in who.iter().zip(proposed) {
            plans[r].0.extend(tokens);
        }
        Ok(())
    }

    /// One forward pass for every decoding sequence (not paused), batched: each feeds the
    /// tokens its state lacks (a recurrent state taken back after a rejected draft), its
    /// pending token and the tokens to verify after it. False when there was none.
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
        // Per sequence: the tokens fed (those its state lacks, the pending one, the drafts) and
        // the drafts. Drafts fill the step up to `SMALL_ROWS` rows in all: the products whose rows are bit
        // for bit those of one row at a time (a batch of many sequences drafts little).
        let needed: usize = rows.iter().map(|&i| self.running[i].ids.len() - self.running[i].state.len() + 1).sum();
        let mut spare = vl_nn::stored::SMALL_ROWS.saturating_sub(needed);
        let mut plans = Vec::with_capacity(rows.len());
        for &i in &rows {
            let plan = if spare > 0 { self.plan_drafts(i, spare) } else { (vec![], 0) };
            spare -= plan.0.len() + plan.1;
            plans.push(plan);
        }
        if let Err((stopped, msg)) = self.draft_step(&rows, &mut plans) {
            // The draft's states of those sequences are in an unknown state: they fail.
            for &i in stopped.iter().rev() {
                let seq = self.running.remove(i);
                self.fail(seq, crate::Error::Internal { message: format!("the draft model failed: {msg}") });
            }
            return true;
        }
        if let Err((stopped, msg)) = self.head_step(&rows, &mut plans) {
            for &i in stopped.iter().rev() {
                let seq = self.running.remove(i);
                self.fail(seq, crate::Error::Internal { message: format!("the draft head failed: {msg}") });
            }
            return true;
        }
        let mut inputs: Vec<Vec<u32>> = Vec::with_capacity(rows.len());
        let mut all_drafts: Vec<Vec<u32>> = Vec::with_capacity(rows.len());
        for (&i, (drafts, _)) in rows.iter().zip(plans) {
            let seq = &mut self.running[i];
            if !drafts.is_empty() && seq.state.has_recurrent() {
                seq.checkpoint = Some(seq.state.checkpoint());
            }
            let mut input = seq.ids[seq.state.len()..].to_vec();
            input.push(seq.pending.expect("filtered"));
            input.extend_from_slice(&drafts);
            inputs.push(input);
            all_drafts.push(drafts);
        }
        let single = inputs.iter().all(|input| input.len() == 1);
        let mut states: Vec<&mut SeqState> =
            self.running.iter_mut().enumerate().filter(|(i, _)| rows.contains(i)).map(|(_, s)| &mut s.state).collect();
        let logits = if single {
            let tokens: Vec<u32> = inputs.iter().map(|input| input[0]).collect();
            self.generator.decode(&tokens, &mut states)
        } else {
            self.generator.extend(&inputs, &mut states)
        }
        .and_then(|l| Ok(l.to_vec2::<f32>()?));
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
        let mut logits = logits.into_iter();
        let mut done = Vec::new();
        for ((&i, input), drafts) in rows.iter().zip(&inputs).zip(all_drafts) {
            // The lead rows fed again (a state taken back) pick nothing.
            let again = input.len() - 1 - drafts.len();
            let mine: VecDeque<Vec<f32>> = logits.by_ref().take(input.len()).skip(again).collect();
            let seq = &mut self.running[i];
            let outcome = seq.take_step(drafts, mine).and_then(|f| seq.draft_sync().map(|()| f));
            if let Some(outcome) = outcome.transpose() {
                done.push((i, outcome));
            }
        }
        self.settle(done);
        true
    }

    /// The model's draft head (`speculative: mtp`), once its decoder is loaded.
    fn head(&self) -> Option<&'f dyn DraftHead> {
        self.generator.draft_head()
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
            draft_tokens: self.steps.drafted as u64,
            accepted_draft_tokens: self.steps.accepted as u64,
            forced_tokens: self.steps.forced as u64,
            ..*st
        };
    }
}

/// Why a request drafting with the model's head is refused by a model without one.
pub(super) fn no_head() -> crate::Error {
    crate::Error::Input {
        what: "speculative".into(),
        message: "`mtp` needs the model's multi-token-prediction head, and this model has none \
                  (Qwen3.5 checkpoints carry one as `mtp.*`; use `draft`, `ngram` or `off`)"
            .into(),
    }
}
