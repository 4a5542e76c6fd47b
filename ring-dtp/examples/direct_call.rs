//! Times ring-dtp called directly at one shape, doing what the Python binding does per call for
//! a mean loss whose gradients are wanted (an executor per call, then forward and backward in
//! one pass into freshly allocated fp32 gradients: torch allocates them per call too), so the
//! binding's own overhead can be measured against it (`python/bench/bench_torch.py`).
//!
//! `cargo run --release -p ring-dtp --example direct_call -- N D V f32|bf16 REPS [BUDGET_BYTES]`
//! prints the fastest repetition's seconds (without BUDGET_BYTES: the CPU's default budget,
//! `LossBudget::Default`, as the binding's default).

use std::time::Instant;

use ring_dtp::{
    Config, DType, Device, GradOutput, Inputs, LinearCrossEntropy, LossBudget, Matrix, Plan, Shape, bf16,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (n, d, v, dtype, reps, budget) = match args.as_slice() {
        [n, d, v, dtype, reps] => (n, d, v, dtype, reps, None),
        [n, d, v, dtype, reps, budget] => (n, d, v, dtype, reps, Some(budget.parse()?)),
        _ => return Err("usage: direct_call N D V f32|bf16 REPS [BUDGET_BYTES]".into()),
    };
    let (n, d, v, reps): (usize, usize, usize, usize) = (n.parse()?, d.parse()?, v.parse()?, reps.parse()?);
    let budget = LossBudget::checked(budget)?.of(Device::Cpu);
    let dtype = if dtype == "bf16" { DType::Bf16 } else { DType::F32 };
    let x: Vec<f32> = (0..n * d).map(|i| ((i as f32) * 0.37).sin()).collect();
    let w: Vec<f32> = (0..v * d).map(|i| ((i as f32) * 0.11).cos() * 0.05).collect();
    let (xb, wb): (Vec<bf16>, Vec<bf16>) =
        (x.iter().map(|&e| bf16::from_f32(e)).collect(), w.iter().map(|&e| bf16::from_f32(e)).collect());
    let targets: Vec<i64> = (0..n as i64).map(|i| i * 7919 % v as i64).collect();
    let (xm, wm) = match dtype {
        DType::Bf16 => (Matrix::Bf16(&xb), Matrix::Bf16(&wb)),
        _ => (Matrix::F32(&x), Matrix::F32(&w)),
    };
    let inputs = Inputs::new(xm, wm, &targets, d);
    let config = Config::default();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let start = Instant::now();
        let plan = Plan::new(&config, Shape { tokens: n, hidden: d, vocab: v, dtype }, budget)?;
        let mut lce = LinearCrossEntropy::new(plan, Device::Cpu)?;
        let (_, grads) = lce.forward_backward(&inputs, GradOutput::Scalar(1.0))?;
        best = best.min(start.elapsed().as_secs_f64());
        drop(std::hint::black_box(grads));
    }
    println!("{best:.4}");
    Ok(())
}
