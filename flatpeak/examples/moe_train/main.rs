//! Trains a tiny long-context MoE model (embedding, RMSNorm, top-k router, MoE blocks, the
//! vocabulary projection and loss; `model/`) for 20 steps on 4 simulated ranks, with the
//! baselines and with the four flatpeak schedules, and prints the loss of each step and each
//! component's working set per rank. `tests/composed_step.rs` runs the same model as a test.
//!
//! ```sh
//! cargo run --release -p flatpeak --example moe_train
//! ```

mod model;

use flatpeak::common::CountingAllocator;
use model::{MoeConfig, Schedules, train};

// The dispatch and vocabulary working sets are measured by the counting allocator.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn kib(bytes: usize) -> String {
    format!("{:.1} KiB", bytes as f64 / 1024.0)
}

fn main() -> Result<(), String> {
    let c = MoeConfig::default();
    println!(
        "MoE: P={} ranks × N={} tokens, V={}, H={}, I={}, E={} (top-{}), L={} blocks",
        c.ranks, c.tokens, c.vocab, c.hidden, c.intermediate, c.experts, c.top_k, c.layers
    );
    let base = train(&c, Schedules::baseline(), 20)?;
    let flat = train(&c, Schedules::flattened(), 20)?;
    println!("{:>4} {:>14} {:>14} {:>10}", "step", "baseline", "flattened", "rel diff");
    for (step, (b, f)) in base.losses.iter().zip(&flat.losses).enumerate() {
        println!("{:>4} {:>14.8} {:>14.8} {:>10.1e}", step + 1, b, f, ((b - f) / b).abs());
    }
    println!("\nworking set per rank (max)     baseline      flattened   how");
    let rows = [
        ("dispatch (llep)", base.peaks.dispatch, flat.peaks.dispatch, "measured"),
        ("vocab (ring-dtp)", base.peaks.vocab, flat.peaks.vocab, "measured"),
        ("checkpoints (sco)", base.peaks.checkpoints, flat.peaks.checkpoints, "counted by the store"),
        ("optimizer staging", base.peaks.optimizer, flat.peaks.optimizer, "the plan's reservation"),
    ];
    for (name, b, f, how) in rows {
        println!("{name:<24} {:>14} {:>14}   {how}", kib(b), kib(f));
    }
    println!(
        "(measured: the counting allocator's high-water on each rank's thread during the call, less its outputs)"
    );
    Ok(())
}
