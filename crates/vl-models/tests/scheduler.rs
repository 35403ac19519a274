//! The scheduler on a stub family with no checkpoint: a hybrid "model" of one attention layer
//! (a KV cache of each position's token) and one recurrent layer (the running sum of the
//! tokens), implemented outside the crate through the public seam (`vl_models::family`). Its
//! next token is `(sum of the tokens so far + their count) % VOCAB`, so every answer has a
//! closed form (`expected`) that the tests compare against, whatever the scheduler did on the
//! way: preemption, forks, waiting for KV memory, cancellation, chunked prefill, prefix reuse
//! through recurrent snapshots. Each step also checks that its two layers agree (the KV rows sum
//! to the recurrent state), so a state cut, copied or restored wrongly fails the answer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{Device, Tensor};
use tokenizers::Tokenizer;
use vl_models::engine::{Engine, EngineOptions, Finish, Request};
use vl_models::family::{Family, Generator, Identity, ImageSizing, PoolInput, Pooled, Pooler, Prepared, Sizing, Task};
use vl_models::media::{Media, MediaContext, VisionOutput};
use vl_models::request::VideoReport;
use vl_models::sampling::GenerationOptions;
use vl_models::state::{LayerState, Recurrent, SeqState};
use vl_models::{Error, Result};

const VOCAB: usize = 32;
/// Bytes of KV one position takes: one layer, one head, dimension 1, f32 keys and values.
const PER_POSITION: usize = 8;
/// Bytes of a sequence's recurrent state (one f32), whatever its length.
const FIXED: usize = 4;
/// Budget room for the recurrent states and their snapshots beside the KV blocks.
const SLACK: usize = 64;

/// What the stub saw, in order, for the tests to assert on.
#[derive(Default)]
struct Log {
    /// (start, end) of every prefill call.
    prefills: Vec<(usize, usize)>,
    /// Rows of every decode step.
    steps: Vec<usize>,
    /// Every call: `Some((start, end))` a prefill, `None` a decode step.
    calls: Vec<Option<(usize, usize)>>,
    /// The first sequence's KV capacity after each decode step.
    capacities: Vec<usize>,
    /// Called (the log unlocked) before each prefill call: a test's wait for its readers.
    gate: Option<Arc<dyn Fn() + Send + Sync>>,
}

struct Stub {
    tokenizer: Tokenizer,
    log: Arc<Mutex<Log>>,
    context: usize,
    /// Slows each decode step, so that requests overlap in time.
    step_delay: Duration,
    decode_calls: AtomicUsize,
}

fn tokenizer() -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..VOCAB).map(|i| (format!("t{i}"), serde_json::json!(i))).collect();
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    });
    Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap()
}

impl Stub {
    fn new(step_delay: Duration) -> (Self, Arc<Mutex<Log>>) {
        let log = Arc::new(Mutex::new(Log::default()));
        let stub = Stub { tokenizer: tokenizer(), log: log.clone(), context: 4096, step_delay, decode_calls: 0.into() };
        (stub, log)
    }

    /// Feeds `tokens` into one sequence's state; returns the logits after the last.
    fn feed(&self, state: &mut SeqState, tokens: &[u32]) -> Result<Vec<f32>> {
        for &t in tokens {
            let kv = state.kv_mut(0)?;
            let row = Tensor::new(&[[[t as f32]]], &Device::Cpu)?;
            let (k, _) = kv.append(&row, &row)?;
            let kv_sum: f32 = k.flatten_all()?.to_vec1::<f32>()?.iter().sum();
            let len = kv.len();
            let r = state.recurrent_mut(1)?;
            let sum = r.tensors.first().map_or(Ok(0.0), |s| s.to_vec1::<f32>().map(|v| v[0]))? + t as f32;
            if r.len() + 1 != len || sum != kv_sum {
                return Err(Error::Internal {
                    message: format!("layers disagree: recurrent {} at {}, KV {kv_sum} at {len}", sum, r.len() + 1),
                });
            }
            r.set(vec![Tensor::new(&[sum], &Device::Cpu)?], len);
        }
        let sum = state.recurrent_mut(1)?.tensors[0].to_vec1::<f32>()?[0] as usize;
        let mut logits = vec![0f32; VOCAB];
        logits[(sum + state.len()) % VOCAB] = 10.0;
        Ok(logits)
    }
}

