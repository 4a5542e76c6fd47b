//! Seeded, dependency-free random inputs (SplitMix64): the same seed gives the same tensor on
//! every machine, so failures reproduce. Tests and benches never run on zeros.

/// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit state, full period, good enough for tests.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..bound` (`bound > 0`; Lemire's multiply-shift, bias < 2^-32).
    pub fn below(&mut self, bound: u64) -> u64 {
        ((self.next_u64() as u128 * bound as u128) >> 64) as u64
    }

    /// A standard normal sample (Box–Muller).
    pub fn next_normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `len` values uniform in `[lo, hi)`.
    pub fn uniform_f32(&mut self, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| lo + (hi - lo) * self.next_f64() as f32).collect()
    }

    /// `len` values from N(mean, std²).
    pub fn normal_f32(&mut self, len: usize, mean: f32, std: f32) -> Vec<f32> {
        (0..len).map(|_| mean + std * self.next_normal() as f32).collect()
    }

    /// A router's top-k choice, uniform: for each of `tokens` tokens `k` distinct experts of
    /// `0..experts` (a partial Fisher–Yates shuffle), token-major, as `topk` of random scores
    /// draws them. `k` above `experts` takes every expert.
    pub fn top_k_ids(&mut self, tokens: usize, experts: usize, k: usize) -> Vec<i64> {
        let k = k.min(experts);
        let mut pool: Vec<i64> = (0..experts as i64).collect();
        let mut ids = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            for j in 0..k {
                let pick = j + self.below((experts - j) as u64) as usize;
                pool.swap(j, pick);
                ids.push(pool[j]);
            }
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_ids_are_distinct_per_token_and_cover_the_experts() {
        let ids = SplitMix64::new(3).top_k_ids(500, 16, 4);
        assert_eq!(ids.len(), 2000);
        let mut seen = [0usize; 16];
        for token in ids.chunks(4) {
            let mut t = token.to_vec();
            t.sort_unstable();
            t.dedup();
            assert_eq!(t.len(), 4, "{token:?}");
            token.iter().for_each(|&e| seen[e as usize] += 1);
        }
        assert!(seen.iter().all(|&n| (75..=175).contains(&n)), "{seen:?}");
        assert_eq!(SplitMix64::new(1).top_k_ids(3, 2, 5).len(), 6, "k capped at the experts");
    }

    #[test]
    fn reproducible_and_spread() {
        let a = SplitMix64::new(42).uniform_f32(10_000, -1.0, 1.0);
        assert_eq!(a, SplitMix64::new(42).uniform_f32(10_000, -1.0, 1.0));
        assert_ne!(a, SplitMix64::new(43).uniform_f32(10_000, -1.0, 1.0));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        let n = SplitMix64::new(7).normal_f32(20_000, 2.0, 3.0);
        let m = n.iter().map(|&x| x as f64).sum::<f64>() / n.len() as f64;
        let var = n.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / n.len() as f64;
        assert!((m - 2.0).abs() < 0.1 && (var.sqrt() - 3.0).abs() < 0.1, "{m} {var}");
        let mut r = SplitMix64::new(1);
        assert!((0..1000).all(|_| r.below(7) < 7));
    }
}
