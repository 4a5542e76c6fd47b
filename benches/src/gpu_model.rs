//! `flatpeak gpu-model`: the GPU bench's calls (`python/bench/bench_cuda.py`'s shapes) counted
//! without a GPU — kernel launches, host waits, uploads, GEMMs, the bytes the custom kernels
//! move — by each crate's counting backend over its own device schedule
//! ([`ring_dtp::count::count_call`], [`llep::device::count_step`]), beside the same counts of
//! the torch code each call replaces, and the time both imply at an H100's and an H200's
//! ceilings ([`flatpeak_common::device_counts`]: a roofline with fixed costs, a lower bound).
//! The torch counts are written here from what its eager code runs (one GEMM per product, one
//! kernel per elementwise op, bytes per element as each op reads and writes them).

use std::fmt::Write as _;

use flatpeak_common::device_counts::{Ceilings, DeviceCounts, GemmCall, H100, H200};
use flatpeak_common::{DType, Device, LocalGroup, LocalGroupOptions, SplitMix64};

/// The markers of the section `--markdown` writes into `docs/gpu.md`.
pub const BEGIN: &str = "<!-- flatpeak gpu-model: begin -->";
/// See [`BEGIN`].
pub const END: &str = "<!-- flatpeak gpu-model: end -->";

/// One call of the bench: flatpeak's counts and the torch baselines'.
struct Case {
    call: &'static str,
    dtype: DType,
    shape: String,
    plan: String,
    ours: DeviceCounts,
    baselines: Vec<(&'static str, DeviceCounts)>,
}

fn name(dtype: DType) -> &'static str {
    if dtype == DType::Bf16 { "bf16" } else { "f32" }
}

fn gemm(m: usize, n: usize, k: usize, dtype: DType, accumulate: bool) -> GemmCall {
    GemmCall { m, n, k, dtype, out: dtype, accumulate }
}

/// torch's eager `F.cross_entropy(F.linear(x, w).float(), t)` forward + backward: three GEMMs
/// over the whole logits matrix, and per logit the upcast (bf16), log-softmax, its backward and
/// the downcast (bf16), each reading and writing every element.
fn torch_cross_entropy(n: usize, d: usize, v: usize, dtype: DType) -> DeviceCounts {
    let mut c = DeviceCounts::default();
    let logits = n * v;
    c.gemm(gemm(n, v, d, dtype, false));
    if dtype == DType::Bf16 {
        c.launch("to_float", 6 * logits);
    }
    c.launch("log_softmax", 8 * logits);
    c.launch("nll_loss", 8 * n);
    c.launch("nll_loss_backward", 4 * logits + 8 * n);
    c.launch("log_softmax_backward", 12 * logits);
    if dtype == DType::Bf16 {
        c.launch("to_bf16", 6 * logits);
    }
    c.gemm(gemm(n, d, v, dtype, false));
    c.gemm(gemm(v, d, n, dtype, false));
    c
}

fn ring_dtp_case(n: usize, d: usize, v: usize, dtype: DType) -> Result<Case, String> {
    use ring_dtp::count::{CountedCall, count_call};
    let shape = ring_dtp::Shape { tokens: n, hidden: d, vocab: v, dtype };
    let plan = ring_dtp::Plan::for_device(
        &ring_dtp::Config::default(),
        shape,
        ring_dtp::LossBudget::Default,
        Device::Cuda(0),
    )
    .map_err(|e| e.to_string())?;
    let ours =
        count_call(&plan, CountedCall { bias: false, token_weights: false }).map_err(|e| e.to_string())?;
    Ok(Case {
        call: "linear_cross_entropy",
        dtype,
        shape: format!("N={n} D={d} V={v}"),
        plan: format!("{}-token blocks, {:?}", plan.token_block(), plan.schedule()),
        ours,
        baselines: vec![("torch eager", torch_cross_entropy(n, d, v, dtype))],
    })
}

