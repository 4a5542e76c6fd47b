//! The device kernels (`kernels/llep.cu`) under the SIMT emulator against plain loops: row
//! gather with and without a scale, scatter-add direct (distinct rows) and ordered over duplicate
//! indices, SwiGLU forward
//! and backward, and per-row dot products — on ragged sizes, both thread schedules (a race is an
//! error). Runs with `--features cuda-emu`.
#![cfg(feature = "cuda-emu")]

use flatpeak_common::SplitMix64;
use llep::emu;

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().map(|w| w.abs()).fold(1e-30, f64::max);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= tol * scale, "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn gather_and_scatter_match_loops() {
    let mut rng = SplitMix64::new(1);
    for (rows, width, src_rows) in [(1usize, 1usize, 1usize), (37, 130, 11), (64, 33, 64)] {
        let src = rng.normal_f32(src_rows * width, 0.0, 1.0);
        // Duplicates on purpose: a token's several routes to one expert share a row.
        let index: Vec<u32> = (0..rows).map(|r| ((r * 7) % src_rows) as u32).collect();
        let scale = rng.uniform_f32(rows, 0.1, 2.0);
        for s in [None, Some(&scale[..])] {
            let mut dst = vec![0f32; rows * width];
            emu::gather_rows(&src, &index, s, width, &mut dst).unwrap();
            let want: Vec<f64> = (0..rows * width)
                .map(|e| {
                    let (r, c) = (e / width, e % width);
                    s.map_or(1.0, |s| s[r] as f64) * src[index[r] as usize * width + c] as f64
                })
                .collect();
            close("gather", &dst, &want, 1e-7);
            // Scatter back: acc[index[r]] += scale·dst[r], in order.
            let mut acc = rng.normal_f32(src_rows * width, 0.0, 1.0);
            let mut want: Vec<f64> = acc.iter().map(|&a| a as f64).collect();
            for r in 0..rows {
                for c in 0..width {
                    want[index[r] as usize * width + c] +=
                        s.map_or(1.0, |s| s[r] as f64) * dst[r * width + c] as f64;
                }
            }
            // The same additions in the same order as a serial loop, bit for bit.
            let mut serial = acc.clone();
            for r in 0..rows {
                for c in 0..width {
                    let v = dst[r * width + c];
                    serial[index[r] as usize * width + c] += s.map_or(v, |s| s[r] * v);
                }
            }
            emu::scatter_add_rows(&dst, &index, s, width, &mut acc).unwrap();
            close("scatter", &acc, &want, 1e-6);
            assert_eq!(acc, serial, "scatter: the serial order's bits");
        }
    }
    let mut dst = vec![0f32; 4];
    assert!(emu::gather_rows(&[1.0; 4], &[0, 9], None, 2, &mut dst).is_err(), "index past the source");
    assert!(emu::scatter_add_rows(&[1.0f32; 4], &[0, 2], None, 2, &mut dst).is_err(), "index past the acc");
}

#[test]
fn a_bf16_scatter_rounds_after_every_addition_in_input_order() {
    use half::bf16;
    let mut rng = SplitMix64::new(3);
    let (rows, width, acc_rows) = (300usize, 5usize, 7usize);
    let src: Vec<bf16> = rng.normal_f32(rows * width, 0.0, 1.0).into_iter().map(bf16::from_f32).collect();
    let index: Vec<u32> = (0..rows).map(|r| ((r * 5 + r / 7) % acc_rows) as u32).collect();
    let scale = rng.uniform_f32(rows, 0.1, 2.0);
    let start: Vec<bf16> =
        rng.normal_f32(acc_rows * width, 0.0, 1.0).into_iter().map(bf16::from_f32).collect();
    let mut serial = start.clone();
    for r in 0..rows {
        for c in 0..width {
            let out = &mut serial[index[r] as usize * width + c];
            *out = bf16::from_f32(out.to_f32() + scale[r] * src[r * width + c].to_f32());
        }
    }
    let mut acc = start.clone();
    emu::scatter_add_rows(&src, &index, Some(&scale), width, &mut acc).unwrap();
    assert_eq!(acc, serial);
    // Into f32 accumulators: the f32 serial sums.
    let mut acc32: Vec<f32> = start.iter().map(|x| x.to_f32()).collect();
    let mut serial32 = acc32.clone();
    for r in 0..rows {
        for c in 0..width {
            serial32[index[r] as usize * width + c] += scale[r] * src[r * width + c].to_f32();
        }
    }
    emu::scatter_add_rows(&src, &index, Some(&scale), width, &mut acc32).unwrap();
    assert_eq!(acc32, serial32);
}