impl Family for Stub {
    fn task(&self) -> Task<'_> {
        Task::Generate(self)
    }
    fn name(&self) -> &'static str {
        "stub"
    }
    fn context(&self) -> usize {
        self.context
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    fn prepare(&self, req: &Request, _: &MediaContext<'_>) -> Result<Prepared> {
        let options = GenerationOptions { eos_token_ids: vec![], ..req.options.clone() };
        options.validate()?;
        let text = req.prompt.clone().unwrap_or_default();
        let ids: Vec<u32> = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| Error::Input { what: "prompt".into(), message: e.to_string() })?
            .get_ids()
            .to_vec();
        Ok(Prepared {
            options,
            ident: ids.iter().map(|&t| Identity::text(t)).collect(),
            ids,
            media: vec![],
            image_tokens: 0,
            video_tokens: 0,
            videos: vec![],
            images: vec![],
        })
    }
    fn encode(&self, _: &Media) -> Result<VisionOutput> {
        Err(Error::Input { what: "media".into(), message: "the stub has no vision tower".into() })
    }
    fn storage(&self) -> Vec<(String, String, usize)> {
        vec![]
    }
    fn image_sizing(&self, _: usize, _: usize) -> Result<ImageSizing> {
        let none = Sizing { resized: (0, 0), tokens: 0 };
        Ok(ImageSizing { ours: none, checkpoint: none })
    }
    fn checkpoint_video_sizing(&self, _: &VideoReport) -> Option<Sizing> {
        None
    }
}

impl Generator for Stub {
    fn eos_token_ids(&self) -> &[u32] {
        &[]
    }
    fn kv_bytes_per_position(&self) -> usize {
        PER_POSITION
    }
    fn fixed_state_bytes(&self) -> usize {
        FIXED
    }
    fn new_state(&self) -> SeqState {
        SeqState::new(vec![LayerState::Kv(Default::default()), LayerState::Recurrent(Recurrent::default())])
    }
    fn prefill(
        &self,
        ids: &[u32],
        _prompt_len: usize,
        _media: &[Media],
        _features: &[VisionOutput],
        state: &mut SeqState,
        end: usize,
    ) -> Result<Option<Tensor>> {
        let start = state.len();
        let mut log = self.log.lock().unwrap();
        log.prefills.push((start, end));
        log.calls.push(Some((start, end)));
        let gate = log.gate.clone();
        drop(log);
        if let Some(gate) = gate {
            gate();
        }
        let logits = self.feed(state, &ids[start..end])?;
        Ok((end == ids.len()).then(|| Tensor::new(logits.as_slice(), &Device::Cpu)).transpose()?)
    }
    fn decode(&self, tokens: &[u32], states: &mut [&mut SeqState]) -> Result<Tensor> {
        self.decode_calls.fetch_add(1, Ordering::Relaxed);
        let mut log = self.log.lock().unwrap();
        log.steps.push(tokens.len());
        log.calls.push(None);
        drop(log);
        std::thread::sleep(self.step_delay);
        let mut rows = Vec::with_capacity(tokens.len() * VOCAB);
        for (t, s) in tokens.iter().zip(states.iter_mut()) {
            rows.extend(self.feed(s, &[*t])?);
        }
        if let Some(s) = states.first() {
            self.log.lock().unwrap().capacities.push(s.capacity());
        }
        Ok(Tensor::from_vec(rows, (tokens.len(), VOCAB), &Device::Cpu)?)
    }
}

/// The stub's answer to `prompt`, `n` tokens: its definition, step by step.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut all = prompt.to_vec();
    for _ in 0..n {
        let sum: usize = all.iter().map(|&t| t as usize).sum();
        all.push(((sum + all.len()) % VOCAB) as u32);
    }
    all[prompt.len()..].to_vec()
}

fn text(ids: &[u32]) -> String {
    ids.iter().map(|t| format!("t{t}")).collect::<Vec<_>>().join(" ")
}