/// The single-GPU experts a user writes (`bench_cuda.py`'s `moe_loop`): per expert with rows,
/// `F.linear` to gate and up, SwiGLU, `F.linear` down, and their backward (two GEMMs per
/// product); around them the sort, the row gather, the weighting and the index-add, and one
/// host wait for the counts. `grouped`: one `torch._grouped_mm` per product instead
/// (torchtitan's `GroupedExperts`), the same FLOPs in six calls.
fn torch_experts(rows: &[usize], h: usize, i: usize, dtype: DType, grouped: bool) -> DeviceCounts {
    let b = dtype.size_in_bytes();
    let total: usize = rows.iter().sum();
    // The expert counts read back (`.tolist()`, or the padded total for the grouped layout).
    let mut c = DeviceCounts { host_syncs: 1, ..DeviceCounts::default() };
    for what in ["argsort", "bincount", "gather_rows", "weights", "index_add"] {
        c.launch(what, 2 * total * h * b);
    }
    // Per product (gate_up forward, down forward, and the dX and dW of each), every expert's.
    let mut products: [Vec<GemmCall>; 6] = Default::default();
    for &m in rows.iter().filter(|&&m| m > 0) {
        let each = [
            gemm(m, 2 * i, h, dtype, false),
            gemm(m, h, i, dtype, false),
            gemm(m, i, h, dtype, false),
            gemm(i, h, m, dtype, false),
            gemm(m, h, 2 * i, dtype, false),
            gemm(2 * i, h, m, dtype, false),
        ];
        for (list, g) in products.iter_mut().zip(each) {
            list.push(g);
        }
        if !grouped {
            // silu, mul, their backward, slices' copies.
            for what in ["silu", "mul", "silu_backward", "mul_backward", "cat"] {
                c.launch(what, 4 * m * i * b);
            }
        }
    }
    if grouped {
        for what in ["silu", "mul", "silu_backward", "mul_backward", "pad"] {
            c.launch(what, 4 * total * i * b);
        }
        // Six grouped calls carry the products: one launch each, the FLOPs and bytes of all.
        for list in &products {
            c.grouped_gemm(list);
        }
    } else {
        for g in products.iter().flatten() {
            c.gemm(*g);
        }
    }
    c
}

fn llep_case(dtype: DType) -> Result<Case, String> {
    let (t, h, i, e, k) = (8192, 2048, 1024, 64, 8);
    let shape = llep::Shape { ranks: 1, tokens: t, hidden: h, intermediate: i, experts: e, top_k: k, dtype };
    // As the PyTorch binding runs it: torch's weight layout, the layer checkpointed.
    let config = llep::Config::default().weight_layout(llep::WeightLayout::Linear);
    let budget =
        llep::LayerBudget::Default.of(&config, &shape, Device::Cuda(0)).map_err(|e| e.to_string())?;
    let launch = llep::Plan::new(&config, shape, budget).map_err(|e| e.to_string())?;
    // Uniform top-k routing (k distinct experts a token), as the bench draws it.
    let ids = SplitMix64::new(1).top_k_ids(t, e, k);
    let weights = vec![1.0f32 / k as f32; t * k];
    let mut rows = vec![0usize; e];
    for &id in &ids {
        rows[id as usize] += 1;
    }
    let routing = llep::Routing { ids: &ids, weights: &weights };
    let out = LocalGroup::run(1, LocalGroupOptions::default(), |comm| {
        Ok(llep::device::count_step(comm, &launch, &routing))
    });
    let step = out
        .into_iter()
        .next()
        .ok_or("one rank ran")?
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok(Case {
        call: "moe_swiglu",
        dtype,
        shape: format!("T={t} H={h} I={i} E={e} k={k}, P=1"),
        plan: format!("q={}, {} round(s)", launch.pair_cap(), step.rounds),
        ours: step.forward.plus(&step.backward),
        baselines: vec![
            ("per-expert loop", torch_experts(&rows, h, i, dtype, false)),
            ("torch._grouped_mm", torch_experts(&rows, h, i, dtype, true)),
        ],
    })
}

