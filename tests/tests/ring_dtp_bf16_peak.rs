//! ring-dtp's bf16 gradient outputs ([`Bf16GradientsMut`]), measured in the resident set: one
//! fused forward + backward holds at most the plan's working set, dW's f32 accumulator, the
//! bf16 dX, one token block of dX's f32 rows and one chunk of narrowing, beyond the inputs and
//! the GEMM's buffers; that is below what fp32 buffers narrowed afterwards hold (both fp32
//! gradients, then the bf16 dW beside the fp32 one). The accumulators' pages are given back
//! as they are narrowed (`madvise`), which an allocation count cannot see: the process's peak
//! RSS (`VmHWM`, reset through `/proc/self/clear_refs` where the kernel allows) is what is
//! measured. A plain `main`, so nothing else runs meanwhile. Linux only.

use half::bf16;
use ring_dtp::{
    Bf16GradientsMut, Budget, Config, DType, Device, GradOutput, Inputs, LinearCrossEntropy, Matrix, Plan,
    Shape,
};

/// N, D, V: dW's f32 accumulator is 64 MiB, dX's 4 MiB.
const SHAPE: (usize, usize, usize) = (2048, 512, 32768);
/// The plan's budget: token blocks over the whole vocabulary, small beside dW's accumulator.
const BUDGET: usize = 16 << 20;
/// Thread stacks, rayon's job bookkeeping, the per-token statistics and the pages the kernel
/// maps around the measured buffers.
const SLACK: usize = 4 << 20;

/// A line of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(key: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("{key} missing"));
    let kib: usize = line.split_whitespace().nth(1).and_then(|k| k.parse().ok()).expect("a number of kB");
    kib * 1024
}

/// Resets `VmHWM` to the current RSS; false where the kernel refuses.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn main() {
    if !cfg!(target_os = "linux") {
        println!("test result: ok. 0 passed; 0 failed; 1 ignored (needs /proc); 0 measured; 0 filtered out");
        return;
    }
    let (n, d, v) = SHAPE;
    // The inputs made in place, without f32 copies (their pages must not raise the mark).
    let x: Vec<bf16> = (0..n * d).map(|i| bf16::from_f32((i as f32 * 0.37).sin())).collect();
    let w: Vec<bf16> = (0..v * d).map(|i| bf16::from_f32((i as f32 * 0.11).cos() * 0.05)).collect();
    let targets: Vec<i64> = (0..n).map(|i| if i % 7 == 0 { -100 } else { (i * 7919 % v) as i64 }).collect();
    let inputs = Inputs::new(Matrix::Bf16(&x), Matrix::Bf16(&w), &targets, d);
    let plan = Plan::new(
        &Config::default(),
        Shape { tokens: n, hidden: d, vocab: v, dtype: DType::Bf16 },
        Budget::Bytes(BUDGET),
    )
    .expect("plan");
    let mut lce = LinearCrossEntropy::new(plan, Device::Cpu).expect("executor");
    // Warm rayon's pool and the GEMM's thread-local buffers on a small call of another plan.
    let small = Plan::new(
        &Config::default(),
        Shape { tokens: 64, hidden: d, vocab: 256, dtype: DType::Bf16 },
        Budget::Unlimited,
    )
    .expect("plan");
    let small_inputs =
        Inputs::new(Matrix::Bf16(&x[..64 * d]), Matrix::Bf16(&w[..256 * d]), &targets[..64], d);
    let small_targets: Vec<i64> = targets[..64].iter().map(|&t| if t < 0 { t } else { t % 256 }).collect();
    let small_inputs = Inputs { targets: &small_targets[..], ..small_inputs };
    LinearCrossEntropy::new(small, Device::Cpu)
        .and_then(|mut l| l.forward_backward(&small_inputs, GradOutput::Scalar(1.0)))
        .expect("warm-up");
    // The outputs, allocated untouched (as a framework's `empty` is): they count as written.
    let mut dx: Vec<bf16> = flatpeak_common::zeroed_vec(n * d, "dx").expect("dx");
    let mut dw: Vec<bf16> = flatpeak_common::zeroed_vec(v * d, "dw").expect("dw");
    let reset = reset_peak();
    let base = if reset { status_bytes("VmRSS") } else { status_bytes("VmRSS").max(status_bytes("VmHWM")) };
    lce.forward_backward_into(
        &inputs,
        GradOutput::Scalar(1.0),
        Bf16GradientsMut::new(&mut dx, &mut dw, None),
    )
    .expect("forward_backward_into");
    let peak = status_bytes("VmHWM").saturating_sub(base);
    assert!(dx.iter().chain(&dw).any(|g| *g != bf16::ZERO), "gradients written");

    // The plan's bytes for bf16 outputs (dW's f32 accumulator, dX's rows in flight, a chunk of
    // narrowing), and dX itself: the bf16 dW is written as its accumulator's pages go.
    let bound = plan.workspace_bytes()
        + plan.cpu_gemm_scratch_bytes()
        + plan.bf16_outputs_bytes()
        + n * d * 2
        + SLACK;
    // fp32 buffers narrowed afterwards: both fp32 gradients, then the bf16 dW beside the fp32.
    let fp32_then_narrowed =
        plan.workspace_bytes() + plan.cpu_gemm_scratch_bytes() + (n + v) * d * 4 + n * d * 2 + v * d * 2;
    assert!(peak <= bound, "peak {peak} B > bound {bound} B (reset: {reset})");
    assert!(bound < fp32_then_narrowed, "the bound {bound} B does not undercut {fp32_then_narrowed} B");
    println!(
        "test ring_dtp_bf16_outputs_peak ... ok (peak {peak} B ≤ bound {bound} B < fp32 buffers narrowed afterwards \
         {fp32_then_narrowed} B; workspace {} B, peak mark reset: {reset})",
        plan.workspace_bytes()
    );
    println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}
