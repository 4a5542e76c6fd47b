//! One `moe_swiglu` call's arguments as every rank sees them, and the group's agreement on them:
//! each rank's sizes ([`Sizes`]) and the call's terms ([`CallTerms`]: the options' digest and
//! what a backward runs from) all-gathered as [`WORDS`] words, and one verdict computed from
//! the same words on every rank ([`agreed_shape`]): the layer's shape, or a refusal naming the
//! rank and the values that differ.

use flatpeak_common::comm::all_gather_words;
use flatpeak_common::{Communicator, ErrorKind};
use llep::{DType, Shape};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::Refusal;
use crate::tensor::shape_of;

/// The tensors of one call: `(hidden_states [T, H], topk_ids [T, k], topk_weights [T, k],
/// gate_up_proj [M, 2I, H], down_proj [M, H, I])`.
#[derive(FromPyObject)]
pub struct MoEArgs<'py> {
    #[pyo3(item(0))]
    pub(crate) x: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) ids: Bound<'py, PyAny>,
    #[pyo3(item(2))]
    pub(crate) weights: Bound<'py, PyAny>,
    #[pyo3(item(3))]
    pub(crate) gate_up: Bound<'py, PyAny>,
    #[pyo3(item(4))]
    pub(crate) down: Bound<'py, PyAny>,
}

/// The sizes a rank's tensors give: T, H, I, M, k and the storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sizes {
    pub(crate) tokens: usize,
    pub(crate) hidden: usize,
    pub(crate) intermediate: usize,
    pub(crate) local_experts: usize,
    pub(crate) top_k: usize,
    pub(crate) dtype: DType,
}

impl Sizes {
    pub(crate) fn of(args: &MoEArgs<'_>) -> PyResult<Self> {
        let x = shape_of("hidden_states", &args.x)?;
        let ids = shape_of("topk_ids", &args.ids)?;
        let gate_up = shape_of("gate_up_proj", &args.gate_up)?;
        let (&[t, h], &[ti, k], &[m, two_i, hg]) = (x.as_slice(), ids.as_slice(), gate_up.as_slice()) else {
            return Err(PyValueError::new_err(format!(
                "expected hidden_states [T, H], topk_ids [T, k] and gate_up_proj [E_local, 2I, H]: got {x:?}, {ids:?} and {gate_up:?}"
            )));
        };
        if ti != t || hg != h || two_i % 2 != 0 {
            return Err(PyValueError::new_err(format!(
                "topk_ids must be [{t}, k] and gate_up_proj [E_local, 2I, {h}] for hidden_states [{t}, {h}]: got {ids:?} and {gate_up:?}"
            )));
        }
        let dtype = match args.x.getattr("dtype")?.str()?.to_string().as_str() {
            "torch.bfloat16" => DType::Bf16,
            "torch.float32" => DType::F32,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "hidden_states: expected dtype torch.float32 or torch.bfloat16, got {other}"
                )));
            }
        };
        Ok(Self { tokens: t, hidden: h, intermediate: two_i / 2, local_experts: m, top_k: k, dtype })
    }

    /// T, H, I, M, k, E as given (0: not given), the dtype (1: bf16), where the tensors are
    /// (1: a CUDA device; the two paths run different exchanges) and the call's terms, for the
    /// all-gather.
    fn words(&self, experts: usize, on_cuda: bool, terms: CallTerms) -> [u64; WORDS] {
        let (dtype, device) = (usize::from(self.dtype == DType::Bf16), usize::from(on_cuda));
        let sizes = [
            self.tokens,
            self.hidden,
            self.intermediate,
            self.local_experts,
            self.top_k,
            experts,
            dtype,
            device,
        ]
        .map(|v| v as u64);
        let mut words = [0u64; WORDS];
        words[..8].copy_from_slice(&sizes);
        words[8] = terms.options;
        words[9] = u64::from(terms.backward == Backward::FromSaved);
        words
    }
}

