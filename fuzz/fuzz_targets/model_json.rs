#![no_main]
//! `flatpeak plan`'s model-JSON parsing and the memory model behind it, on arbitrary bytes laid
//! out as `[context: u64 LE][gpus: u8][gpu memory: u64 LE][model JSON]`: a typed error or an
//! output whose columns add up, never a panic.

use flatpeak::memory_model::{ModelSpec, Schedules, estimate, plan, render_text};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 17 {
        return;
    }
    let word = |at: usize| u64::from_le_bytes(data[at..at + 8].try_into().unwrap_or_default());
    let (context, gpus, gpu_mem, json) = (word(0), data[8], word(9), &data[17..]);
    let Ok(spec) = serde_json::from_slice::<ModelSpec>(json) else { return };
    if spec.validate().is_err() {
        return;
    }
    // Small contexts explore the model, the full range its overflow checks; a few GPUs keep
    // the max-context search short.
    let context = if context & 1 == 0 { context >> 40 } else { context };
    let gpus = u64::from(gpus % 16) + 1;
    for schedules in [Schedules::Baseline, Schedules::Flattened] {
        if let Ok(e) = estimate(&spec, context, gpus, schedules) {
            assert_eq!(e.total, e.peaks.values().sum::<u64>());
        }
    }
    if let Ok(out) = plan(&spec, context, gpus, gpu_mem) {
        assert_eq!(out.baseline.fits, out.baseline.total <= gpu_mem);
        let _ = render_text(&out);
    }
});