#[test]
fn a_scatter_to_distinct_rows_runs_directly_with_the_serial_bits() {
    use half::bf16;
    use llep::device::ScatterLayout;
    let mut rng = SplitMix64::new(5);
    // One expert group's rows: a permutation of a part of the accumulator's rows.
    let (rows, width, acc_rows) = (45usize, 19usize, 64usize);
    let index: Vec<u32> = (0..rows).map(|r| ((r * 13 + 5) % acc_rows) as u32).collect();
    assert_eq!(ScatterLayout::of(&index, acc_rows).unwrap(), ScatterLayout::Direct);
    let src: Vec<bf16> = rng.normal_f32(rows * width, 0.0, 1.0).into_iter().map(bf16::from_f32).collect();
    let scale = rng.uniform_f32(rows, 0.1, 2.0);
    let start: Vec<bf16> =
        rng.normal_f32(acc_rows * width, 0.0, 1.0).into_iter().map(bf16::from_f32).collect();
    for s in [None, Some(&scale[..])] {
        let add = |r: usize, v: f32| s.map_or(v, |s| s[r] * v);
        let mut serial = start.clone();
        let mut serial32: Vec<f32> = start.iter().map(|x| x.to_f32()).collect();
        for r in 0..rows {
            for c in 0..width {
                let (at, v) = (index[r] as usize * width + c, src[r * width + c].to_f32());
                serial[at] = bf16::from_f32(serial[at].to_f32() + add(r, v));
                serial32[at] += add(r, v);
            }
        }
        let mut acc = start.clone();
        emu::scatter_add_rows(&src, &index, s, width, &mut acc).unwrap();
        assert_eq!(acc, serial, "bf16 into bf16");
        let mut acc32: Vec<f32> = start.iter().map(|x| x.to_f32()).collect();
        emu::scatter_add_rows(&src, &index, s, width, &mut acc32).unwrap();
        assert_eq!(acc32, serial32, "bf16 into f32");
    }
}

#[test]
fn swiglu_forward_backward_and_row_dot_match_loops() {
    use llep::device::PreAt;
    let mut rng = SplitMix64::new(2);
    // Split blocks (gate then, after a gap, up) and fused rows of [gate | up], I wide.
    for (n, width) in [(1usize, 1usize), (255, 17), (1000, 40)] {
        let (g, u, dh) =
            (rng.normal_f32(n, 0.0, 3.0), rng.normal_f32(n, 0.0, 1.0), rng.normal_f32(n, 0.0, 1.0));
        let split = PreAt::Split { gate: 3, up: n + 11 };
        let mut blocks = vec![f32::NAN; 2 * n + 11];
        blocks[3..3 + n].copy_from_slice(&g);
        blocks[n + 11..2 * n + 11].copy_from_slice(&u);
        let fused = PreAt::Fused { width };
        let rows: Vec<f32> = (0..n / width)
            .flat_map(|r| g[r * width..(r + 1) * width].iter().chain(&u[r * width..(r + 1) * width]))
            .copied()
            .collect();
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let want: Vec<f64> = (0..n).map(|e| g[e] as f64 * sig(g[e] as f64) * u[e] as f64).collect();
        let want_dg: Vec<f64> = (0..n)
            .map(|e| {
                let (x, s) = (g[e] as f64, sig(g[e] as f64));
                dh[e] as f64 * u[e] as f64 * s * (1.0 + x * (1.0 - s))
            })
            .collect();
        let want_du: Vec<f64> = (0..n).map(|e| dh[e] as f64 * g[e] as f64 * sig(g[e] as f64)).collect();
        for (at, gu) in [(split, blocks), (fused, rows)] {
            let mut h = vec![0f32; n];
            emu::swiglu(&gu, at, &mut h).unwrap();
            close("swiglu", &h, &want, 1e-6);
            let mut grads = gu.clone();
            emu::swiglu_backward(&mut grads, at, &dh).unwrap();
            let (gate_at, up_at, w, pitch) = at.layout(n);
            let pick =
                |base: usize| -> Vec<f32> { (0..n).map(|e| grads[base + (e / w) * pitch + e % w]).collect() };
            close("swiglu dg", &pick(gate_at), &want_dg, 1e-5);
            close("swiglu du", &pick(up_at), &want_du, 1e-5);
            // Nothing outside the two element sets is written (the split gap stays NaN).
            if let PreAt::Split { .. } = at {
                assert!(grads[..3].iter().chain(&grads[3 + n..n + 11]).all(|x| x.is_nan()), "{at:?}");
            }
        }
        assert!(
            emu::swiglu(&vec![0.0; 2 * n - 1], fused, &mut vec![0f32; n]).is_err(),
            "rows past the buffer"
        );
    }
    for (rows, width) in [(1usize, 1usize), (9, 513)] {
        let (a, b) = (rng.normal_f32(rows * width, 0.0, 1.0), rng.normal_f32(rows * width, 0.0, 1.0));
        let mut out = vec![0f32; rows];
        emu::row_dot(&a, &b, width, &mut out).unwrap();
        let want: Vec<f64> = (0..rows)
            .map(|r| (0..width).map(|c| a[r * width + c] as f64 * b[r * width + c] as f64).sum())
            .collect();
        close("row_dot", &out, &want, 1e-6);
    }
}