fn request(prompt: &[u32], max_new_tokens: usize) -> Request {
    Request {
        prompt: Some(text(prompt)),
        options: GenerationOptions { max_new_tokens, ..Default::default() },
        ..Default::default()
    }
}

fn engine(opts: EngineOptions, delay: Duration) -> (Engine, Arc<Mutex<Log>>) {
    let (stub, log) = Stub::new(delay);
    (Engine::from_family(Box::new(stub), opts).unwrap(), log)
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + seed) % VOCAB as u32).collect()
}

#[test]
fn answers_match_the_definition_and_prompts_prefill_in_chunks() {
    let opts = EngineOptions { prefill_chunk: 4, prefix_cache: false, ..Default::default() };
    let (e, log) = engine(opts, Duration::ZERO);
    let p = prompt(10, 3);
    let c = e.generate(&request(&p, 12), &mut |_| true).unwrap();
    assert_eq!(c.token_ids, expected(&p, 12));
    assert_eq!(c.finish, Finish::Length);
    assert_eq!(log.lock().unwrap().prefills, [(0, 4), (4, 8), (8, 10)]);
}

#[test]
fn a_long_prompt_prefills_between_the_decode_steps_of_a_running_answer() {
    let opts = EngineOptions { prefill_chunk: 8, prefix_cache: false, ..Default::default() };
    let (e, log) = engine(opts, Duration::ZERO);
    let (short, long) = (prompt(4, 1), prompt(64, 2));
    let long_done = std::sync::atomic::AtomicBool::new(false);
    let read = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        // The short answer decodes until the long one is answered (then it stops itself): the
        // long prompt always arrives while it runs, however the threads are scheduled.
        let a = s.spawn(|| {
            e.generate(&request(&short, 3000), &mut |_| {
                read.fetch_add(1, Ordering::Relaxed);
                !long_done.load(Ordering::Relaxed)
            })
            .unwrap()
        });
        while log.lock().unwrap().steps.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        // A reader that falls `MAX_UNREAD` pieces behind pauses its answer (by design), and a
        // paused answer takes no decode steps between the chunks. Each chunk of the long prompt
        // waits (10 s at most) until the short answer's reader has its pieces, one a token, so
        // that the interleaving asserted below does not hang on how the threads were scheduled.
        let (r, l) = (read.clone(), log.clone());
        log.lock().unwrap().gate = Some(Arc::new(move || {
            let t0 = std::time::Instant::now();
            while r.load(Ordering::Relaxed) + 2 < l.lock().unwrap().steps.len() && t0.elapsed().as_secs() < 10 {
                std::thread::sleep(Duration::from_micros(100));
            }
        }));
        let b = e.generate(&request(&long, 4), &mut |_| true).unwrap();
        long_done.store(true, Ordering::Relaxed);
        assert_eq!(b.token_ids, expected(&long, 4));
        let a = a.join().unwrap();
        assert_eq!(a.finish, Finish::Cancelled, "the short answer ran out before the long one was answered");
        assert_eq!(a.token_ids, expected(&short, a.token_ids.len()));
    });
    let mut log = log.lock().unwrap();
    log.gate = None;
    let chunks: Vec<usize> =
        log.calls.iter().enumerate().filter(|(_, c)| c.is_some_and(|(s, e)| e - s == 8)).map(|(i, _)| i).collect();
    assert_eq!(chunks.len(), 8, "the 64-token prompt in 8 chunks: {:?}", log.prefills);
    // The running answer decoded between the chunks: no chunk follows another directly.
    for w in chunks.windows(2) {
        assert!(log.calls[w[0] + 1..w[1]].iter().any(Option::is_none), "chunks back to back: {:?}", log.calls);
    }
}