fn row(out: &mut String, case: &Case, who: &str, counts: &DeviceCounts, gpu: &Ceilings, ours_s: f64) {
    let p = counts.predict(gpu);
    let ratio = if who == "flatpeak" { String::new() } else { format!("{:.2}×", p.total() / ours_s) };
    let _ = writeln!(
        out,
        "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} ({:.2} + {:.2} + {:.2}) | {} |",
        case.call,
        name(case.dtype),
        case.shape,
        gpu.name,
        who,
        counts.total_launches() + counts.gemm_launches,
        counts.gemms.len(),
        counts.host_syncs,
        counts.uploads,
        counts.gemm_flops() / 1e12,
        counts.kernel_bytes as f64 / 1e9,
        p.total() * 1e3,
        p.gemm * 1e3,
        p.kernels * 1e3,
        p.fixed * 1e3,
        ratio,
    );
}

/// The section: every case on both GPUs, flatpeak's row then its baselines'.
pub fn render() -> Result<String, String> {
    let mut cases = Vec::new();
    for (n, d, v, dtype) in [
        (16384, 4096, 131072, DType::Bf16),
        (8192, 1024, 32768, DType::Bf16),
        (8192, 1024, 32768, DType::F32),
    ] {
        cases.push(ring_dtp_case(n, d, v, dtype)?);
    }
    for dtype in [DType::Bf16, DType::F32] {
        cases.push(llep_case(dtype)?);
    }
    let mut out = String::new();
    let _ = writeln!(out, "{BEGIN}\n");
    let _ = writeln!(
        out,
        "Predicted, not measured: `flatpeak gpu-model --markdown docs/gpu.md` counts each call of \
         `python/bench/bench_cuda.py` without a GPU (flatpeak's by its crates' counting backends \
         over their device schedules; torch's from what its eager code runs) and prices the counts \
         at each GPU's published ceilings: GEMMs at their roofline with {:.0}% of the dense peak, \
         the custom kernels' bytes at HBM bandwidth, {:.0} µs a launch, {:.0} µs a host wait, \
         {:.0} µs a small upload. A lower bound that does not see a small GEMM's lost occupancy.\n",
        flatpeak_common::device_counts::GEMM_EFFICIENCY * 100.0,
        H100.launch_s * 1e6,
        H100.host_wait_s * 1e6,
        H100.upload_s * 1e6,
    );
    for case in &cases {
        let _ = writeln!(out, "- `{}` {} {}: {}", case.call, name(case.dtype), case.shape, case.plan);
    }
    let _ = writeln!(
        out,
        "\n| call | dtype | shape | GPU | code | launches | GEMMs | host waits | uploads | GEMM TFLOP | kernel GB | \
         predicted ms (GEMMs + kernels + fixed) | flatpeak's predicted speed-up |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for gpu in [&H100, &H200] {
        for case in &cases {
            let ours = case.ours.predict(gpu).total();
            row(&mut out, case, "flatpeak", &case.ours, gpu, ours);
            for (who, counts) in &case.baselines {
                row(&mut out, case, who, counts, gpu, ours);
            }
        }
    }
    let _ = writeln!(out, "\n{END}");
    Ok(out)
}

/// Writes `section` into the file at `path` between [`BEGIN`] and [`END`] (appended when the
/// file has no section yet).
pub fn write_section(path: &std::path::Path, section: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let text = match (text.find(BEGIN), text.find(END)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{}{}", &text[..b], section.trim_end(), &text[e + END.len()..])
        }
        _ => format!("{text}{}{section}", if text.is_empty() { "" } else { "\n" }),
    };
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_section_has_every_case_on_both_gpus() {
        let section = render().unwrap();
        assert!(section.starts_with(BEGIN) && section.trim_end().ends_with(END));
        // 3 loss cases × 2 rows + 2 MoE cases × 3 rows, on two GPUs.
        let rows = section.lines().filter(|l| l.starts_with("| `")).count();
        assert_eq!(rows, 2 * (3 * 2 + 2 * 3));
        let dir = std::env::temp_dir().join(format!("flatpeak-gpu-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gpu.md");
        std::fs::write(&path, "# head\n\ntext\n").unwrap();
        write_section(&path, &section).unwrap();
        write_section(&path, &section).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches(BEGIN).count(), 1);
        assert!(text.starts_with("# head\n\ntext\n"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
