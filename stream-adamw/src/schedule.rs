//! Executing a step's copies and updates on the CPU fallback: the serial baseline and the
//! bucket pipeline (a D2H engine thread, the Adam stage on the calling thread's rayon pool, an
//! H2D engine thread), coordinated by per-stage completion counters. Stages only wait on what
//! they need: D2H(k) on the Adam of the bucket that last used its grad slot, Adam(k) on D2H(k)
//! and on the H2D that last drained its param slot, H2D(k) on Adam(k).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::StepScalars;
use crate::cpu::{ParamSink, adamw_update};
use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::host::HostDevice;
use crate::plan::Plan;
use crate::state::OptimizerState;

/// Pinned-host staging of the plan: `staged_slots` slots per direction, allocated once.
#[derive(Debug)]
pub(crate) struct Staging<G, P> {
    grads: Vec<Mutex<Vec<G>>>,
    params: Vec<Mutex<Vec<P>>>,
}

impl<G: GradElement, P: ParamElement> Staging<G, P> {
    pub(crate) fn new(plan: &Plan) -> Self {
        let slots = plan.staged_slots();
        Self {
            grads: (0..slots).map(|_| Mutex::new(vec![G::zeroed(); plan.slot_elems()])).collect(),
            params: (0..slots).map(|_| Mutex::new(vec![P::zeroed(); plan.slot_elems()])).collect(),
        }
    }
}

impl<G: GradElement, P: ParamElement> Staging<G, P> {
    /// Heap bytes of the slots (and of the two small vectors holding them).
    pub(crate) fn heap_bytes(&self) -> usize {
        let slot = |v: &Mutex<Vec<G>>| lock(v).capacity() * std::mem::size_of::<G>();
        let pslot = |v: &Mutex<Vec<P>>| lock(v).capacity() * std::mem::size_of::<P>();
        self.grads.capacity() * std::mem::size_of::<Mutex<Vec<G>>>()
            + self.params.capacity() * std::mem::size_of::<Mutex<Vec<P>>>()
            + self.grads.iter().map(slot).sum::<usize>()
            + self.params.iter().map(pslot).sum::<usize>()
    }
}

/// Busy time of each stage over one step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StageTimes {
    /// The gradient statistics pass (norm and non-finite check).
    pub stats: Duration,
    /// Sum of D2H copy times.
    pub d2h: Duration,
    /// Sum of Adam times.
    pub adam: Duration,
    /// Sum of H2D copy times.
    pub h2d: Duration,
    /// Wall time of the whole step.
    pub total: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Default)]
struct Counters {
    d2h: usize,
    adam: usize,
    h2d: usize,
    failed: Option<&'static str>,
}

/// Completion counters of the three stages (buckets complete in order within a stage).
#[derive(Debug, Default)]
struct Progress {
    counters: Mutex<Counters>,
    changed: Condvar,
}

impl Progress {
    fn wait(&self, ready: impl Fn(&Counters) -> bool) -> Result<()> {
        let mut c = lock(&self.counters);
        while !ready(&c) {
            if let Some(stage) = c.failed {
                return Err(Error::PipelineStage { stage, reason: "another stage stopped".into() });
            }
            c = self.changed.wait(c).unwrap_or_else(|p| p.into_inner());
        }
        Ok(())
    }
    fn advance(&self, bump: impl FnOnce(&mut Counters)) {
        bump(&mut lock(&self.counters));
        self.changed.notify_all();
    }
}

/// Marks the pipeline failed when a stage ends without finishing (an error or a panic), so the
/// other stages stop waiting instead of hanging.
struct StageGuard<'a> {
    progress: &'a Progress,
    stage: &'static str,
    finished: bool,
}

impl<'a> StageGuard<'a> {
    fn new(progress: &'a Progress, stage: &'static str) -> Self {
        Self { progress, stage, finished: false }
    }
    fn finish(mut self, busy: Duration) -> Result<Duration> {
        self.finished = true;
        Ok(busy)
    }
}