#[test]
fn a_long_answer_grows_its_cache_by_an_eighth_of_its_length_and_by_a_block_when_tight() {
    let capacities = |log: &Mutex<Log>| {
        let mut c = log.lock().unwrap().capacities.clone();
        c.dedup();
        c
    };
    let p = prompt(20, 4);
    // Room to spare: one block at a time up to 512 positions, then an eighth of the length in
    // whole blocks (576 / 8 = 72: two blocks; 1088 / 8 = 136: three).
    let (e, log) = engine(EngineOptions { prefix_cache: false, ..Default::default() }, Duration::ZERO);
    let c = e.generate(&request(&p, 1500), &mut |_| true).unwrap();
    assert_eq!((c.finish, c.token_ids), (Finish::Length, expected(&p, 1500)));
    let mut want: Vec<usize> = (1..=9).map(|b| b * 64).collect();
    want.extend([704, 832, 960, 1088, 1280, 1472, 1664]);
    assert_eq!(capacities(&log), want);
    // Room for 640 positions: at 576 the step (128) does not fit, one block does.
    let opts = EngineOptions { kv_cache_bytes: 640 * PER_POSITION + SLACK, prefix_cache: false, ..Default::default() };
    let (e, log) = engine(opts, Duration::ZERO);
    let c = e.generate(&request(&p, 600), &mut |_| true).unwrap();
    assert_eq!((c.finish, c.token_ids), (Finish::Length, expected(&p, 600)));
    assert_eq!(capacities(&log), (1..=10).map(|b| b * 64).collect::<Vec<_>>());
}

#[test]
fn preemption_recomputes_and_every_answer_stays_exact() {
    // Room for 5 blocks of 64 positions: three choices forked from one prefill (so they run
    // together, whatever the threads do) grow to 150 positions each and cannot all stay, so the
    // latest admitted are preempted and prefilled again later.
    let budget = 5 * 64 * PER_POSITION + SLACK;
    let opts = EngineOptions { kv_cache_bytes: budget, prefix_cache: false, parallel: 3, ..Default::default() };
    let (e, _) = engine(opts, Duration::ZERO);
    let p = prompt(20, 3);
    let answers = e.generate_n(&request(&p, 130), 3, &mut |_, _, _| true).unwrap();
    for c in &answers {
        assert_eq!(c.token_ids, expected(&p, 130));
        assert_eq!(c.finish, Finish::Length);
    }
    let stats = e.stats();
    assert!(stats.preemptions > 0, "no preemption happened: {stats:?}");
}

#[test]
fn drafts_on_a_recurrent_state_are_taken_back_to_the_checkpoint_and_fed_again() {
    // The stub verifies drafts through the seam's default `extend` (one decode step per row);
    // a rejected draft takes its recurrent layer back to the checkpoint before the drafts, and
    // the accepted tokens are fed again: the layers' agreement check and the closed form catch
    // a state restored wrongly. Alone, then three choices preempted under a small budget.
    let spec = vl_models::speculative::Speculative {
        method: vl_models::speculative::Method::Ngram,
        draft_max: 5,
        ngram_min: 1,
        ngram_max: 3,
    };
    let (e, _) = engine(EngineOptions { prefix_cache: false, ..Default::default() }, Duration::ZERO);
    let p = prompt(20, 3);
    let mut req = request(&p, 130);
    req.options.speculative = spec.clone();
    let c = e.generate(&req, &mut |_| true).unwrap();
    assert_eq!(c.token_ids, expected(&p, 130));
    let s = c.steps;
    assert!(s.accepted > 0 && s.drafted > s.accepted, "{s:?}");
    assert!(s.forward_passes < 130, "{s:?}");
    let budget = 5 * 64 * PER_POSITION + SLACK;
    let opts = EngineOptions { kv_cache_bytes: budget, prefix_cache: false, parallel: 3, ..Default::default() };
    let (e, _) = engine(opts, Duration::ZERO);
    for c in e.generate_n(&req, 3, &mut |_, _, _| true).unwrap() {
        assert_eq!(c.token_ids, expected(&p, 130));
    }
    assert!(e.stats().preemptions > 0);
}

