//! `vl run`'s progress bar on a terminal (never in a pipe, nor with `--json`): one line on
//! stderr, the tensors loaded, then each stage the engine reports (media, the vision tower's
//! blocks, prefill), until the answer starts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vl_models::checkpoint::LoadProgress;

/// The bar, when shown, installed as the process's progress observer while this lives.
pub(super) struct Progress {
    bar: Option<Arc<Bar>>,
    _observer: Option<vl_models::progress::Installed>,
    /// What the loader calls as each tensor is loaded.
    pub load: LoadProgress,
}

impl Progress {
    /// A bar when `show`, else nothing said.
    pub fn new(show: bool) -> Self {
        let bar = show.then(|| Arc::new(Bar::new()));
        let observer = bar.clone().map(|b| vl_models::progress::install(b as Arc<dyn vl_models::progress::Observer>));
        let progress_bar = bar.clone();
        let load: LoadProgress = Arc::new(move |_key: &str| {
            if let Some(b) = &progress_bar {
                b.tensor_loaded();
            }
        });
        Progress { bar, _observer: observer, load }
    }

    /// The number of tensors the loading stage counts to.
    pub fn tensors_to_load(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.to_load.store(n, Ordering::Relaxed);
        }
    }

    /// Clears the bar (the answer starts, or the run ended).
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.bar.finish_and_clear();
        }
    }
}

/// The progress bar of `vl run` on a terminal: one line, the stage, its units done and to do.
struct Bar {
    bar: indicatif::ProgressBar,
    stage: Mutex<&'static str>,
    loaded: AtomicU64,
    to_load: AtomicU64,
}

impl Bar {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg:>14} {bar:40} {pos}/{len} {prefix}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Bar { bar, stage: Mutex::new(""), loaded: AtomicU64::new(0), to_load: AtomicU64::new(0) }
    }

    fn tensor_loaded(&self) {
        let done = self.loaded.fetch_add(1, Ordering::Relaxed) + 1;
        let total = self.to_load.load(Ordering::Relaxed).max(done);
        vl_models::progress::Observer::report(self, "loading", "tensors", done, total);
    }
}

impl vl_models::progress::Observer for Bar {
    fn report(&self, stage: &'static str, unit: &'static str, done: u64, total: u64) {
        let Ok(mut current) = self.stage.lock() else { return };
        if *current != stage {
            *current = stage;
            self.bar.set_message(stage);
            self.bar.set_prefix(unit);
        }
        self.bar.set_length(total);
        self.bar.set_position(done);
    }
}
