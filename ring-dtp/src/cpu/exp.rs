//! A branch-free `e^x` for f32 that the compiler vectorizes (the fold and the gradient apply it
//! to every logit, so a scalar libm call per logit would cost as much as a GEMM here).
//!
//! `e^x = 2^n · e^r` with `n = round(x·log₂e)` and `r = x − n·ln 2` (ln 2 split in a high part
//! exact in f32 and a low correction, so `r` is exact to rounding), `|r| ≤ ln2/2`, and `e^r` by
//! the degree-7 minimax polynomial of Cephes' `expf`. The rounding uses the 1.5·2²³ trick (its
//! low mantissa bits then hold `n`), and `2^n` is assembled in the exponent field. Relative
//! error ≤ 2 ulp over the whole range (tested against f64). Inputs below
//! `ln(f32::MIN_POSITIVE)` give 0 (no subnormals), above 88.376 (where `2^n` would leave the
//! exponent field; the schedules only ever call it on `z − max ≤ 0`) give `+∞`; NaN stays NaN.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5·2²³: adding it rounds to an integer held in the low mantissa bits.
const ROUNDER: f32 = 12_582_912.0;
/// The smallest input whose result is a normal f32 (n ≥ −126).
const LOW: f32 = -87.336_54;
/// The largest input whose result is finite (n ≤ 127).
const HIGH: f32 = 88.376_26;

/// `e^x` (see the module docs for accuracy and range).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let xc = x.clamp(LOW, HIGH);
    let t = xc * LOG2E + ROUNDER;
    let n = t - ROUNDER;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * (r * r) + r + 1.0;
    // n = t's low mantissa bits − 2²², within [−126, 127]; 2^n's biased exponent is n + 127.
    let n_int = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let two_n = f32::from_bits(((n_int + 127) as u32) << 23);
    let y = er * two_n;
    if x < LOW {
        0.0
    } else if x > HIGH {
        f32::INFINITY
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::exp;

    #[test]
    fn within_two_ulp_of_f64_over_the_range() {
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.3 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_731;
        }
        assert!(worst <= 2.0 * f32::EPSILON as f64, "worst relative error {worst:e}");
    }

    #[test]
    fn edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!((exp(1.0) - std::f32::consts::E).abs() <= f32::EPSILON * 3.0);
    }
}
