//! The threads a caller sizes (`StreamAdamW(threads=)`), so a rank of a `torchrun` job runs its
//! CPU work on the threads torch was given (`torch.get_num_threads()`), not on every core:
//! torch's own OpenMP team when the process has one (`GOMP_parallel`, exported by GNU libgomp
//! and LLVM libomp alike, found in the process as torch loaded it), else one rayon pool per
//! thread count, made on first use and kept for the process's life.
//!
//! Why torch's team: its workers spin-wait after each of torch's parallel regions (for
//! milliseconds, by default), so a pool of our own beside them shares the cores with spinning
//! threads at the start of every step that follows a torch op. Measured on a 2-core machine
//! (`python/bench/bench_adamw.py`'s setting, 64M parameters): the step took 28 ms after one of its
//! own and 36 ms right after DeepSpeed's (an OpenMP step), 28.6 ms after that step and 20 ms of
//! sleep. Run as jobs of torch's team, the spinning threads are the ones that do the work.

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// Where a call's CPU passes run.
pub(crate) enum Workers {
    /// torch's OpenMP team, `threads` of it.
    OpenMp(OpenMpTeam),
    /// A rayon pool of ours.
    Rayon(Arc<rayon::ThreadPool>),
}

impl Workers {
    /// `threads` threads (≥ 1): torch's OpenMP team when the process has one, else a pool.
    pub(crate) fn new(threads: usize) -> PyResult<Self> {
        if threads == 0 {
            return Err(PyValueError::new_err("threads: expected at least 1 thread, got 0"));
        }
        Ok(match gomp_parallel() {
            Some(parallel) => Workers::OpenMp(OpenMpTeam { parallel, threads }),
            None => Workers::Rayon(pool(threads)?),
        })
    }

    /// Runs `f` with its CPU passes on these workers.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            Workers::OpenMp(team) => flatpeak_common::team::with_team(team, f),
            Workers::Rayon(pool) => pool.install(f),
        }
    }
}

/// libgomp's entry to a parallel region (what `#pragma omp parallel` compiles to): every thread
/// of a team of `num_threads` (the caller being thread 0) runs `f(data)`, and it returns when all
/// have. `flags` 0: no proc_bind request.
type GompParallel = unsafe extern "C" fn(
    f: extern "C" fn(*mut c_void),
    data: *mut c_void,
    num_threads: c_uint,
    flags: c_uint,
);

/// `GOMP_parallel` as loaded in this process (by torch), if it is.
fn gomp_parallel() -> Option<GompParallel> {
    static FOUND: OnceLock<Option<usize>> = OnceLock::new();
    let address = *FOUND.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: dlsym with RTLD_DEFAULT searches the libraries already loaded globally (as
            // torch loads libgomp) and returns null when none defines the name; the name is a
            // NUL-terminated C string literal.
            let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr()) };
            (!symbol.is_null()).then_some(symbol as usize)
        }
        #[cfg(not(unix))]
        {
            None
        }
    });
    // SAFETY: a non-null address of `GOMP_parallel`, whose C signature (libgomp's ABI, also
    // LLVM libomp's compatibility entry) is `GompParallel`'s.
    address.map(|a| unsafe { std::mem::transmute::<usize, GompParallel>(a) })
}

/// torch's OpenMP team as a [`Team`](flatpeak_common::team::Team): each team thread takes job
/// indices from a shared counter until none are left (dynamic scheduling, so a thread that
/// started late takes fewer).
pub(crate) struct OpenMpTeam {
    parallel: GompParallel,
    threads: usize,
}

/// What the team's threads share during one `run`.
struct Shared<'a> {
    next: AtomicUsize,
    jobs: usize,
    job: &'a (dyn Fn(usize) + Sync),
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// Each team thread's body: jobs until none are left; a panic is kept for the caller (it must
/// not unwind into C), and the other jobs still run.
extern "C" fn team_thread(data: *mut c_void) {
    // SAFETY: `data` is the `Shared` that `OpenMpTeam::run` passed to `GOMP_parallel`, alive on
    // its stack until `GOMP_parallel` returns, which is after every team thread has returned.
    let shared = unsafe { &*(data as *const Shared<'_>) };
    loop {
        let i = shared.next.fetch_add(1, Ordering::Relaxed);
        if i >= shared.jobs {
            break;
        }
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (shared.job)(i))) {
            shared.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(panic);
        }
    }
}

impl flatpeak_common::team::Team for OpenMpTeam {
    fn run(&self, jobs: usize, job: &(dyn Fn(usize) + Sync)) {
        if jobs == 0 {
            return;
        }
        let shared = Shared { next: AtomicUsize::new(0), jobs, job, panic: Mutex::new(None) };
        let threads = self.threads.min(jobs).min(c_uint::MAX as usize) as c_uint;
        // SAFETY: `team_thread` is a C-ABI function that does not unwind (it catches every
        // panic); `shared` outlives the call, which returns only after all team threads have
        // returned from `team_thread`.
        unsafe { (self.parallel)(team_thread, &shared as *const Shared<'_> as *mut c_void, threads, 0) };
        if let Some(panic) = shared.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            std::panic::resume_unwind(panic);
        }
    }
}
