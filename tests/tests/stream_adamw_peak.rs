//! stream-adamw memory bounds, measured with the counting allocator: the staging an optimizer
//! reserves is exactly its plan's, a step allocates only O(N / CHUNK) bookkeeping on top, and
//! the pipelined working set does not grow with the parameter count. A plain `main` (no libtest
//! threads) so nothing else allocates while the bytes are counted.

use flatpeak_common::{CountingAllocator, PeakMeter, SplitMix64};
use half::bf16;
use stream_adamw::cpu::CHUNK;
use stream_adamw::{Budget, Config, HostDevice, Link, Plan, StepOptions, StepSchedule, StreamAdamW};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Scratch a step may allocate besides staging: per-chunk job records and norm partials
/// (≤ 128 B per CHUNK elements) and the two copy-engine threads' bookkeeping.
fn step_scratch_bound(n: usize) -> usize {
    n.div_ceil(CHUNK) * 128 + 4 * 1024
}

fn measure(n: usize, schedule: StepSchedule) -> (usize, usize, usize) {
    let master = SplitMix64::new(1).normal_f32(n, 0.0, 1.0);
    let mut device =
        HostDevice::new(SplitMix64::new(2).normal_f32(n, 0.0, 0.1), vec![bf16::ZERO; n], Link::Memcpy);
    let options = Config::default().bucket_elems(1 << 16).schedule(schedule);
    let built = PeakMeter::measure(|| {
        let plan = Plan::new(&options, StreamAdamW::<f32, bf16>::shape(n), Budget::Unlimited)
            .expect("valid options");
        let mut opt =
            StreamAdamW::<f32, bf16>::new(plan, stream_adamw::Device::Cpu).expect("a CPU optimizer");
        opt.load_master(&master).expect("n parameters");
        opt
    })
    .expect("counting allocator installed");
    let mut opt = built.value;
    // Construction reserves the state (master copy + m + v = 12 B/param) and exactly the plan's
    // staging, plus two small vectors holding the slots; nothing transient.
    let staging = opt.plan().staging_bytes();
    let held = built.output_bytes - 12 * n - staging;
    assert!(held <= 512, "construction holds {held} B beyond state and staging");
    assert_eq!(built.high_water_bytes, built.output_bytes, "construction allocates nothing transient");
    // Steady state: the first step also starts rayon's global pool, a one-time cost.
    opt.step(&mut device, StepOptions::default()).expect("step 1");
    let step = PeakMeter::measure(|| opt.step(&mut device, StepOptions::default()).map(|r| r.step))
        .expect("counting allocator installed");
    assert_eq!(step.value, Ok(2));
    (staging, step.peak_bytes, built.peak_bytes)
}

fn main() {
    let mut passed = 0;
    for &n in &[1usize << 18, 1 << 20, 1 << 22] {
        let (staging, step_peak, _) = measure(n, StepSchedule::Pipelined);
        assert_eq!(staging, 3 * (1 << 16) * 6, "pipelined staging is R·N_b·(4 + 2), flat in N");
        assert!(
            step_peak <= step_scratch_bound(n),
            "N={n}: step peak {step_peak} > {}",
            step_scratch_bound(n)
        );
        println!(
            "test pipelined_step_working_set_N{n} ... ok (staging {staging} B, step scratch {step_peak} B)"
        );
        passed += 1;
        let (serial_staging, serial_peak, _) = measure(n, StepSchedule::Serial);
        assert_eq!(serial_staging, n * 6, "serial stages everything: N·(4 + 2)");
        assert!(serial_peak <= step_scratch_bound(n));
        println!(
            "test serial_step_working_set_N{n} ... ok (staging {serial_staging} B, step scratch {serial_peak} B)"
        );
        passed += 1;
    }
    println!("test result: ok. {passed} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}
