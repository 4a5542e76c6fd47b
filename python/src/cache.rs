//! The executors the binding keeps between calls, so that a training loop's second call of a
//! shape reuses the first one's working set: every op's, in one [`ExecutorCache`] whose
//! reservations are bounded ([`DEFAULT_LIMIT_BYTES`], `flatpeak.torch.set_executor_cache_limit`),
//! visible (`flatpeak.torch.executor_cache_bytes`) and freeable
//! (`flatpeak.torch.clear_executor_cache`).
//!
//! The cache's lock is held only to find or make an entry; a call then runs on the entry's own
//! lock, taken with the GIL released (a thread waiting for it must not hold the GIL the thread
//! inside may need for its collectives). An entry the cache drops while a call runs on it lives
//! until that call ends.

use std::sync::{Arc, Mutex, MutexGuard};

use flatpeak_common::{Device, ExecutorCache, Held};
use pyo3::prelude::*;

/// The default bound on the executors' reservations: 1 GiB (eight CPU loss executors of the
/// default 128 MiB budget, four CUDA ones of 256 MiB).
pub(crate) const DEFAULT_LIMIT_BYTES: usize = 1 << 30;

/// An executor kept between calls.
#[derive(Debug)]
pub(crate) enum Executor {
    /// The loss on one device.
    Loss(ring_dtp::LinearCrossEntropy),
    /// The loss over a ring.
    Ring(ring_dtp::RingLinearCrossEntropy),
    /// The MoE layer.
    Moe(llep::Executor),
}

/// What an entry is kept by.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Key {
    /// The loss on `device` (on the CPU, or on a CUDA stream: `stream`'s address), of `plan`.
    Loss { device: Device, stream: usize, plan: ring_dtp::Plan },
    /// The ring of `plan` on `device` over the group whose handle is `group`.
    Ring { group: usize, device: Device, plan: ring_dtp::RingPlan },
    /// The MoE layer of `plan` on `device`.
    Moe { device: Device, plan: llep::Plan },
}

/// An entry: the executor behind its own lock, and the bytes it reserved.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    executor: Arc<Mutex<Executor>>,
    bytes: usize,
}

impl Held for Shared {
    fn held_bytes(&self) -> usize {
        self.bytes
    }
}

impl Shared {
    /// The executor, locked (call it with the GIL released).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Executor> {
        self.executor.lock().unwrap_or_else(|p| p.into_inner())
    }
}

static CACHE: Mutex<ExecutorCache<Key, Shared>> = Mutex::new(ExecutorCache::new(DEFAULT_LIMIT_BYTES));

fn cache() -> MutexGuard<'static, ExecutorCache<Key, Shared>> {
    CACHE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The entry of `key`, made by `make` (an executor reserving `bytes`) when there is none. Call it
/// with the GIL released.
pub(crate) fn entry<E>(
    key: Key,
    bytes: usize,
    make: impl FnOnce() -> Result<Executor, E>,
) -> Result<Shared, E> {
    let mut cache = cache();
    let made = cache
        .get_or_try_insert(key, bytes, || Ok(Shared { executor: Arc::new(Mutex::new(make()?)), bytes }))?;
    Ok(made.clone())
}

/// Bytes the executors kept between calls reserved (host and device working sets).
#[pyfunction]
pub(crate) fn executor_cache_bytes(py: Python<'_>) -> usize {
    py.detach(|| cache().held_bytes())
}

/// How many executors are kept between calls.
#[pyfunction]
pub(crate) fn cached_executors(py: Python<'_>) -> usize {
    py.detach(|| cache().len())
}

/// Drops every executor kept between calls, and its working set (one a call is running on goes
/// when that call ends).
#[pyfunction]
pub(crate) fn clear_executor_cache(py: Python<'_>) {
    py.detach(|| cache().clear())
}

/// The bound on the executors' reservations, in bytes; the least recently used go first.
#[pyfunction]
pub(crate) fn executor_cache_limit(py: Python<'_>) -> usize {
    py.detach(|| cache().limit_bytes())
}

/// Sets the bound on the executors' reservations (those over it are dropped now).
#[pyfunction]
pub(crate) fn set_executor_cache_limit(py: Python<'_>, limit_bytes: usize) {
    py.detach(|| cache().set_limit_bytes(limit_bytes))
}

/// How many entries `which` accepts.
pub(crate) fn count(py: Python<'_>, which: impl Fn(&Key) -> bool + Send + Sync) -> usize {
    py.detach(|| cache().keys().filter(|k| which(k)).count())
}

/// Drops the entries `which` accepts.
pub(crate) fn drop_where(py: Python<'_>, which: impl Fn(&Key) -> bool + Send + Sync) {
    py.detach(|| cache().retain(|k| !which(k)))
}
