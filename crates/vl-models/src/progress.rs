//! Progress of the stages of an answer (media decoding, the vision tower's blocks, prefill), for a
//! front end that shows it, such as the CLI's bar on a terminal. Process-wide: meant for a front
//! end that answers one request at a time (`vl run`); the server installs no observer. Without
//! one, a report costs a read of an uncontended lock.

use std::sync::{Arc, RwLock};

/// Receives `report(stage, unit, done, total)`: `done` of `total` units of `stage` are done.
pub trait Observer: Send + Sync {
    fn report(&self, stage: &'static str, unit: &'static str, done: u64, total: u64);
}

static OBSERVER: RwLock<Option<Arc<dyn Observer>>> = RwLock::new(None);

/// Installs `observer` until the returned guard is dropped.
pub fn install(observer: Arc<dyn Observer>) -> Installed {
    if let Ok(mut o) = OBSERVER.write() {
        *o = Some(observer);
    }
    Installed(())
}

/// Removes the observer when dropped.
pub struct Installed(());

impl Drop for Installed {
    fn drop(&mut self) {
        if let Ok(mut o) = OBSERVER.write() {
            *o = None;
        }
    }
}

/// Tells the observer, if any, that `done` of `total` units of `stage` are done.
pub fn report(stage: &'static str, unit: &'static str, done: usize, total: usize) {
    let observer = OBSERVER.read().ok().and_then(|o| o.clone());
    if let Some(o) = observer {
        o.report(stage, unit, done as u64, total as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Log(Mutex<Vec<(String, u64, u64)>>);
    impl Observer for Log {
        fn report(&self, stage: &'static str, _: &'static str, done: u64, total: u64) {
            self.0.lock().unwrap().push((stage.into(), done, total));
        }
    }

    #[test]
    fn reports_reach_the_observer_only_while_it_is_installed() {
        let log = Arc::new(Log(Mutex::new(vec![])));
        report("before", "x", 1, 2);
        {
            let _g = install(log.clone());
            report("prefill", "tokens", 3, 10);
        }
        report("after", "x", 1, 2);
        assert_eq!(*log.0.lock().unwrap(), vec![("prefill".to_string(), 3, 10)]);
    }
}
