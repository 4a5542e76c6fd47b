//! The CPU fallback's copy engines and staging: a D2H and an H2D engine thread, fed in issue
//! order by the schedule of `pipeline.rs` (the one the CUDA path runs), with per-stage
//! completion counters the schedule waits on; Adam runs on the calling thread's rayon pool.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ScopedJoinHandle;
use std::time::Duration;

use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::host::HostDevice;
use crate::hyperparameters::StepScalars;
use crate::pipeline::{CopyEngines, FaultPoints, Staged, StepState, injected, run_step};
use crate::plan::Plan;
use crate::step::StageTimes;

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Default)]
struct Counters {
    d2h: usize,
    h2d: usize,
    failed: Option<&'static str>,
}

/// Completion counters of the two copy engines (jobs complete in order within an engine).
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

/// The CPU fallback's copy engines: a D2H and an H2D thread, each taking its jobs in issue
/// order from a channel and counting them done in [`Progress`].
struct HostEngines<'scope, 'a, G, P> {
    staging: &'a Staging<G, P>,
    progress: &'a Progress,
    d2h: Option<Sender<Staged>>,
    h2d: Option<Sender<Staged>>,
    threads: Option<[ScopedJoinHandle<'scope, Result<Duration>>; 2]>,
    /// Copies issued per direction, and per slot the count up to its latest copy (0: none yet).
    issued: [usize; 2],
    slot_copy: [Vec<usize>; 2],
}

/// Which way a copy goes (the index of its engine's counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    D2h = 0,
    H2d = 1,
}

impl Direction {
    /// The stage name its errors carry.
    fn stage(self) -> &'static str {
        match self {
            Self::D2h => "d2h",
            Self::H2d => "h2d",
        }
    }
}

impl<G: GradElement, P: ParamElement> HostEngines<'_, '_, G, P> {
    fn issue(&mut self, direction: Direction, bucket: Staged) -> Result<()> {
        let slot = bucket.slot;
        let sender = match direction {
            Direction::D2h => &self.d2h,
            Direction::H2d => &self.h2d,
        };
        let stopped =
            || Error::PipelineStage { stage: direction.stage(), reason: "copy engine stopped".into() };
        sender.as_ref().ok_or_else(stopped)?.send(bucket).map_err(|_| stopped())?;
        let d = direction as usize;
        self.issued[d] += 1;
        self.slot_copy[d][slot] = self.issued[d];
        Ok(())
    }

    fn wait(&self, direction: Direction, slot: usize) -> Result<()> {
        let copy = self.slot_copy[direction as usize][slot];
        self.progress.wait(|c| match direction {
            Direction::D2h => c.d2h >= copy,
            Direction::H2d => c.h2d >= copy,
        })
    }
}

impl<G: GradElement, P: ParamElement> CopyEngines for HostEngines<'_, '_, G, P> {
    type Grad = G;
    type Param = P;

    fn start_d2h(&mut self, bucket: Staged) -> Result<()> {
        self.issue(Direction::D2h, bucket)
    }
    fn wait_d2h(&mut self, slot: usize) -> Result<()> {
        self.wait(Direction::D2h, slot)
    }
    fn start_h2d(&mut self, bucket: Staged) -> Result<()> {
        self.issue(Direction::H2d, bucket)
    }
    fn wait_h2d(&mut self, slot: usize) -> Result<()> {
        self.wait(Direction::H2d, slot)
    }

    fn with_staged<R>(&mut self, bucket: &Staged, f: impl FnOnce(&[G], &mut [P]) -> R) -> Result<R> {
        let slot = bucket.slot;
        let (grads, mut params) = (lock(&self.staging.grads[slot]), lock(&self.staging.params[slot]));
        let len = bucket.elements.len();
        Ok(f(&grads[..len], &mut params[..len]))
    }

    fn finish(&mut self) -> Result<(Duration, Duration)> {
        // Closing the channels ends the engines once they have done every job.
        self.d2h = None;
        self.h2d = None;
        let Some([d2h, h2d]) = self.threads.take() else { return Ok((Duration::ZERO, Duration::ZERO)) };
        let join = |h: ScopedJoinHandle<'_, Result<Duration>>, stage| {
            h.join().unwrap_or_else(|_| {
                Err(Error::PipelineStage { stage, reason: "copy engine panicked".into() })
            })
        };
        let (d2h, h2d) = (join(d2h, "d2h"), join(h2d, "h2d"));
        Ok((d2h?, h2d?))
    }
}

/// One copy engine: takes its buckets in order, copies each over `link`, counts it done; its
/// busy time.
fn engine(
    direction: Direction,
    buckets: Receiver<Staged>,
    progress: &Progress,
    mut copy: impl FnMut(Staged) -> Result<Duration>,
) -> Result<Duration> {
    let guard = StageGuard::new(progress, direction.stage());
    let mut busy = Duration::ZERO;
    for bucket in buckets {
        // A failing copy ends the engine: the guard marks the stage failed and every wait on it
        // returns an error instead of hanging.
        busy += copy(bucket)?;
        progress.advance(|c| match direction {
            Direction::D2h => c.d2h += 1,
            Direction::H2d => c.h2d += 1,
        });
    }
    guard.finish(busy)
}

/// Runs `plan`'s schedule ([`run_step`]) on the CPU fallback's device: the copy engines are two
/// threads for the length of the step.
pub(crate) fn run_host<G: GradElement, P: ParamElement>(
    plan: &Plan,
    faults: &FaultPoints,
    state: StepState<'_>,
    staging: &Staging<G, P>,
    device: &mut HostDevice<G, P>,
    scalars: &StepScalars,
    times: &mut StageTimes,
) -> Result<()> {
    let progress = Progress::default();
    let link = device.link;
    let (d2h_fault, h2d_fault) = (faults.d2h, faults.h2d);
    let (device_grads, device_params) = (&device.grads, &mut device.params);
    let slots = staging.grads.len();
    std::thread::scope(|scope| {
        let (d2h_tx, d2h_rx) = channel::<Staged>();
        let (h2d_tx, h2d_rx) = channel::<Staged>();
        let progress = &progress;
        let d2h = scope.spawn(move || {
            engine(Direction::D2h, d2h_rx, progress, |Staged { elements, slot }| {
                injected("d2h", d2h_fault, &elements)?;
                let mut dst = lock(&staging.grads[slot]);
                let len = elements.len();
                Ok(link.copy(&device_grads[elements], &mut dst[..len]))
            })
        });
        let h2d = scope.spawn(move || {
            engine(Direction::H2d, h2d_rx, progress, |Staged { elements, slot }| {
                injected("h2d", h2d_fault, &elements)?;
                let src = lock(&staging.params[slot]);
                let len = elements.len();
                Ok(link.copy(&src[..len], &mut device_params[elements]))
            })
        });
        let mut engines = HostEngines {
            staging,
            progress,
            d2h: Some(d2h_tx),
            h2d: Some(h2d_tx),
            threads: Some([d2h, h2d]),
            issued: [0, 0],
            slot_copy: [vec![0; slots], vec![0; slots]],
        };
        let ran = run_step(&mut engines, plan, faults, state, scalars, times);
        // On an error the engines still end (their channels close) before the scope joins them.
        let finished = engines.finish();
        ran.and(finished.map(|_| ()))
    })
}
