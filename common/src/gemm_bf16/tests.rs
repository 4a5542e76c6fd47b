//! The bf16 GEMM against a naive f64 product, on every kernel this CPU has.

use super::*;
use crate::rng::SplitMix64;

/// Runs `check` on every bf16 kernel this CPU has (AMX and AVX512-BF16 here, none on a CPU
/// without the instructions, where the callers' widening path is what runs).
fn for_each_kernel(check: impl Fn(Bf16Gemm)) {
    let kernels: Vec<Bf16Gemm> =
        [Bf16Gemm::detect(), Bf16Gemm::avx512_bf16()].into_iter().flatten().collect();
    if kernels.is_empty() {
        eprintln!("no AVX512-BF16 or AMX on this CPU: the kernels are not exercised");
    }
    for (i, &gemm) in kernels.iter().enumerate() {
        if !kernels[..i].contains(&gemm) {
            eprintln!("kernel: {}", gemm.name());
            check(gemm);
        }
    }
}

fn data(len: usize, seed: u64) -> Vec<bf16> {
    SplitMix64::new(seed).normal_f32(len, 0.0, 1.0).into_iter().map(bf16::from_f32).collect()
}

/// `a · bᵀ` in f64 and `Σ|a||b|` per element (the f32 summation's error scale).
fn naive(m: usize, n: usize, k: usize, a: &[bf16], b: &[bf16]) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let prod = a[i * k + p].to_f64() * b[j * k + p].to_f64();
                c[i * n + j] += prod;
                abs[i * n + j] += prod.abs();
            }
        }
    }
    (c, abs)
}

#[test]
fn matches_naive_on_edge_shapes() {
    for_each_kernel(|gemm| {
        let dims = [1, 2, 7, 8, 9, 31, 32, 33, 65, 130];
        let mut seed = 0;
        for &m in &dims {
            for &n in &[1, 15, 16, 17, 32, 33, 64, 70] {
                for &k in &[1, 2, 3, 16, 17, 128, 129, 300] {
                    seed += 1;
                    let (a, b) = (data(m * k, seed), data(n * k, seed + 1000));
                    let (reference, abs) = naive(m, n, k, &a, &b);
                    for (accumulate, scale, threads) in
                        [(Accumulate::Replace, 1.0, Threads::All), (Accumulate::Add, 0.5, Threads::Single)]
                    {
                        // A row stride wider than n: the kernel must leave the gap alone.
                        let stride = n + 3;
                        let mut c = vec![1.0f32; m * stride];
                        let options =
                            MatmulOptions::with_accumulate(accumulate).scale(scale).threads(threads);
                        gemm.matmul_nt(MatMut::strided(&mut c, m, n, stride, 1).unwrap(), &a, &b, k, options)
                            .unwrap();
                        for i in 0..m {
                            for j in 0..n {
                                let base = if accumulate == Accumulate::Add { 1.0 } else { 0.0 };
                                let expected = base + scale as f64 * reference[i * n + j];
                                let got = c[i * stride + j] as f64;
                                let tol = 1e-6 * (k as f64) * abs[i * n + j] + 1e-6;
                                assert!(
                                    (got - expected).abs() <= tol,
                                    "m={m} n={n} k={k} ({i},{j}): {got} vs {expected}"
                                );
                            }
                            assert!(
                                c[i * stride + n..(i + 1) * stride].iter().all(|&g| g == 1.0),
                                "gap written"
                            );
                        }
                    }
                }
            }
        }
    });
}

#[test]
fn thread_count_does_not_change_bits() {
    for_each_kernel(|gemm| {
        let (m, n, k) = (517, 77, 301);
        let (a, b) = (data(m * k, 1), data(n * k, 2));
        let run = |threads| {
            let mut c = vec![0.0f32; m * n];
            let options = MatmulOptions::default().threads(threads);
            gemm.matmul_nt(MatMut::row_major(&mut c, m, n).unwrap(), &a, &b, k, options).unwrap();
            c
        };
        let single = run(Threads::Single);
        assert_eq!(single, run(Threads::All));
        assert_eq!(single, run(Threads::Exactly(3)));
    });
}