/// Words each rank contributes to the agreement of a call.
const WORDS: usize = 10;

/// What a backward runs from: the exchanges differ (a saved backward dispatches dY rows only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backward {
    /// Recomputing each round (and every forward: its exchanges do not depend on what it keeps).
    Recomputing,
    /// From the activations a saving forward kept.
    FromSaved,
}

/// The terms every rank of a call must share besides its tensors' sizes: the options (the plan,
/// and so every exchange, follows from them) and what a backward runs from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallTerms {
    /// The options' digest (`MoEOptions::fingerprint`).
    pub(crate) options: u64,
    pub(crate) backward: Backward,
}

/// The layer's shape over the group, agreed from every rank's sizes (the same verdict on every
/// rank, computed from the same all-gathered words).
pub(crate) fn agreed_shape(
    comm: &dyn Communicator,
    mine: Sizes,
    experts: Option<usize>,
    on_cuda: bool,
    terms: CallTerms,
) -> Result<Shape, Refusal> {
    let p = comm.world_size();
    let words = all_gather_words(comm, &mine.words(experts.unwrap_or(0), on_cuda, terms))?;
    let ranks: Vec<&[u64]> = words.chunks_exact(WORDS).collect();
    let names = ["hidden", "intermediate", "E_local", "top_k", "num_experts"];
    for (r, w) in ranks.iter().enumerate() {
        if w[7] != ranks[0][7] {
            let (theirs, first) =
                (crate::ring_loss::device_name(w[7]), crate::ring_loss::device_name(ranks[0][7]));
            let message = format!("rank {r} passed {theirs} tensors where rank 0 passed {first} tensors");
            return Err(Refusal { kind: ErrorKind::Type, message });
        }
        if w[6] != ranks[0][6] {
            let name = |code: u64| if code == 1 { "torch.bfloat16" } else { "torch.float32" };
            return Err(Refusal {
                kind: ErrorKind::Type,
                message: format!(
                    "rank {r} passed {} tensors where rank 0 passed {}",
                    name(w[6]),
                    name(ranks[0][6])
                ),
            });
        }
        if w[1..6] != ranks[0][1..6] {
            let show = |w: &[u64]| {
                names.iter().zip(&w[1..6]).map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>().join(", ")
            };
            return Err(Refusal {
                kind: ErrorKind::Value,
                message: format!("rank {r} passed {} where rank 0 passed {}", show(w), show(ranks[0])),
            });
        }
    }
    for (r, w) in ranks.iter().enumerate() {
        if w[8] != ranks[0][8] {
            let message = format!(
                "rank {r} passed other options than rank 0 (scheme, pair_cap_rows, budget_bytes, activations, ...): \
                 every rank of the group must pass the same"
            );
            return Err(Refusal { kind: ErrorKind::Value, message });
        }
        if w[9] != ranks[0][9] {
            let runs = |word: u64| if word == 1 { "from saved activations" } else { "recomputing" };
            let message = format!(
                "rank {r}'s backward runs {} where rank 0's runs {}: every rank's forward must keep the same \
                 (the same activations= and a gradient needed on every rank)",
                runs(w[9]),
                runs(ranks[0][9])
            );
            return Err(Refusal { kind: ErrorKind::Value, message });
        }
    }
    let experts = experts.unwrap_or(mine.local_experts * p);
    if experts != mine.local_experts * p {
        return Err(Refusal {
            kind: ErrorKind::Value,
            message: format!(
                "num_experts={experts} is not E_local × group size = {} × {p}: expert e lives on rank e // E_local",
                mine.local_experts
            ),
        });
    }
    let tokens = ranks.iter().map(|w| w[0] as usize).max().unwrap_or(0);
    Ok(Shape {
        ranks: p,
        tokens,
        hidden: mine.hidden,
        intermediate: mine.intermediate,
        experts,
        top_k: mine.top_k,
        dtype: mine.dtype,
    })
}
