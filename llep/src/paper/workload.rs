//! The LLEP harness's routing profiles (`test_llep.py`), so benches and tests replay the
//! paper's workloads: `balanced` sends slot j of token i to expert `(i + j) mod E`; `r:h` makes
//! the first ⌊r·N⌋ tokens hot, slot j → expert `j mod h`, and the rest cold,
//! slot j → `h + ((i + j) mod (E − h))`. Every rank gets the same ids (as in the harness).
//! With h < k a hot token sends several slots to one expert: duplicate ids are legal routes.

use std::fmt;
use std::str::FromStr;

use flatpeak_common::SplitMix64;

use crate::config::Shape;
use crate::error::{Error, Result};

/// A routing profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Profile {
    /// Slot j of token i → expert `(i + j) mod E`.
    Balanced,
    /// The first ⌊ratio·N⌋ tokens send slot j to expert `j mod experts`; the rest go to
    /// `experts + ((i + j) mod (E − experts))`.
    Hot {
        /// Fraction of hot tokens, in [0, 1].
        ratio: f64,
        /// h: hot experts, ≥ 1.
        experts: usize,
    },
}

impl FromStr for Profile {
    type Err = Error;

    /// `balanced`, or `r:h` with r a percentage (an optional `%`, as in `50%:4`) and h ≥ 1.
    fn from_str(spec: &str) -> Result<Self> {
        let bad = |reason| Error::InvalidProfile { spec: spec.to_string(), reason };
        if spec.trim().eq_ignore_ascii_case("balanced") {
            return Ok(Profile::Balanced);
        }
        let (r, h) = spec.split_once(':').ok_or_else(|| bad("expected `balanced` or `r:h`"))?;
        let r = r.trim();
        let percent: f64 =
            r.strip_suffix('%').unwrap_or(r).trim().parse().map_err(|_| bad("r is not a number"))?;
        if !(0.0..=100.0).contains(&percent) {
            return Err(bad("r must be a percentage in 0..=100"));
        }
        let experts: usize = h.trim().parse().map_err(|_| bad("h is not a whole number"))?;
        if experts == 0 {
            return Err(bad("h must be at least 1"));
        }
        Ok(Profile::Hot { ratio: percent / 100.0, experts })
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Profile::Balanced => f.write_str("balanced"),
            Profile::Hot { ratio, experts } => write!(f, "{}%:{experts}", ratio * 100.0),
        }
    }
}

impl Profile {
    /// The N×k ids of one rank (the same on every rank).
    pub fn ids(&self, shape: &Shape) -> Result<Vec<i64>> {
        let (n, k, e) = (shape.tokens, shape.top_k, shape.experts);
        let mut ids = Vec::with_capacity(n * k);
        match *self {
            Profile::Balanced => {
                for i in 0..n {
                    ids.extend((0..k).map(|j| ((i + j) % e) as i64));
                }
            }
            Profile::Hot { ratio, experts: h } => {
                let hot = ((ratio * n as f64).floor() as usize).min(n);
                if h > e || (h == e && hot < n) {
                    return Err(Error::InvalidProfile {
                        spec: self.to_string(),
                        reason: "h must be below E (or equal to E with every token hot)",
                    });
                }
                for i in 0..n {
                    if i < hot {
                        ids.extend((0..k).map(|j| (j % h) as i64));
                    } else {
                        ids.extend((0..k).map(|j| (h + (i + j) % (e - h)) as i64));
                    }
                }
            }
        }
        Ok(ids)
    }
}

/// Routing weights for N tokens × k slots: a softmax over k standard-normal logits per token,
/// seeded (so they sum to 1 per token, as a router's top-k renormalisation gives).
pub fn routing_weights(tokens: usize, top_k: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let logits: Vec<f64> = (0..top_k).map(|_| rng.next_normal()).collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|z| (z - max).exp()).sum();
        out.extend(logits.iter().map(|z| ((z - max).exp() / sum) as f32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatpeak_common::DType;

    fn shape(n: usize, e: usize, k: usize) -> Shape {
        Shape { ranks: 1, tokens: n, hidden: 1, intermediate: 1, experts: e, top_k: k, dtype: DType::F32 }
    }

    #[test]
    fn parses_the_harness_strings() {
        assert_eq!("balanced".parse::<Profile>().unwrap(), Profile::Balanced);
        assert_eq!("50:4".parse::<Profile>().unwrap(), Profile::Hot { ratio: 0.5, experts: 4 });
        assert_eq!("95%:1".parse::<Profile>().unwrap(), Profile::Hot { ratio: 0.95, experts: 1 });
        assert_eq!("100:1".parse::<Profile>().unwrap(), Profile::Hot { ratio: 1.0, experts: 1 });
        for bad in ["", "50", "x:4", "50:0", "101:2", "-5:2", "50:-1"] {
            assert!(matches!(bad.parse::<Profile>(), Err(Error::InvalidProfile { .. })), "{bad}");
        }
    }

    #[test]
    fn ids_follow_the_harness() {
        let s = shape(10, 8, 3);
        let ids = Profile::Hot { ratio: 0.5, experts: 2 }.ids(&s).unwrap();
        assert_eq!(&ids[..3], &[0, 1, 0]); // hot, duplicate id 0
        assert_eq!(&ids[15..18], &[7, 2, 3]); // token 5 is cold: 2 + (5 + j) mod 6
        let bal = Profile::Balanced.ids(&s).unwrap();
        assert_eq!(&bal[27..30], &[1, 2, 3]); // token 9: (9 + j) mod 8
        assert!(Profile::Hot { ratio: 0.5, experts: 8 }.ids(&s).is_err());
        assert!(Profile::Hot { ratio: 1.0, experts: 8 }.ids(&s).is_ok());
        let w = routing_weights(4, 3, 7);
        assert!(w.chunks(3).all(|t| (t.iter().sum::<f32>() - 1.0).abs() < 1e-6));
    }
}