/// `a · b` for strided views, in f64, and `Σ|a||b|` per element.
fn naive_views(a: MatRef<'_, bf16>, b: MatRef<'_, bf16>) -> (Vec<f64>, Vec<f64>) {
    let ((ad, m, k, ars, acs), (bd, _, n, brs, bcs)) = (a.parts(), b.parts());
    let mut c = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let prod = ad[i * ars + p * acs].to_f64() * bd[p * brs + j * bcs].to_f64();
                c[i * n + j] += prod;
                abs[i * n + j] += prod.abs();
            }
        }
    }
    (c, abs)
}

/// Every layout of the two operands (the backward GEMMs read a transposed gradient and a
/// transposed weight block), with k within one packed chunk and across three.
#[test]
fn strided_operands_match_naive() {
    for_each_kernel(|gemm| {
        let mut seed = 50_000;
        for &(m, n, k) in &[
            (1, 1, 1),
            (9, 33, 255),
            (130, 17, 256),
            (33, 70, 257),
            (7, 40, 1023),
            (5, 33, 2 * KC + 3),
            (129, 65, 0),
        ] {
            seed += 1;
            let (a_data, b_data) = (data(m * k, seed), data(k * n, seed + 1));
            for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = if a_t {
                    MatRef::row_major(&a_data, k, m).unwrap().t()
                } else {
                    MatRef::row_major(&a_data, m, k).unwrap()
                };
                let b = if b_t {
                    MatRef::row_major(&b_data, n, k).unwrap().t()
                } else {
                    MatRef::row_major(&b_data, k, n).unwrap()
                };
                let (reference, abs) = naive_views(a, b);
                let mut c = vec![7.0f32; m * n];
                let options = MatmulOptions::default().scale(2.0);
                gemm.matmul(MatMut::row_major(&mut c, m, n).unwrap(), a, b, options).unwrap();
                for (idx, (&got, (&r, &s))) in c.iter().zip(reference.iter().zip(&abs)).enumerate() {
                    let tol = 2e-6 * (k as f64) * s + 1e-6;
                    assert!(
                        (got as f64 - 2.0 * r).abs() <= tol,
                        "m={m} n={n} k={k} a_t={a_t} b_t={b_t} at {idx}: {got} vs {}",
                        2.0 * r
                    );
                }
            }
        }
    });
}

#[test]
fn scratch_is_independent_of_the_shapes() {
    assert_eq!(SCRATCH_BYTES_PER_THREAD, (ROW_BLOCK * (KC / 2 + 16) + KC / 2 * NC) * 4);
    assert_eq!(NC % NR, 0);
}

#[test]
fn bad_shapes_are_typed_errors() {
    for_each_kernel(|gemm| {
        let a = data(6, 1);
        let mut c = vec![0.0f32; 4];
        let err = gemm.matmul_nt(
            MatMut::row_major(&mut c, 2, 2).unwrap(),
            &a,
            &a[..5],
            3,
            MatmulOptions::default(),
        );
        assert!(matches!(err, Err(Error::ShapeMismatch { what: "b (n·k)", expected: 6, got: 5 })), "{err:?}");
        let err = gemm.matmul(
            MatMut::row_major(&mut c, 2, 2).unwrap(),
            MatRef::row_major(&a, 2, 3).unwrap(),
            MatRef::row_major(&a, 3, 2).unwrap().t(),
            MatmulOptions::default(),
        );
        assert!(
            matches!(err, Err(Error::ShapeMismatch { what: "b rows (k)", expected: 3, got: 2 })),
            "{err:?}"
        );
        let err =
            gemm.matmul_nt(MatMut::col_major(&mut c, 2, 2).unwrap(), &a, &a, 3, MatmulOptions::default());
        assert!(matches!(err, Err(Error::ShapeMismatch { what: "dst column stride", .. })), "{err:?}");
    });
}

#[test]
fn kernel_choices_name_their_paths() {
    assert_eq!(Bf16Kernel::Widened.select(), None);
    assert_eq!(Bf16Kernel::Widened.path_name(), "widened");
    assert_eq!(Bf16Kernel::default(), Bf16Kernel::Detect);
    match Bf16Gemm::avx512_bf16() {
        Some(gemm) => {
            assert_eq!(Bf16Kernel::Avx512Bf16.path_name(), "avx512-bf16");
            assert_eq!(gemm.name(), "avx512-bf16");
            // Detect never picks something slower than the dot products.
            assert_ne!(Bf16Kernel::Detect.path_name(), "widened");
        }
        None => assert_eq!(Bf16Kernel::Avx512Bf16.select(), None),
    }
}
