//! The exactness metrics of the `llep` rows: PipelinedLLEP's outputs against the dense f64
//! reference on a token subset (16 tokens of rank 0, hot under the skewed profiles, and 16 of
//! rank P−1) and against LLEP's over everything. A bf16 row also reports the naive bf16
//! computation's errors against the same reference, and meets its promise iff each of its own
//! is ≤ 2 × the naive one + 1e-2; an f32 row iff every error is ≤ 1e-5.

use flatpeak_common::{DType, relative_error};
use llep::cpu::reference::{self, ReferenceGrads};
use llep::{ExpertWeights, Gradients, RankInputs, Routing, Shape};

use super::llep_data::{Data, Phase, RankOut, SHAPE};

/// Tokens taken from each end (rank 0's first, rank P−1's last) for the f64 reference.
const SUBSET: usize = 16;

/// Named errors, and whether they meet the row's promise.
type Errors = (Vec<(&'static str, f64)>, bool);

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&a| a as f64).collect()
}

/// The named errors of `ours` (PipelinedLLEP) against the reference of `d`'s inputs and against
/// `llep`'s outputs, and whether they meet the row's promise (see the module docs).
pub(super) fn errors(
    d: &Data,
    ids: &[i64],
    (ours, llep): (&[RankOut], &[RankOut]),
    phase: Phase,
    dtype: DType,
) -> Result<Errors, String> {
    let (p, n, h, k) = (SHAPE.ranks, SHAPE.tokens, SHAPE.hidden, SHAPE.top_k);
    let picks: Vec<(usize, usize)> =
        (0..SUBSET).map(|t| (0, t)).chain((n - SUBSET..n).map(|t| (p - 1, t))).collect();
    let gather =
        |f: &dyn Fn(usize, usize) -> Vec<f32>| picks.iter().flat_map(|&(r, t)| f(r, t)).collect::<Vec<f32>>();
    let x = gather(&|r, t| d.x[r][t * h..(t + 1) * h].to_vec());
    let dy = gather(&|r, t| d.dy[r][t * h..(t + 1) * h].to_vec());
    let w = gather(&|r, t| d.weights[r][t * k..(t + 1) * k].to_vec());
    let sub_ids: Vec<i64> = picks.iter().flat_map(|&(_, t)| ids[t * k..(t + 1) * k].to_vec()).collect();
    let shape = Shape { ranks: 1, tokens: picks.len(), ..SHAPE };
    let inputs = RankInputs {
        x: &x,
        routing: Routing { ids: &sub_ids, weights: &w },
        experts: ExpertWeights { gate: &d.gate, up: &d.up, down: &d.down },
    };
    let bf16 = dtype == DType::Bf16;
    let e = |r: llep::Result<Vec<f64>>| r.map_err(|e| e.to_string());
    let y_ref = e(reference::forward(&shape, &inputs))?;
    let y_naive = if bf16 { Some(e(reference::naive_bf16_forward(&shape, &inputs))?) } else { None };
    let y_sub = gather(&|r, t| ours[r].y[t * h..(t + 1) * h].to_vec());
    let cat =
        |outs: &[RankOut], f: &dyn Fn(&RankOut) -> Vec<f32>| outs.iter().flat_map(f).collect::<Vec<f32>>();
    // (name, ours vs f64, the naive bf16 computation vs f64).
    let mut vs_f64: Vec<(&'static str, &'static str, f64, Option<f64>)> = vec![(
        "rel_err_y_vs_f64",
        "naive_bf16_rel_err_y_vs_f64",
        relative_error(&y_sub, &y_ref),
        y_naive.map(|v| relative_error(&v.iter().map(|&a| a as f32).collect::<Vec<_>>(), &y_ref)),
    )];
    let mut out = vec![(
        "rel_err_y_vs_llep",
        relative_error(&cat(ours, &|o| o.y.clone()), &f64s(&cat(llep, &|o| o.y.clone()))),
    )];
    if phase == Phase::TrainingStep {
        let g = |r: llep::Result<ReferenceGrads>| r.map_err(|e| e.to_string());
        let g_ref = g(reference::backward(&shape, &inputs, &dy))?;
        let g_naive =
            if bf16 { Some(g(reference::naive_bf16_backward(&shape, &inputs, &dy))?) } else { None };
        let grads = |o: &RankOut| o.grads.clone().ok_or("training step without gradients".to_string());
        let (mine, theirs): (Vec<Gradients>, Vec<Gradients>) = (
            ours.iter().map(grads).collect::<Result<_, _>>()?,
            llep.iter().map(grads).collect::<Result<_, _>>()?,
        );
        let dx_sub = gather(&|r, t| mine[r].dx[t * h..(t + 1) * h].to_vec());
        let dw_sub = gather(&|r, t| mine[r].d_weights[t * k..(t + 1) * k].to_vec());
        let weights = |g: &[Gradients]| -> Vec<f32> {
            g.iter().flat_map(|g| g.d_gate.iter().chain(&g.d_up).chain(&g.d_down).copied()).collect()
        };
        let naive_err = |f: fn(&ReferenceGrads) -> &Vec<f64>, want: &[f64]| {
            g_naive
                .as_ref()
                .map(|n| relative_error(&f(n).iter().map(|&a| a as f32).collect::<Vec<_>>(), want))
        };
        vs_f64.push((
            "rel_err_dx_vs_f64",
            "naive_bf16_rel_err_dx_vs_f64",
            relative_error(&dx_sub, &g_ref.dx),
            naive_err(|g| &g.dx, &g_ref.dx),
        ));
        vs_f64.push((
            "rel_err_d_routing_weights_vs_f64",
            "naive_bf16_rel_err_d_routing_weights_vs_f64",
            relative_error(&dw_sub, &g_ref.d_weights),
            naive_err(|g| &g.d_weights, &g_ref.d_weights),
        ));
        out.push(("rel_err_expert_grads_vs_llep", relative_error(&weights(&mine), &f64s(&weights(&theirs)))));
    }
    let within = match bf16 {
        false => vs_f64.iter().all(|v| v.2 <= 1e-5) && out.iter().all(|v| v.1 <= 1e-5),
        true => vs_f64.iter().all(|v| v.3.is_some_and(|naive| v.2 <= 2.0 * naive + 1e-2)),
    };
    for (name, naive_name, err, naive) in vs_f64 {
        out.push((name, err));
        if let Some(naive) = naive {
            out.push((naive_name, naive));
        }
    }
    Ok((out, within))
}