#[test]
fn a_prompt_that_can_never_fit_the_kv_budget_is_refused_and_one_that_cannot_fit_now_waits() {
    let opts = EngineOptions { kv_cache_bytes: 64 * PER_POSITION + SLACK, prefix_cache: false, ..Default::default() };
    let (e, log) = engine(opts, Duration::from_millis(2));
    let err = e.generate(&request(&prompt(64, 0), 4), &mut |_| true).unwrap_err();
    assert!(matches!(err, Error::Limit { kind: vl_models::limits::LimitKind::KvCache, .. }), "{err}");
    // Two that fit one at a time: both answer, never decoded together.
    let (a, b) = (prompt(10, 1), prompt(10, 2));
    std::thread::scope(|s| {
        let ha = s.spawn(|| e.generate(&request(&a, 20), &mut |_| true).unwrap());
        let hb = s.spawn(|| e.generate(&request(&b, 20), &mut |_| true).unwrap());
        let (ca, cb) = (ha.join().unwrap(), hb.join().unwrap());
        // Each holds up to 31 positions of one 64-position block; two blocks exceed the budget.
        assert_eq!(ca.token_ids, expected(&a, 20));
        assert_eq!(cb.token_ids, expected(&b, 20));
    });
    assert!(log.lock().unwrap().steps.iter().all(|&rows| rows == 1));
}

#[test]
fn n_choices_fork_one_prefill() {
    let opts = EngineOptions { prefix_cache: false, ..Default::default() };
    let (e, log) = engine(opts, Duration::ZERO);
    let p = prompt(12, 5);
    let all = e.generate_n(&request(&p, 9), 3, &mut |_, _, _| true).unwrap();
    assert_eq!(all.len(), 3);
    for c in &all {
        assert_eq!(c.token_ids, expected(&p, 9));
    }
    let prefilled: usize = log.lock().unwrap().prefills.iter().map(|(s, e)| e - s).sum();
    assert_eq!(prefilled, 12, "the prompt is prefilled once for all three choices");
}

#[test]
fn cancelling_one_answer_leaves_the_others_running() {
    let opts = EngineOptions { prefix_cache: false, ..Default::default() };
    let (e, _) = engine(opts, Duration::from_millis(2));
    let (a, b) = (prompt(6, 1), prompt(6, 2));
    std::thread::scope(|s| {
        let hb = s.spawn(|| e.generate(&request(&b, 60), &mut |_| true).unwrap());
        let mut pieces = 0;
        let ca = e
            .generate(&request(&a, 60), &mut |_| {
                pieces += 1;
                pieces < 5
            })
            .unwrap();
        assert_eq!(ca.finish, Finish::Cancelled);
        assert!(ca.token_ids.len() < 60);
        assert_eq!(ca.token_ids, expected(&a, ca.token_ids.len()));
        let cb = hb.join().unwrap();
        assert_eq!((cb.finish, cb.token_ids), (Finish::Length, expected(&b, 60)));
    });
}

#[test]
fn a_kept_prefix_comes_back_from_the_last_recurrent_snapshot_it_shares() {
    let opts = EngineOptions { prefill_chunk: 4, ..Default::default() };
    let (e, log) = engine(opts, Duration::ZERO);
    let first = prompt(10, 4);
    let c = e.generate(&request(&first, 3), &mut |_| true).unwrap();
    assert_eq!(c.token_ids, expected(&first, 3));
    // Snapshots were kept at 4, 8 and 10 (chunk ends) and 13 (the end). A prompt sharing the
    // first 9 tokens restores the state at 8, not 9: a recurrent state cannot be cut.
    let mut second = first[..9].to_vec();
    second.extend([1, 2, 3]);
    log.lock().unwrap().prefills.clear();
    let c = e.generate(&request(&second, 5), &mut |_| true).unwrap();
    assert_eq!(c.cached_tokens, 8);
    assert_eq!(c.token_ids, expected(&second, 5));
    assert_eq!(log.lock().unwrap().prefills, [(8, 12)]);
    // The conversation goes on: the whole kept state serves the next turn.
    let mut third = second.clone();
    third.extend(&c.token_ids);
    third.extend([7, 7]);
    let c = e.generate(&request(&third, 2), &mut |_| true).unwrap();
    // What the kept state holds: the prompt and the 4 answer tokens fed (the 5th was picked,
    // never fed).
    assert_eq!(c.cached_tokens, second.len() + 4);
    assert_eq!(c.token_ids, expected(&third, 2));
}

/// The same stub as a pooling model: each prompt becomes [sum of its tokens, its length], or (as
/// a reranker) one score, their ratio. It counts its calls and the rows of each.
struct StubPooler {
    inner: Stub,
    score: bool,
    /// Prompts in each pooling call, and the prefix ends of each prefix prefill.
    batches: Arc<Mutex<Vec<usize>>>,
    prefixes: Arc<Mutex<Vec<Vec<usize>>>>,
}

