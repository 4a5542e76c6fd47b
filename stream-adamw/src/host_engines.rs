//! The CPU fallback's copy engines and staging: a D2H and an H2D engine thread, fed in issue
//! order by the schedule of `pipeline.rs` (the one the CUDA path runs), with per-stage
//! completion counters the schedule waits on; Adam runs on the calling thread's rayon pool.

use std::ops::Range;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ScopedJoinHandle;
use std::time::{Duration, Instant};

use crate::cpu::{ParamSink, adamw_update};
use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::host::HostDevice;
use crate::hyperparameters::StepScalars;
use crate::pipeline::{CopyEngines, Fault, FaultPoints, StepState, injected, run_step};
use crate::plan::Plan;
use crate::state::OptimizerState;
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

/// One copy job: the bucket's element range and its slot.
type Job = (Range<usize>, usize);

/// The CPU fallback's copy engines: a D2H and an H2D thread, each taking its jobs in issue
/// order from a channel and counting them done in [`Progress`].
struct HostEngines<'scope, 'a, G, P> {
    staging: &'a Staging<G, P>,
    progress: &'a Progress,
    d2h: Option<Sender<Job>>,
    h2d: Option<Sender<Job>>,
    threads: Option<[ScopedJoinHandle<'scope, Result<Duration>>; 2]>,
    /// Jobs issued per direction, and per slot the count up to its latest job (0: none yet).
    issued: [usize; 2],
    slot_job: [Vec<usize>; 2],
    /// The first element of the bucket whose Adam an injected fault fails.
    adam_fault: Option<usize>,
}

const D2H: usize = 0;
const H2D: usize = 1;

impl<G: GradElement, P: ParamElement> HostEngines<'_, '_, G, P> {
    fn issue(&mut self, direction: usize, job: Job) -> Result<()> {
        let stage = if direction == D2H { "d2h" } else { "h2d" };
        let slot = job.1;
        let sender = if direction == D2H { &self.d2h } else { &self.h2d };
        let stopped = || Error::PipelineStage { stage, reason: "copy engine stopped".into() };
        sender.as_ref().ok_or_else(stopped)?.send(job).map_err(|_| stopped())?;
        self.issued[direction] += 1;
        self.slot_job[direction][slot] = self.issued[direction];
        Ok(())
    }

    fn wait(&self, direction: usize, slot: usize) -> Result<()> {
        let job = self.slot_job[direction][slot];
        self.progress.wait(|c| if direction == D2H { c.d2h >= job } else { c.h2d >= job })
    }
}

impl<G: GradElement, P: ParamElement> CopyEngines for HostEngines<'_, '_, G, P> {
    fn start_d2h(&mut self, range: Range<usize>, slot: usize) -> Result<()> {
        self.issue(D2H, (range, slot))
    }
    fn wait_d2h(&mut self, slot: usize) -> Result<()> {
        self.wait(D2H, slot)
    }
    fn start_h2d(&mut self, range: Range<usize>, slot: usize) -> Result<()> {
        self.issue(H2D, (range, slot))
    }
    fn wait_h2d(&mut self, slot: usize) -> Result<()> {
        self.wait(H2D, slot)
    }

    fn adam(
        &mut self,
        state: &mut OptimizerState,
        range: Range<usize>,
        slot: usize,
        scalars: &StepScalars,
    ) -> Result<Duration> {
        injected("adam", self.adam_fault, &range)?;
        let (grads, mut params) = (lock(&self.staging.grads[slot]), lock(&self.staging.params[slot]));
        let len = range.len();
        let start = Instant::now();
        adamw_update(state.view(range), &grads[..len], ParamSink::Copy(&mut params[..len]), scalars);
        Ok(start.elapsed())
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

/// One copy engine: takes jobs in order, copies each over `link`, counts it done; its busy time.
fn engine(
    stage: &'static str,
    jobs: Receiver<Job>,
    progress: &Progress,
    mut copy: impl FnMut(Range<usize>, usize) -> Result<Duration>,
) -> Result<Duration> {
    let guard = StageGuard::new(progress, stage);
    let mut busy = Duration::ZERO;
    for (range, slot) in jobs {
        // A failing copy ends the engine: the guard marks the stage failed and every wait on it
        // returns an error instead of hanging.
        busy += copy(range, slot)?;
        progress.advance(|c| if stage == "d2h" { c.d2h += 1 } else { c.h2d += 1 });
    }
    guard.finish(busy)
}

/// Runs `plan`'s schedule ([`run_step`]) on the CPU fallback's device: the copy engines are two
/// threads for the length of the step.
pub(crate) fn run_host<G: GradElement, P: ParamElement>(
    (plan, fault): (&Plan, Option<Fault>),
    state: StepState<'_>,
    staging: &Staging<G, P>,
    device: &mut HostDevice<G, P>,
    scalars: &StepScalars,
    times: &mut StageTimes,
) -> Result<()> {
    let progress = Progress::default();
    let link = device.link;
    let FaultPoints { d2h: d2h_fault, adam: adam_fault, h2d: h2d_fault } = FaultPoints::new(plan, fault);
    let (device_grads, device_params) = (&device.grads, &mut device.params);
    let slots = staging.grads.len();
    std::thread::scope(|scope| {
        let (d2h_tx, d2h_rx) = channel::<Job>();
        let (h2d_tx, h2d_rx) = channel::<Job>();
        let progress = &progress;
        let d2h = scope.spawn(move || {
            engine("d2h", d2h_rx, progress, |range, slot| {
                injected("d2h", d2h_fault, &range)?;
                let mut dst = lock(&staging.grads[slot]);
                let len = range.len();
                Ok(link.copy(&device_grads[range], &mut dst[..len]))
            })
        });
        let h2d = scope.spawn(move || {
            engine("h2d", h2d_rx, progress, |range, slot| {
                injected("h2d", h2d_fault, &range)?;
                let src = lock(&staging.params[slot]);
                let len = range.len();
                Ok(link.copy(&src[..len], &mut device_params[range]))
            })
        });
        let mut engines = HostEngines {
            staging,
            progress,
            d2h: Some(d2h_tx),
            h2d: Some(h2d_tx),
            threads: Some([d2h, h2d]),
            issued: [0, 0],
            slot_job: [vec![0; slots], vec![0; slots]],
            adam_fault,
        };
        let ran = run_step(&mut engines, plan, state, scalars, times);
        // On an error the engines still end (their channels close) before the scope joins them.
        let finished = engines.finish();
        ran.and(finished.map(|_| ()))
    })
}
