//! The thread pools a caller sizes (`StreamAdamW(threads=)`): one rayon pool per thread count,
//! made on first use and kept for the process's life, so a rank of a `torchrun` job runs its
//! CPU work on the threads torch was given (`torch.get_num_threads()`), not on every core.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The pool of `threads` threads (≥ 1).
pub(crate) fn pool(threads: usize) -> PyResult<Arc<rayon::ThreadPool>> {
    if threads == 0 {
        return Err(PyValueError::new_err("threads: expected at least 1 thread, got 0"));
    }
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.get(&threads) {
        return Ok(pool.clone());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("flatpeak-{threads}-{i}"))
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("threads: a pool of {threads} threads: {e}")))?;
    let pool = Arc::new(pool);
    pools.insert(threads, pool.clone());
    Ok(pool)
}