impl Family for StubPooler {
    fn name(&self) -> &'static str {
        "stub-pooler"
    }
    fn context(&self) -> usize {
        self.inner.context
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn tokenizer(&self) -> &Tokenizer {
        &self.inner.tokenizer
    }
    fn task(&self) -> Task<'_> {
        Task::Pool(self)
    }
    fn prepare(&self, req: &Request, ctx: &MediaContext<'_>) -> Result<Prepared> {
        self.inner.prepare(req, ctx)
    }
    fn encode(&self, m: &Media) -> Result<VisionOutput> {
        self.inner.encode(m)
    }
    fn storage(&self) -> Vec<(String, String, usize)> {
        vec![]
    }
    fn image_sizing(&self, w: usize, h: usize) -> Result<ImageSizing> {
        self.inner.image_sizing(w, h)
    }
    fn checkpoint_video_sizing(&self, v: &VideoReport) -> Option<Sizing> {
        self.inner.checkpoint_video_sizing(v)
    }
}

impl Pooler for StubPooler {
    fn pooled(&self) -> Pooled {
        if self.score {
            Pooled::Score
        } else {
            Pooled::Embedding { dims: 2 }
        }
    }
    fn new_state(&self) -> SeqState {
        Generator::new_state(&self.inner)
    }
    fn kv_bytes_per_position(&self) -> usize {
        PER_POSITION
    }
    fn prefill(&self, inputs: &[PoolInput<'_>], states: &mut [&mut SeqState], ends: &[usize]) -> Result<()> {
        self.prefixes.lock().unwrap().push(ends.to_vec());
        for ((i, s), &end) in inputs.iter().zip(states.iter_mut()).zip(ends) {
            let start = s.len();
            self.inner.feed(s, &i.ids[start..end])?;
        }
        Ok(())
    }
    // Its rows come from the state: a kept prefix that is not the prompt's start shows.
    fn pool(&self, inputs: &[PoolInput<'_>], states: &mut [&mut SeqState]) -> Result<Vec<Vec<f32>>> {
        self.batches.lock().unwrap().push(inputs.len());
        inputs
            .iter()
            .zip(states.iter_mut())
            .map(|(i, s)| {
                let start = s.len();
                self.inner.feed(s, &i.ids[start..])?;
                let sum = s.recurrent_mut(1)?.tensors[0].to_vec1::<f32>()?[0];
                let len = s.len() as f32;
                Ok(if self.score { vec![sum / len] } else { vec![sum, len] })
            })
            .collect()
    }
}

fn pooler(score: bool) -> (Engine, Arc<Mutex<Vec<usize>>>) {
    let (e, batches, _) = pooler_with(score, EngineOptions::default());
    (e, batches)
}

type Shared<T> = Arc<Mutex<Vec<T>>>;

fn pooler_with(score: bool, opts: EngineOptions) -> (Engine, Shared<usize>, Shared<Vec<usize>>) {
    let (batches, prefixes) = (Arc::new(Mutex::new(vec![])), Arc::new(Mutex::new(vec![])));
    let stub =
        StubPooler { inner: Stub::new(Duration::ZERO).0, score, batches: batches.clone(), prefixes: prefixes.clone() };
    (Engine::from_family(Box::new(stub), opts).unwrap(), batches, prefixes)
}

#[test]
fn prompts_that_share_a_prefix_are_pooled_from_one_prefill_of_it() {
    // Five prompts: a 12-position head, then tails of their own.
    let head: Vec<u32> = (1..13).collect();
    let prompts: Vec<Vec<u32>> = (0..5u32).map(|i| [head.clone(), vec![20 + i; 1 + i as usize]].concat()).collect();
    let want = |p: &[u32]| vec![p.iter().sum::<u32>() as f32, p.len() as f32];
    let reqs: Vec<Request> = prompts.iter().map(|p| request(p, 1)).collect();
    let (e, batches, prefixes) = pooler_with(false, EngineOptions::default());
    let out = e.pool(&reqs).unwrap();
    // The longest carried the head (it is charged for it); the other four were served it.
    for (i, (o, p)) in out.iter().zip(&prompts).enumerate() {
        assert_eq!(o.values, want(p));
        assert_eq!(o.cached_tokens, if i == 4 { 0 } else { 12 }, "prompt {i}");
    }
    // The head prefilled once, then the five tails in one call.
    assert_eq!(*prefixes.lock().unwrap(), [vec![12]]);
    assert_eq!(*batches.lock().unwrap(), [5]);
    // A later prompt with the head is served from the kept prefix, with no prefix prefill.
    let later = [head.clone(), vec![25, 26]].concat();
    let out = e.pool(&[request(&later, 1)]).unwrap();
    assert_eq!((out[0].values.clone(), out[0].cached_tokens), (want(&later), 12));
    assert_eq!(prefixes.lock().unwrap().len(), 1);
    // A prompt alone that shares a prefix with a recent one: kept for the next.
    let other: Vec<u32> = (13..28).collect();
    let (a, b, c) = ([other.clone(), vec![1]].concat(), [other.clone(), vec![2]].concat(), [other, vec![3]].concat());
    assert_eq!(e.pool(&[request(&a, 1)]).unwrap()[0].cached_tokens, 0);
    let out = e.pool(&[request(&b, 1)]).unwrap();
    assert_eq!((out[0].values.clone(), out[0].cached_tokens), (want(&b), 0));
    assert_eq!(prefixes.lock().unwrap().last(), Some(&vec![15]));
    let out = e.pool(&[request(&c, 1)]).unwrap();
    assert_eq!((out[0].values.clone(), out[0].cached_tokens), (want(&c), 15));
    assert_eq!(prefixes.lock().unwrap().len(), 2);
    // Without the prefix cache: the same rows, every prompt prefilled whole.
    let opts = EngineOptions { prefix_cache: false, ..Default::default() };
    let (e, _, prefixes) = pooler_with(false, opts);
    let out = e.pool(&reqs).unwrap();
    for (o, p) in out.iter().zip(&prompts) {
        assert_eq!((o.values.clone(), o.cached_tokens), (want(p), 0));
    }
    assert!(prefixes.lock().unwrap().is_empty());
}

#[test]
fn a_pooling_model_pools_in_batches_and_refuses_to_generate() {
    let (e, batches) = pooler(false);
    assert_eq!(e.pooled(), Some(Pooled::Embedding { dims: 2 }));
    let reqs: Vec<Request> = (0..3).map(|i| request(&prompt(5 + i, i as u32), 1)).collect();
    let out = e.pool(&reqs).unwrap();
    // One caller's prompts go through the model in one call.
    assert_eq!(*batches.lock().unwrap(), [3]);
    for (i, o) in out.iter().enumerate() {
        let p = prompt(5 + i, i as u32);
        assert_eq!(o.values, [p.iter().sum::<u32>() as f32, p.len() as f32]);
        assert_eq!(o.prompt_tokens, p.len());
    }
    // Callers at once share calls: 6 callers' prompts in fewer than 6 calls.
    batches.lock().unwrap().clear();
    std::thread::scope(|s| {
        for i in 0..6u32 {
            let e = &e;
            s.spawn(move || {
                let p = prompt(8, i);
                let out = e.pool(&[request(&p, 1)]).unwrap();
                assert_eq!(out[0].values[0], p.iter().sum::<u32>() as f32);
            });
        }
    });
    // Every prompt pooled once (how callers share calls depends on their timing: not asserted).
    assert_eq!(batches.lock().unwrap().iter().sum::<usize>(), 6);
    // It writes no text; a generating model pools nothing.
    let err = e.generate(&request(&[1, 2], 3), &mut |_| true).unwrap_err();
    assert!(err.to_string().contains("is an embedding model: it pools prompts"), "{err}");
    let (g, _) = engine(EngineOptions::default(), Duration::ZERO);
    assert_eq!(g.pooled(), None);
    let err = g.pool(&[request(&[1], 1)]).unwrap_err();
    assert!(err.to_string().contains("generates text and does not pool"), "{err}");
    let (r, _) = pooler(true);
    assert_eq!(r.pool(&[request(&[2, 4], 1)]).unwrap()[0].values, [3.0]);
}
