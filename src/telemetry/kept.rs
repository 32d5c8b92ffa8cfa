//! Metric handles kept for the updates every record makes. `counter!`, `gauge!` and
//! `histogram!` look their series up in the recorder's registry at each update: the name and
//! labels hashed, a label made per call (a partition, a model) allocated, the key copied into
//! the registry's form. The worker's zero-latency profile put about 5 % of a record's
//! instructions there (P3 in docs/BENCHMARKS.md). A kept handle is the same series, looked up
//! once per label value.
//!
//! Handles are kept only once the process's recorder is installed ([`recording`]). A handle
//! looked up before that is the no-op recorder's, and kept it would stay silent for the rest
//! of the process; a process runs its parts before it serves `/metrics` only in tests, but
//! there it does. For the same reason a thread's own recorder (`metrics::with_local_recorder`)
//! does not see kept handles' updates once the global one is installed.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, PoisonError, RwLock};

static RECORDING: AtomicBool = AtomicBool::new(false);

/// Says the process's recorder is installed: handles looked up from now on are kept.
pub fn recording() {
    RECORDING.store(true, Ordering::Release);
}

/// The handles of one metric, one per value of its label: a small set, as every label of a
/// series must be (a partition, a model, a variant of a closed set; `()` for none).
pub struct Kept<K, H> {
    handles: LazyLock<RwLock<HashMap<K, H>>>,
}

impl<K: Eq + Hash, H: Clone> Kept<K, H> {
    pub const fn new() -> Self {
        Self {
            handles: LazyLock::new(|| RwLock::new(HashMap::new())),
        }
    }

    /// The handle for `label`: the kept one, else `make`'s (kept once the recorder is
    /// installed).
    pub fn get<Q>(&self, label: &Q, make: impl FnOnce() -> H) -> H
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if !RECORDING.load(Ordering::Acquire) {
            return make();
        }
        // A poisoned lock only means a panic elsewhere; the handles stay usable.
        if let Some(handle) = self
            .handles
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(label)
        {
            return handle.clone();
        }
        let handle = make();
        self.handles
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(label.to_owned())
            .or_insert(handle)
            .clone()
    }
}

impl<H: Clone> Kept<(), H> {
    /// The handle of a metric without labels.
    pub fn one(&self, make: impl FnOnce() -> H) -> H {
        self.get(&(), make)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn a_handle_is_made_once_per_label_once_recording_and_every_time_before() {
        static KEPT: Kept<String, usize> = Kept::new();
        let made = Cell::new(0);
        let make = || {
            made.set(made.get() + 1);
            made.get()
        };
        // No recorder yet in this test binary's view: nothing is kept.
        if !RECORDING.load(Ordering::Acquire) {
            assert_eq!(KEPT.get("a", make), 1);
            assert_eq!(KEPT.get("a", make), 2);
            made.set(0);
        }
        recording();
        let first = KEPT.get("a", make);
        assert_eq!(KEPT.get("a", make), first, "kept");
        let other = KEPT.get("b", make);
        assert_ne!(other, first, "one handle per label");
        assert_eq!(KEPT.get("b", make), other);
        assert_eq!(made.get(), 2);
    }
}
