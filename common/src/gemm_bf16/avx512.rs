//! The AVX512-BF16 micro-kernel: an [`MR`](super::MR)×[`NR`] tile of the output in 16 zmm accumulators;
//! per pair of k, two panel loads, `MR` broadcasts of `a`'s pair and `2·MR` `vdpbf16ps`.

use super::{A_STRIDE, NR, Step};

/// [`kernel`] with the row count `mr` (1 to [`MR`](super::MR)) as a constant, so its accumulators stay in
/// registers.
///
/// # Safety
/// As [`kernel`], with `M = mr`.
pub(super) unsafe fn kernel_rows(
    step: Step,
    a: &[u32],
    panel: &[u32],
    (mr, nr, j0): (usize, usize, usize),
    out: &mut [f32],
) {
    // SAFETY: the caller's contract is `kernel`'s, for every row count.
    unsafe {
        match mr {
            8 => kernel::<8>(step, a, panel, (nr, j0), out),
            7 => kernel::<7>(step, a, panel, (nr, j0), out),
            6 => kernel::<6>(step, a, panel, (nr, j0), out),
            5 => kernel::<5>(step, a, panel, (nr, j0), out),
            4 => kernel::<4>(step, a, panel, (nr, j0), out),
            3 => kernel::<3>(step, a, panel, (nr, j0), out),
            2 => kernel::<2>(step, a, panel, (nr, j0), out),
            _ => kernel::<1>(step, a, panel, (nr, j0), out),
        }
    }
}

/// The `M × nr` micro-kernel at output column `j0`, adding or writing one chunk of k.
///
/// # Safety
/// The CPU must have AVX512F and AVX512-BF16; `a` is `M` packed rows of [`KP`](super::KP) u32
/// at a stride of [`A_STRIDE`], `panel`
/// is `KP·NR` u32, `step.pairs ≤ KP`, and `out` holds `M` rows of `step.row_stride` floats
/// starting at column `j0`, each with at least `j0 + nr` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel<const M: usize>(
    step: Step,
    a: &[u32],
    panel: &[u32],
    (nr, j0): (usize, usize),
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; M];
    let a_ptr = a.as_ptr();
    let p_ptr = panel.as_ptr();
    for p in 0..step.pairs {
        // SAFETY: p < pairs ≤ KP, so the panel's row p (NR u32 = two 512-bit loads) is in
        // bounds; the transmutes reinterpret 64 bytes of vector data, valid as either type.
        let (b0, b1) = unsafe {
            let row = p_ptr.add(p * NR) as *const __m512i;
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row.add(1))),
            )
        };
        for (i, acc_i) in acc.iter_mut().enumerate() {
            // SAFETY: i < M = mr and p < KP: the pair is inside `a`'s `mr` rows of
            // `A_STRIDE ≥ KP` u32.
            let pair = unsafe { *a_ptr.add(i * A_STRIDE + p) };
            // SAFETY: __m512i and __m512bh are both 64 bytes of plain vector data; every bit
            // pattern is a valid value of either.
            let broadcast =
                unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32)) };
            acc_i[0] = _mm512_dpbf16_ps(acc_i[0], b0, broadcast);
            acc_i[1] = _mm512_dpbf16_ps(acc_i[1], b1, broadcast);
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        for (half, acc_h) in acc_i.iter().enumerate() {
            let c0 = half * 16;
            if c0 >= nr {
                break;
            }
            // SAFETY: row i < mr and columns j0 + c0 .. j0 + c0 + min(nr − c0, 16) ≤ j0 + nr lie
            // in `out` (the caller's contract); AVX512F is this function's target feature.
            unsafe {
                let ptr = out.as_mut_ptr().add(i * step.row_stride + j0 + c0);
                store_lanes(step, *acc_h, ptr, (nr - c0).min(16));
            }
        }
    }
}

/// The epilogue of both kernels: `ptr[..lanes] ← [ptr[..lanes] +] scale·value[..lanes]`
/// (`lanes ≤ 16`; the other lanes are neither read nor written).
///
/// # Safety
/// The CPU must have AVX512F; `ptr` is valid for reading and writing `lanes` f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store_lanes(step: Step, value: std::arch::x86_64::__m512, ptr: *mut f32, lanes: usize) {
    use std::arch::x86_64::*;
    let mask: __mmask16 = if lanes >= 16 { 0xffff } else { (1u16 << lanes) - 1 };
    let mut value = _mm512_mul_ps(value, _mm512_set1_ps(step.scale));
    // SAFETY: the masked lanes (`lanes` of them) of `ptr` are valid (the contract); masked-off
    // lanes are not touched.
    unsafe {
        if step.add {
            value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, ptr));
        }
        _mm512_mask_storeu_ps(ptr, mask, value);
    }
}

/// Never called: [`Bf16Gemm::detect`](super::Bf16Gemm::detect) returns `None` off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<const M: usize>(_: Step, _: &[u32], _: &[u32], _: (usize, usize), _: &mut [f32]) {}
