//! `flatpeak run sco`: a stack of L residual MLP blocks `y = x + relu(x·W1)·W2` trained one step
//! under selective checkpoint offload (or plain checkpointing, or none).
//!
//! Inputs: `x` [S, H] F32, `w1` [L, H, I] F32, `w2` [L, I, H] F32, `dy` [S, H] F32 (the
//! gradient of the loss with respect to the stack's output). Outputs: `y` [S, H], `dx` [S, H],
//! `dw1` [L, H, I] and `dw2` [L, I, H], all F32.

use flatpeak_common::Link;
use sco::layers::ResidualMlp;
use sco::{CheckpointedStack, Checkpointing, Config};
use serde::Deserialize;

use super::{Dim, Outputs, RunError, TensorFile};

/// `"offload"` (SCO), `"on_device"` (plain checkpointing) or `"off"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointingName {
    /// Selective checkpoint offload.
    #[default]
    Offload,
    /// Every boundary on the device.
    OnDevice,
    /// No checkpointing.
    Off,
}

/// The config file of `flatpeak run sco`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoRunConfig {
    /// Where the boundaries live.
    pub checkpointing: CheckpointingName,
    /// Newest boundaries kept on the device.
    pub keep_resident: usize,
    /// Forward copies in flight.
    pub in_flight: usize,
    /// Backward prefetch distance.
    pub prefetch_distance: usize,
}

impl Default for ScoRunConfig {
    fn default() -> Self {
        let o = Config::default();
        Self {
            checkpointing: CheckpointingName::Offload,
            keep_resident: o.keep_resident,
            in_flight: o.in_flight,
            prefetch_distance: o.prefetch_distance,
        }
    }
}

/// Runs one step on the tensors of `t`.
pub fn run(t: &TensorFile, cfg: &ScoRunConfig) -> Result<Outputs, RunError> {
    let (x, xs) = t.f32("x", &[Dim::Any, Dim::Any])?;
    let (s, h) = (xs[0], xs[1]);
    let (w1, ws) = t.f32("w1", &[Dim::Any, Dim::Is(h), Dim::Any])?;
    let (l, i) = (ws[0], ws[2]);
    let (w2, _) = t.f32("w2", &[Dim::Is(l), Dim::Is(i), Dim::Is(h)])?;
    let (dy, _) = t.f32("dy", &[Dim::Is(s), Dim::Is(h)])?;
    let layers = (0..l)
        .map(|j| {
            let (a, b) = (w1[j * h * i..(j + 1) * h * i].to_vec(), w2[j * i * h..(j + 1) * i * h].to_vec());
            ResidualMlp::from_weights(s, h, i, a, b)
        })
        .collect::<sco::Result<Vec<_>>>()?;
    let mode = match cfg.checkpointing {
        CheckpointingName::Offload => Checkpointing::Offload,
        CheckpointingName::OnDevice => Checkpointing::OnDevice,
        CheckpointingName::Off => Checkpointing::Off,
    };
    let config = Config::default()
        .keep_resident(cfg.keep_resident)
        .in_flight(cfg.in_flight)
        .prefetch_distance(cfg.prefetch_distance);
    let mut stack = CheckpointedStack::new(layers, mode, &config, Link::Memcpy)?;
    let step = stack.step(&x, |_| Ok(dy.clone()))?;
    let mut out = Outputs::default();
    out.f32("y", &[s, h], &step.output);
    out.f32("dx", &[s, h], &step.grad_input);
    let (mut dw1, mut dw2) = (Vec::with_capacity(l * h * i), Vec::with_capacity(l * i * h));
    for g in &step.param_grads {
        dw1.extend_from_slice(&g[..h * i]);
        dw2.extend_from_slice(&g[h * i..]);
    }
    out.f32("dw1", &[l, h, i], &dw1);
    out.f32("dw2", &[l, i, h], &dw2);
    Ok(out)
}
