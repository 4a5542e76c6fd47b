//! sco: gradients bitwise equal with SCO, plain checkpointing and no checkpointing; the device
//! boundary high-water equals the plan's bound for every depth; copies stay correct under
//! stress; the pool is reused across steps; misuse is a typed error; the stack drives any
//! `CheckpointStore` with the same schedule, and a failed step leaves the store reusable.

use std::sync::atomic::{AtomicBool, Ordering};

use flatpeak_common::SplitMix64;
use sco::layers::{AddOne, ResidualMlp};
use sco::{
    Budget, CheckpointOffloader, CheckpointStore, CheckpointedStack, Checkpointing, Config, Device,
    DeviceRef, Error, Host, Layer, Link, Offloader, OnHost, Plan, Shape,
};

const TOKENS: usize = 8;
const HIDDEN: usize = 6;
const INNER: usize = 10;

fn mlp_stack(layers: usize, mode: Checkpointing) -> CheckpointedStack<ResidualMlp> {
    let layers: Vec<_> =
        (0..layers).map(|l| ResidualMlp::new(TOKENS, HIDDEN, INNER, 100 + l as u64)).collect();
    CheckpointedStack::new(layers, mode, &Config::default(), Link::Memcpy).expect("valid stack")
}

fn loss_grad(y: &[f32]) -> sco::Result<Vec<f32>> {
    // d/dy of 0.5·Σ w_j y_j² with fixed weights: a non-uniform upstream gradient.
    Ok(y.iter().enumerate().map(|(j, &v)| v * (1.0 + (j % 5) as f32 * 0.25)).collect())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn gradients_are_bitwise_equal_across_schedules() {
    let input = SplitMix64::new(7).normal_f32(TOKENS * HIDDEN, 0.0, 1.0);
    for layers in [1usize, 2, 3, 8, 33] {
        let runs: Vec<_> = [Checkpointing::Off, Checkpointing::OnDevice, Checkpointing::Offload]
            .into_iter()
            .map(|mode| mlp_stack(layers, mode).step(&input, loss_grad).expect("step"))
            .collect();
        for other in &runs[1..] {
            assert_eq!(bits(&other.output), bits(&runs[0].output), "L={layers}");
            assert_eq!(bits(&other.grad_input), bits(&runs[0].grad_input), "L={layers}");
            for (a, b) in other.param_grads.iter().zip(&runs[0].param_grads) {
                assert_eq!(bits(a), bits(b), "L={layers}");
            }
        }
        assert!(
            runs[0].param_grads.iter().all(|g| g.iter().any(|&x| x != 0.0)),
            "gradients are not all zero"
        );
    }
}

#[test]
fn device_boundary_memory_is_the_plans_bound_for_every_depth() {
    let input = SplitMix64::new(8).normal_f32(TOKENS * HIDDEN, 0.0, 1.0);
    let s = TOKENS * HIDDEN * 4;
    // Copies slower than compute (a 10 kB/s link: ~20 ms per 192 B boundary) make the ring
    // fill up deterministically; with fast copies a step may need fewer slots than the plan.
    let slow = Link::Simulated { gbps: 1e-5 };
    for layers in [1usize, 2, 3, 8, 33] {
        let stack_layers: Vec<_> =
            (0..layers).map(|l| ResidualMlp::new(TOKENS, HIDDEN, INNER, 100 + l as u64)).collect();
        let mut sco = CheckpointedStack::new(stack_layers, Checkpointing::Offload, &Config::default(), slow)
            .expect("valid stack");
        let plan = sco.plan();
        let out = sco.step(&input, loss_grad).expect("step");
        assert_eq!(plan.workspace_bytes(), 3 * s);
        // A stack this deep holds min(slots, L) boundaries at its peak, never more.
        assert_eq!(out.boundary_high_water_bytes, plan.peak_slots() * s, "L={layers}");
        assert!(out.boundary_high_water_bytes <= plan.workspace_bytes());
        let plain = mlp_stack(layers, Checkpointing::OnDevice).step(&input, loss_grad).expect("step");
        assert_eq!(plain.boundary_high_water_bytes, plan.plain_device_bytes(), "L={layers}");
    }
}

#[test]
fn copies_stay_correct_under_stress_and_the_pool_is_reused() {
    // Large boundaries, trivial compute: the copy engines are the bottleneck and every slot is
    // reused thousands of times. AddOne's backward counts any boundary that is not the one its
    // forward saw.
    let width = 1 << 15;
    let layers = 6;
    let input: Vec<f32> = (0..width).map(|j| j as f32).collect();
    let stack_layers: Vec<_> = (0..layers).map(|l| AddOne::new(width, l)).collect();
    let mut stack =
        CheckpointedStack::new(stack_layers, Checkpointing::Offload, &Config::default(), Link::Memcpy)
            .expect("valid stack");
    for iteration in 0..1000 {
        let out = stack.step(&input, |y| Ok(vec![1.0; y.len()])).expect("step");
        let wrong: f32 = out.param_grads.iter().map(|g| g[0]).sum();
        assert_eq!(wrong, 0.0, "iteration {iteration}: {wrong} elements of boundaries were wrong");
        assert_eq!(out.output[7], 7.0 + layers as f32);
        assert!(out.boundary_high_water_bytes <= 3 * width * 4, "iteration {iteration}");
    }
}

#[test]
fn deeper_prefetch_and_more_resident_boundaries_keep_their_bound() {
    let input = SplitMix64::new(9).normal_f32(TOKENS * HIDDEN, 0.0, 1.0);
    let reference = mlp_stack(16, Checkpointing::OnDevice).step(&input, loss_grad).expect("step");
    for (keep_resident, in_flight, prefetch_distance) in [(1, 1, 0), (2, 2, 1), (1, 2, 3), (3, 1, 2)] {
        let options = Config::default()
            .keep_resident(keep_resident)
            .in_flight(in_flight)
            .prefetch_distance(prefetch_distance);
        let layers: Vec<_> =
            (0..16).map(|l| ResidualMlp::new(TOKENS, HIDDEN, INNER, 100 + l as u64)).collect();
        let mut stack =
            CheckpointedStack::new(layers, Checkpointing::Offload, &options, Link::Memcpy).expect("stack");
        let out = stack.step(&input, loss_grad).expect("step");
        let plan = stack.plan();
        assert!(out.boundary_high_water_bytes <= plan.workspace_bytes(), "{options:?}");
        assert_eq!(bits(&out.grad_input), bits(&reference.grad_input), "{options:?}");
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let plan = Plan::new(&Config::default(), Shape::of::<f32>(4, 10), Budget::Unlimited).expect("plan");
    let off = CheckpointOffloader::<f32>::new(plan, Link::Memcpy).expect("offloader");
    assert_eq!(off.fetch(1).err(), Some(Error::NotOffloaded { layer: 1 }));
    assert_eq!(off.prefetch(2).err(), Some(Error::NotOffloaded { layer: 2 }));
    assert_eq!(off.release(0).err(), Some(Error::NotOffloaded { layer: 0 }));
    assert_eq!(off.offload_copy(4, &[0.0; 10]).err(), Some(Error::LayerOutOfRange { layer: 4, layers: 4 }));
    assert_eq!(
        off.offload_copy(1, &[0.0; 9]).err(),
        Some(Error::ShapeMismatch { what: "boundary tensor (elements)", expected: 10, got: 9 })
    );
    off.offload_copy(1, &[1.0; 10]).expect("first offload");
    assert_eq!(off.offload_copy(1, &[2.0; 10]).err(), Some(Error::AlreadyOffloaded { layer: 1 }));
    assert_eq!(&*off.fetch(1).expect("fetch"), &[1.0; 10][..], "the failed double offload changed nothing");
    // Holding more slots than the ring has, with nothing in flight to free one: an error, not a hang.
    let held: Vec<_> = (0..2).map(|_| off.writer().expect("a free slot")).collect();
    assert!(matches!(off.writer().err(), Some(Error::RingFull { slots: 3, .. })));
    drop(held);
    assert!(off.writer().is_ok(), "dropped writers return their slots");

    let widths = vec![ResidualMlp::new(2, 3, 4, 1), ResidualMlp::new(2, 4, 4, 2)];
    assert!(matches!(
        CheckpointedStack::new(widths, Checkpointing::Offload, &Config::default(), Link::Memcpy),
        Err(Error::ShapeMismatch { expected: 6, got: 8, .. })
    ));
    let mut stack = mlp_stack(3, Checkpointing::Offload);
    assert!(matches!(
        stack.step(&[0.0; 5], loss_grad),
        Err(Error::ShapeMismatch { expected: 48, got: 5, .. })
    ));
    assert!(matches!(stack.step(&[0.0; 48], |_| Ok(vec![0.0; 3])), Err(Error::ShapeMismatch { got: 3, .. })));
    assert!(matches!(
        CheckpointedStack::<ResidualMlp>::new(
            Vec::new(),
            Checkpointing::Offload,
            &Config::default(),
            Link::Memcpy
        ),
        Err(Error::InvalidConfig { field: "layers", .. })
    ));
    // A layer handed a buffer of the wrong size says so instead of panicking.
    let layer: &dyn Layer = &stack.layers()[0];
    assert_eq!(
        layer.forward(&[0.0; 5], &mut [0.0; 48]).unwrap_err(),
        Error::ShapeMismatch { what: "layer input x", expected: 48, got: 5 }
    );
    assert!(matches!(
        layer.backward(&[0.0; 48], None, &[0.0; 48], &mut [0.0; 48], &mut [0.0; 3]),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// A store that records what the stack asks of it and passes it on to the CPU offloader.
#[derive(Debug)]
struct Recording {
    inner: CheckpointOffloader<f32>,
    calls: Vec<Call>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    OffloadFrom(usize),
    ForwardInto(usize),
    Prefetch(usize),
    Fetch(usize),
    Release(usize),
    FinishStep,
}

impl CheckpointStore for Recording {
    type Tensors = Host;
    fn plan(&self) -> &Plan {
        self.inner.plan()
    }
    fn tensors(&self) -> Host {
        Host::new()
    }
    fn offload_from(&mut self, layer: usize, tensor: &[f32]) -> sco::Result<()> {
        self.calls.push(Call::OffloadFrom(layer));
        self.inner.offload_from(layer, tensor)
    }
    fn forward_into<R>(
        &mut self,
        layer: usize,
        f: impl FnOnce(&[f32], &mut [f32]) -> sco::Result<R>,
    ) -> sco::Result<R> {
        self.calls.push(Call::ForwardInto(layer));
        self.inner.forward_into(layer, f)
    }
    fn prefetch(&mut self, layer: usize) -> sco::Result<()> {
        self.calls.push(Call::Prefetch(layer));
        self.inner.prefetch(layer)
    }
    fn fetch_with<R>(&mut self, layer: usize, f: impl FnOnce(&[f32]) -> sco::Result<R>) -> sco::Result<R> {
        self.calls.push(Call::Fetch(layer));
        self.inner.fetch_with(layer, f)
    }
    fn release(&mut self, layer: usize) -> sco::Result<()> {
        self.calls.push(Call::Release(layer));
        self.inner.release(layer)
    }
    fn finish_step(&mut self) -> sco::Result<()> {
        self.calls.push(Call::FinishStep);
        self.inner.finish_step()
    }
    fn high_water_bytes(&self) -> usize {
        self.inner.high_water_bytes()
    }
}

fn mlp_layers(layers: usize) -> Vec<ResidualMlp> {
    (0..layers).map(|l| ResidualMlp::new(TOKENS, HIDDEN, INNER, 100 + l as u64)).collect()
}

#[test]
fn the_stack_drives_any_store_with_the_same_schedule() {
    let input = SplitMix64::new(10).normal_f32(TOKENS * HIDDEN, 0.0, 1.0);
    let (layers, d) = (6, 2);
    let config = Config::default().prefetch_distance(d);
    let plan =
        Plan::new(&config, Shape::of::<f32>(layers, TOKENS * HIDDEN), Budget::Unlimited).expect("plan");
    let store = Recording {
        inner: CheckpointOffloader::new(plan, Link::Memcpy).expect("offloader"),
        calls: Vec::new(),
    };
    let mut stack = CheckpointedStack::with_store(mlp_layers(layers), store).expect("stack");
    let reference = mlp_stack(layers, Checkpointing::OnDevice).step(&input, loss_grad).expect("step");
    for _ in 0..2 {
        let out = stack.step(&input, loss_grad).expect("step");
        assert_eq!(bits(&out.grad_input), bits(&reference.grad_input));
        for (a, b) in out.param_grads.iter().zip(&reference.param_grads) {
            assert_eq!(bits(a), bits(b));
        }
        assert!(out.boundary_high_water_bytes <= plan.workspace_bytes());
    }
    // Forward: the input, then each layer's output as the next boundary, the last layer's
    // output kept by the stack; backward: prefetch d ahead, fetch, release; then finish.
    let mut expected = vec![Call::OffloadFrom(0)];
    expected.extend((0..layers - 1).map(Call::ForwardInto));
    expected.push(Call::Fetch(layers - 1));
    for i in (0..layers).rev() {
        if i >= d {
            expected.push(Call::Prefetch(i - d));
        }
        expected.extend([Call::Fetch(i), Call::Release(i)]);
    }
    expected.push(Call::FinishStep);
    let calls = &stack.store().expect("a store").calls;
    assert_eq!(calls[..expected.len()], expected[..]);
    assert_eq!(calls[expected.len()..], expected[..], "the same schedule every step");

    // The store must be planned for the stack it drives.
    let fresh = || CheckpointOffloader::<f32>::new(plan, Link::Memcpy).expect("offloader");
    assert_eq!(
        CheckpointedStack::with_store(mlp_layers(layers + 1), fresh()).err(),
        Some(Error::ShapeMismatch { what: "stack depth (the store's plan)", expected: 6, got: 7 })
    );
    let wide: Vec<_> = (0..layers).map(|l| ResidualMlp::new(TOKENS, HIDDEN + 1, INNER, l as u64)).collect();
    assert!(matches!(
        CheckpointedStack::with_store(wide, fresh()),
        Err(Error::ShapeMismatch { expected: 48, got: 56, .. })
    ));
}

/// `AddOne` whose backward fails once, on one layer.
#[derive(Debug)]
/// A layer that fails its next forward or backward once (fault injection).
struct FailsOnce {
    inner: AddOne,
    armed: AtomicBool,
    forward_armed: AtomicBool,
}

impl FailsOnce {
    fn new(width: usize, layer: usize, fail_forward: bool, fail_backward: bool) -> Self {
        Self {
            inner: AddOne::new(width, layer),
            armed: AtomicBool::new(fail_backward),
            forward_armed: AtomicBool::new(fail_forward),
        }
    }
}

impl Layer for FailsOnce {
    fn width(&self) -> usize {
        self.inner.width()
    }
    fn param_count(&self) -> usize {
        self.inner.param_count()
    }
    fn forward(&self, x: &[f32], y: &mut [f32]) -> sco::Result<()> {
        if self.forward_armed.swap(false, Ordering::Relaxed) {
            return Err(Error::invalid_config("armed", "forward", "a layer that does not fail"));
        }
        self.inner.forward(x, y)
    }
    fn forward_saving(&self, x: &[f32], y: &mut [f32]) -> sco::Result<Vec<f32>> {
        self.inner.forward_saving(x, y)
    }
    fn backward(
        &self,
        x: &[f32],
        saved: Option<&[f32]>,
        dy: &[f32],
        dx: &mut [f32],
        dparams: &mut [f32],
    ) -> sco::Result<()> {
        if self.armed.swap(false, Ordering::Relaxed) {
            return Err(Error::invalid_config("armed", true, "a layer that does not fail"));
        }
        self.inner.backward(x, saved, dy, dx, dparams)
    }
}

#[test]
fn a_failed_step_leaves_the_store_ready_for_the_next() {
    let (width, layers) = (64, 5);
    let input: Vec<f32> = (0..width).map(|j| j as f32).collect();
    let plan =
        Plan::new(&Config::default(), Shape::of::<f32>(layers, width), Budget::Unlimited).expect("plan");
    // The executor chosen by the device: one type, lending host tensors on `Device::Cpu`.
    let offloader = Offloader::<f32>::new(plan, Device::Cpu).expect("cpu");
    let stack_layers: Vec<_> = (0..layers).map(|l| OnHost(FailsOnce::new(width, l, false, l == 2))).collect();
    let mut stack = CheckpointedStack::with_store(stack_layers, offloader).expect("stack");
    let ones = |y: DeviceRef<'_, f32>| Ok(vec![1.0; y.host()?.len()].into());
    assert!(matches!(
        stack.step(input.as_slice().into(), ones),
        Err(Error::InvalidConfig { field: "armed", .. })
    ));
    for _ in 0..3 {
        let out = stack.step(input.as_slice().into(), ones).expect("the store was reset");
        let grads: Vec<Vec<f32>> =
            out.param_grads.into_iter().map(|g| g.into_host().expect("host")).collect();
        assert_eq!(grads.iter().map(|g| g[0]).sum::<f32>(), 0.0, "every boundary intact");
        assert_eq!(out.output.into_host().expect("host")[3], 3.0 + layers as f32);
    }
}

#[test]
fn an_error_injected_at_every_layer_in_either_pass_leaves_the_stack_usable() {
    let (width, layers) = (32, 5);
    let input: Vec<f32> = (0..width).map(|j| j as f32).collect();
    for failing in 0..layers {
        for (fail_forward, fail_backward) in [(true, false), (false, true)] {
            let stack_layers: Vec<_> = (0..layers)
                .map(|l| {
                    FailsOnce::new(width, l, fail_forward && l == failing, fail_backward && l == failing)
                })
                .collect();
            let mut stack = CheckpointedStack::new(
                stack_layers,
                Checkpointing::Offload,
                &Config::default(),
                Link::Memcpy,
            )
            .expect("stack");
            let what = format!("layer {failing}, forward {fail_forward}");
            assert!(
                matches!(
                    stack.step(&input, |y| Ok(vec![1.0; y.len()])),
                    Err(Error::InvalidConfig { field: "armed", .. })
                ),
                "{what}"
            );
            for _ in 0..2 {
                let out = stack.step(&input, |y| Ok(vec![1.0; y.len()])).expect(&what);
                assert_eq!(out.output[3], 3.0 + layers as f32, "{what}");
                assert_eq!(out.grad_input, vec![1.0; width], "{what}");
            }
        }
    }
}

#[test]
fn a_boundary_fetched_twice_stays_on_the_device_until_both_readers_are_done() {
    // Before the fix, dropping one of two readers freed the slot the other still read: the next
    // writer then waited forever on it. Run under a timeout so a regression fails, not hangs.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let plan = Plan::new(&Config::default(), Shape::of::<f32>(4, 10), Budget::Unlimited).expect("plan");
        let off = CheckpointOffloader::<f32>::new(plan, Link::Memcpy).expect("offloader");
        for l in 0..4 {
            off.offload_copy(l, &[l as f32; 10]).expect("offload");
        }
        let first = off.fetch(3).expect("fetch");
        let second = off.fetch(3).expect("fetch again");
        off.release(3).expect("release");
        drop(first);
        // Take every slot a writer can get: none may be the one `second` still reads.
        let mut writers = Vec::new();
        while let Ok(mut w) = off.writer() {
            w.fill(9.0);
            writers.push(w);
        }
        assert_eq!(&*second, &[3.0; 10][..], "the boundary under the second reader is intact");
        assert_eq!(writers.len(), plan.slots() - 1, "the second reader's slot stayed held");
        drop(second);
        drop(writers);
        assert!(off.writer().is_ok(), "its slot is free once the last reader is done");
        done.send(()).expect("report");
    });
    finished.recv_timeout(std::time::Duration::from_secs(60)).expect("no hang");
}

#[test]
fn a_stuck_copy_is_a_timeout_error_not_a_hang() {
    // A 10 B/s link: one 40 B boundary takes 4 s to copy; every wait gives up after 50 ms.
    let config = Config::default().wait_timeout(std::time::Duration::from_millis(50));
    let plan = Plan::new(&config, Shape::of::<f32>(4, 10), Budget::Unlimited).expect("plan");
    let mut off = CheckpointOffloader::<f32>::new(plan, Link::Simulated { gbps: 1e-8 }).expect("offloader");
    off.offload_copy(0, &[1.0; 10]).expect("offload");
    let start = std::time::Instant::now();
    assert!(matches!(off.finish_step(), Err(Error::Timeout { what: "every copy in flight", .. })));
    assert!(start.elapsed() < std::time::Duration::from_secs(2));
    // The offloader is failed from then on: every later wait says so at once.
    assert!(matches!(off.fetch(0), Err(Error::EngineStopped { engine: "offloader", .. })));
    assert!(matches!(
        Plan::new(
            &Config::default().wait_timeout(std::time::Duration::ZERO),
            Shape::of::<f32>(4, 10),
            Budget::Unlimited
        ),
        Err(Error::InvalidConfig { field: "wait_timeout", .. })
    ));
}

/// On a GPU: boundaries offloaded through the CUDA ring and fetched back in backward order are
/// the ones written, the ring never holds more than its slots, and misuse is typed. Ignored
/// without a device.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_offloader_round_trips_every_boundary() {
    use sco::CheckpointStore;
    use sco::cuda::CudaCheckpointOffloader;
    let (layers, width) = (24, 1 << 20);
    let plan =
        Plan::new(&Config::default(), Shape::of::<f32>(layers, width), Budget::Unlimited).expect("plan");
    let mut off = CudaCheckpointOffloader::<f32>::new(plan, 0).expect("a CUDA device");
    let stream = off.compute_stream().clone();
    let data: Vec<Vec<f32>> =
        (0..layers).map(|l| SplitMix64::new(l as u64).normal_f32(width, 0.0, 1.0)).collect();
    for step in 0..3 {
        for (l, d) in data.iter().enumerate() {
            stream.memcpy_htod(d, &mut off.slot_for(l).expect("slot")).expect("write boundary");
            off.offload(l).expect("offload");
        }
        assert_eq!(off.offload(3).err(), Some(Error::AlreadyOffloaded { layer: 3 }));
        for l in (0..layers).rev() {
            if l >= 1 {
                off.prefetch(l - 1).expect("prefetch");
            }
            let view = off.fetch(l).expect("fetch");
            let back = stream.clone_dtoh(&view).expect("read boundary");
            assert_eq!(back, data[l], "step {step} layer {l}");
            off.release(l).expect("release");
        }
        off.finish_step().expect("finish");
        assert!(off.high_water_bytes() <= plan.workspace_bytes());
    }
}
