//! Who runs a CPU pass's independent jobs: rayon's current pool by default, or a [`Team`] the
//! caller installs for the duration of a call.
//!
//! A library embedded in a runtime that has its own worker threads (torch's OpenMP team) runs
//! beside them when it uses its own pool: on a machine whose cores those workers fill, the
//! workers that spin-wait after the runtime's last parallel region take cores from the pool's
//! threads for the first milliseconds of the pass (measured on 2 cores: a 64M-parameter AdamW
//! step took 36 ms right after an OpenMP step and 28 ms after one of its own). Installing the
//! runtime's team with [`with_team`] runs the pass on those very threads instead. The jobs and
//! the result are the same whoever runs them: a pass splits its work into jobs of fixed bounds
//! and combines their results in job order, so it is deterministic for any team and any thread
//! count.
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use flatpeak_common::team::{Team, for_each_job, with_team};
//!
//! /// Runs every job on the calling thread (a team of one).
//! struct Inline;
//! impl Team for Inline {
//!     fn run(&self, jobs: usize, job: &(dyn Fn(usize) + Sync)) {
//!         (0..jobs).for_each(job)
//!     }
//! }
//! let sum = AtomicUsize::new(0);
//! with_team(&Inline, || for_each_job(100, &|i| { sum.fetch_add(i, Ordering::Relaxed); }));
//! assert_eq!(sum.into_inner(), 4950);
//! ```

use std::cell::Cell;

use rayon::prelude::*;

/// A set of threads that runs jobs in parallel.
pub trait Team: Sync {
    /// Runs `job(i)` exactly once for every `i` in `0..jobs`, in parallel, and returns when every
    /// call has returned. A panicking job's panic is resumed on the caller once all have ended.
    fn run(&self, jobs: usize, job: &(dyn Fn(usize) + Sync));
}

thread_local! {
    /// The team [`with_team`] installed on this thread, lifetime erased (see `with_team`).
    static CURRENT: Cell<Option<*const (dyn Team + 'static)>> = const { Cell::new(None) };
}

/// Runs `f` with `team` as the team of every [`for_each_job`] that `f` calls on this thread
/// (jobs running on the team's threads use rayon's pool for any nested pass).
pub fn with_team<R>(team: &dyn Team, f: impl FnOnce() -> R) -> R {
    /// Puts the previous team back, also when `f` panics.
    struct Restore(Option<*const (dyn Team + 'static)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    // SAFETY: only the lifetime is erased. The pointer is read by `for_each_job` on this thread
    // alone (a thread-local), and only while `with_team` is on this thread's stack: `Restore`
    // puts the previous value back before `team`'s borrow ends, on return and on unwind.
    let erased: *const (dyn Team + 'static) = unsafe { std::mem::transmute(team as *const dyn Team) };
    let _restore = Restore(CURRENT.with(|c| c.replace(Some(erased))));
    f()
}

/// Runs `job(i)` for every `i` in `0..jobs` in parallel: on the team [`with_team`] installed on
/// this thread, else on rayon's current pool.
pub fn for_each_job(jobs: usize, job: &(dyn Fn(usize) + Sync)) {
    match CURRENT.with(Cell::get) {
        // SAFETY: set by `with_team` on this thread, whose frame (and so `team`'s borrow) is
        // still live: it resets the cell before returning.
        Some(team) => unsafe { &*team }.run(jobs, job),
        None => (0..jobs).into_par_iter().for_each(job),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Records which jobs it ran.
    struct Recording(Mutex<Vec<usize>>);
    impl Team for Recording {
        fn run(&self, jobs: usize, job: &(dyn Fn(usize) + Sync)) {
            for i in 0..jobs {
                self.0.lock().unwrap().push(i);
                job(i);
            }
        }
    }

    #[test]
    fn the_installed_team_runs_every_job_once_and_is_removed_after() {
        let team = Recording(Mutex::new(Vec::new()));
        let hits: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
        with_team(&team, || {
            for_each_job(37, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            })
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        assert_eq!(*team.0.lock().unwrap(), (0..37).collect::<Vec<_>>());
        // Outside `with_team`, rayon runs them.
        for_each_job(5, &|_| ());
        assert_eq!(team.0.lock().unwrap().len(), 37);
    }

    #[test]
    fn a_panic_inside_leaves_no_team_installed() {
        let team = Recording(Mutex::new(Vec::new()));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_team(&team, || for_each_job(3, &|i| assert!(i < 1, "job {i}")))
        }));
        assert!(caught.is_err());
        for_each_job(4, &|_| ());
        assert_eq!(team.0.lock().unwrap().len(), 2); // jobs 0 and 1 (which panicked) only
    }
}
