//! Error metrics shared by tests, benches and `flatpeak report`.

/// Norm-wise relative error ‖got − want‖₂ / ‖want‖₂ against an f64 oracle. When `want` is all
/// zeros it returns ‖got‖₂ (absolute), so an exact zero still compares as 0. Any NaN or infinity
/// in `got` where `want` is finite gives `f64::INFINITY`. Lengths must match (else infinity).
pub fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        let g = g as f64;
        if !g.is_finite() && w.is_finite() {
            return f64::INFINITY;
        }
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    if norm == 0.0 { diff.sqrt() } else { (diff / norm).sqrt() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_cases() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((relative_error(&[3.0, 4.0], &[3.0, 4.5]) - 0.5 / 4.5f64.hypot(3.0)).abs() < 1e-12);
        assert_eq!(relative_error(&[0.0], &[0.0]), 0.0);
        assert_eq!(relative_error(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(relative_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(relative_error(&[], &[]), 0.0);
    }
}