impl Drop for StageGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            lock(&self.progress.counters).failed.get_or_insert(self.stage);
            self.progress.changed.notify_all();
        }
    }
}

/// Serial offload: all gradients down, Adam over everything, all parameters up.
pub(crate) fn run_serial<G: GradElement, P: ParamElement>(
    state: &mut OptimizerState,
    staging: &Staging<G, P>,
    device: &mut HostDevice<G, P>,
    scalars: &StepScalars,
    times: &mut StageTimes,
) {
    let (mut grads, mut params) = (lock(&staging.grads[0]), lock(&staging.params[0]));
    let n = state.len();
    times.d2h += device.link.copy(&device.grads, &mut grads[..n]);
    let start = Instant::now();
    adamw_update(state.view(0..n), &grads[..n], ParamSink::Copy(&mut params[..n]), scalars);
    times.adam += start.elapsed();
    times.h2d += device.link.copy(&params[..n], &mut device.params);
}

/// The bucket pipeline.
pub(crate) fn run_pipelined<G: GradElement, P: ParamElement>(
    plan: &Plan,
    state: &mut OptimizerState,
    staging: &Staging<G, P>,
    device: &mut HostDevice<G, P>,
    scalars: &StepScalars,
    times: &mut StageTimes,
) -> Result<()> {
    let (buckets, slots) = (plan.n_buckets(), plan.staged_slots());
    let progress = Progress::default();
    let link = device.link;
    let (device_grads, device_params) = (&device.grads, &mut device.params);
    let (d2h, h2d, adam) = std::thread::scope(|scope| {
        let d2h_engine = scope.spawn(|| -> Result<Duration> {
            let guard = StageGuard::new(&progress, "d2h");
            let mut busy = Duration::ZERO;
            for k in 0..buckets {
                progress.wait(|c| c.adam + slots > k)?; // grad slot drained by Adam(k − R)
                let range = plan.bucket(k);
                let mut slot = lock(&staging.grads[k % slots]);
                busy += link.copy(&device_grads[range.clone()], &mut slot[..range.len()]);
                drop(slot);
                progress.advance(|c| c.d2h += 1);
            }
            guard.finish(busy)
        });
        let h2d_engine = scope.spawn(|| -> Result<Duration> {
            let guard = StageGuard::new(&progress, "h2d");
            let mut busy = Duration::ZERO;
            for k in 0..buckets {
                progress.wait(|c| c.adam > k)?;
                let range = plan.bucket(k);
                let slot = lock(&staging.params[k % slots]);
                busy += link.copy(&slot[..range.len()], &mut device_params[range.clone()]);
                drop(slot);
                progress.advance(|c| c.h2d += 1);
            }
            guard.finish(busy)
        });
        let adam = (|| -> Result<Duration> {
            let guard = StageGuard::new(&progress, "adam");
            let mut busy = Duration::ZERO;
            for k in 0..buckets {
                // Gradients landed, and the param slot's previous bucket went up.
                progress.wait(|c| c.d2h > k && c.h2d + slots > k)?;
                let range = plan.bucket(k);
                let (grads, mut params) = (lock(&staging.grads[k % slots]), lock(&staging.params[k % slots]));
                let start = Instant::now();
                let sink = ParamSink::Copy(&mut params[..range.len()]);
                adamw_update(state.view(range.clone()), &grads[..range.len()], sink, scalars);
                busy += start.elapsed();
                drop((grads, params));
                progress.advance(|c| c.adam += 1);
            }
            guard.finish(busy)
        })();
        let join = |h: std::thread::ScopedJoinHandle<'_, Result<Duration>>, stage| {
            h.join().unwrap_or_else(|_| {
                Err(Error::PipelineStage { stage, reason: "copy engine panicked".into() })
            })
        };
        (join(d2h_engine, "d2h"), join(h2d_engine, "h2d"), adam)
    });
    times.d2h += d2h?;
    times.adam += adam?;
    times.h2d += h2d?;
    Ok(())
}
