//! Launch sizing, pure: from the config, the shape and a byte budget, the pair cap q and every
//! buffer PipelinedLLEP's executors carve, before any routing is known. No device, no
//! communication. The routing-dependent part of a call (assignment, rounds) is the
//! [`Schedule`](crate::Schedule).

use flatpeak_common::Budget;
use flatpeak_common::arena::Arena;

use crate::config::{Config, Mode, PairCap, Scheme, Shape, checked_product, saturating_product};
use crate::error::{Error, Result};

/// One routed entry of a dispatched row: the destination's local expert slot (native experts
/// first, then foreign slots) and the routing weight. `slot == u32::MAX` pads unused entries.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RouteMeta {
    /// Local expert slot at the destination.
    pub slot: u32,
    /// Routing weight w_ij.
    pub weight: f32,
}

impl RouteMeta {
    /// The padding entry.
    pub const EMPTY: Self = Self { slot: u32::MAX, weight: 0.0 };
}

/// One route of a received round grouped by local expert: its row in the receive buffer and
/// its entry in the row's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct GroupEntry {
    /// Row of the receive buffer.
    pub row: u32,
    /// Index into the receive metadata (`row·k + entry`).
    pub meta: u32,
}

/// Which pass a set of buffers serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward: x rows out, weighted expert outputs back.
    Forward,
    /// Backward (checkpointed): x and dY rows out, recompute, dX rows and d(weights) back.
    Backward,
}

/// PipelinedLLEP's launch plan: the pair cap q and the buffers of both passes, fixed by the
/// config, the shape and the budget before any routing is known. Every call's
/// [`Schedule`](crate::Schedule) runs within it: imbalance costs rounds, never memory.
///
/// The baselines ([`Scheme::Llep`], [`Scheme::StandardEp`]) size their buffers to each call's
/// routing ([`Schedule::buffers`](crate::Schedule::buffers)), so no launch-time working set bounds
/// them: their plan runs one round (q = N) and is not checked against the budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    config: Config,
    shape: Shape,
    pair_cap: usize,
}

impl Plan {
    /// Validates `config` and `shape` and fixes q: [`PairCap::Rows`] as given (at most N),
    /// [`PairCap::FitBudget`] the largest q ≤ N whose [`workspace_bytes`](Plan::workspace_bytes)
    /// fit `budget` (N when unlimited). [`Error::BudgetTooSmall`] when the buffers of the
    /// chosen q (or of one row per rank pair) exceed the budget. Every size is checked for
    /// overflow.
    pub fn new(config: &Config, shape: Shape, budget: Budget) -> Result<Self> {
        config.validate()?;
        shape.validate()?;
        // Every scheme's call returns the N×H f32 output and fills the 8·N·k bytes of route
        // tables: a shape whose sizes do not fit a usize is refused here, whatever the scheme.
        let (n, h, k) = (shape.tokens, shape.hidden, shape.top_k);
        for (what, factors) in
            [("llep output (N·H·4 bytes)", [n, h, 4]), ("llep route tables (8·N·k bytes)", [n, k, 8])]
        {
            if checked_product(&factors).is_none() {
                return Err(Error::Common(flatpeak_common::Error::SizeOverflow { what }));
            }
        }
        let n = shape.tokens.max(1);
        let bytes = |q: usize| Self::bytes_at(config, &shape, q);
        let q = match (config.scheme, config.pair_cap) {
            (Scheme::Llep | Scheme::StandardEp, _) => {
                return Ok(Self { config: *config, shape, pair_cap: n });
            }
            (Scheme::PipelinedLlep, PairCap::Rows(q)) => q.min(n),
            (Scheme::PipelinedLlep, PairCap::FitBudget) => {
                if budget.admits(bytes(n)?) {
                    n
                } else {
                    // The bytes grow with q: the largest q that fits, by bisection.
                    let (mut fits, mut over) = (0usize, n);
                    while over - fits > 1 {
                        let mid = fits + (over - fits) / 2;
                        if budget.admits(bytes(mid)?) { fits = mid } else { over = mid }
                    }
                    fits.max(1)
                }
            }
        };
        let needed = bytes(q)?;
        if !budget.admits(needed) {
            let what = if q == 1 { "one row per rank pair" } else { "the pair cap's buffers" };
            return Err(Error::BudgetTooSmall { budget: budget.bytes(), needed, what });
        }
        Ok(Self { config: *config, shape, pair_cap: q })
    }

    /// The larger of the two passes' workspaces at pair cap q, or an overflow error.
    fn bytes_at(config: &Config, shape: &Shape, q: usize) -> Result<usize> {
        [Pass::Forward, Pass::Backward]
            .into_iter()
            .map(|pass| Buffers::pipelined(config, shape, q, pass).checked_workspace_bytes())
            .try_fold(0, |most, b| Ok(most.max(b?)))
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// q: rows any source sends any destination in one round.
    pub fn pair_cap(&self) -> usize {
        self.pair_cap
    }
    /// The buffers one rank carves for `pass`: `send_rows = recv_rows = G = P·q`, D copies,
    /// F_max foreign slots.
    pub fn buffers(&self, pass: Pass) -> Buffers {
        Buffers::pipelined(&self.config, &self.shape, self.pair_cap, pass)
    }
    /// PipelinedLLEP's working set, reserved at launch: the larger pass's buffers (backward),
    /// within the budget the plan was made for. (The baselines' is each call's
    /// [`Schedule::max_workspace_bytes`](crate::Schedule::max_workspace_bytes).)
    pub fn workspace_bytes(&self) -> usize {
        self.buffers(Pass::Forward).workspace_bytes().max(self.buffers(Pass::Backward).workspace_bytes())
    }

    /// The most device memory one pass of a call holds besides its inputs, on a GPU
    /// ([`Buffers::device_bytes`]), the larger of the two passes.
    pub fn device_bytes(&self) -> usize {
        self.pass_device_bytes(Pass::Forward).max(self.pass_device_bytes(Pass::Backward))
    }

    /// [`Buffers::device_bytes`] of one pass.
    pub fn pass_device_bytes(&self, pass: Pass) -> usize {
        self.buffers(pass).device_bytes()
    }

    /// Bytes of lent device memory enough for either pass of a PipelinedLLEP call to carve every
    /// buffer from ([`Buffers::device_arena_bytes`], the larger pass); a baseline's buffers
    /// follow its call's schedule ([`Schedule::buffers`](crate::Schedule::buffers)).
    pub fn device_arena_bytes(&self) -> usize {
        let [f, b] = [Pass::Forward, Pass::Backward].map(|pass| self.buffers(pass).device_arena_bytes());
        f.max(b)
    }

    /// The least budget PipelinedLLEP runs `shape` in: its working set at one row per rank pair
    /// (q = 1), foreign weight slots and expert scratch included. A budget below it is
    /// [`Error::BudgetTooSmall`]; the other schemes take no budget. Checked for overflow.
    pub fn least_workspace_bytes(config: &Config, shape: &Shape) -> Result<usize> {
        config.validate()?;
        shape.validate()?;
        Self::bytes_at(config, shape, 1)
    }
}

/// The buffers one rank reserves for one pass, in rows (all sizes fixed before the call): what
/// the round schedule ([`crate::device`]) reserves, on every backend. Per pipeline copy: a send
/// buffer of `send_rows` rows (also the combine's receive buffer) with its token list, a receive
/// buffer and an output buffer of `recv_rows` rows, each H wide, with k metadata entries per
/// row; backward adds dY send/receive buffers and d(weights) buffers. Once: the expert scratch
/// (X, Y and SwiGLU intermediates of G rows; backward adds dY, h and the routes' dot products),
/// a round's index lists (recv_rows·k routes), F foreign weight slots (3·H·I each; backward adds their
/// gradients and one H·I return buffer), and on the host the N·k-entry route tables, the
/// received metadata's staging and the grouping arrays. [`Buffers::regions`] lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffers {
    pub(crate) shape: Shape,
    pub(crate) pass: Pass,
    pub(crate) depth: usize,
    pub(crate) send_rows: usize,
    pub(crate) recv_rows: usize,
    pub(crate) expert_rows: usize,
    pub(crate) foreign_slots: usize,
}

impl Buffers {
    /// PipelinedLLEP's buffers for pair cap q: `send_rows = recv_rows = G = P·q`, D copies,
    /// F_max slots. Depends on the config and shape only. One rank (P = 1) keeps one copy and no
    /// foreign slots: its exchanges are with itself (nothing to overlap a round's compute with)
    /// and every expert is its own.
    pub fn pipelined(config: &Config, shape: &Shape, q: usize, pass: Pass) -> Self {
        let rows = shape.ranks.saturating_mul(q);
        let alone = shape.ranks == 1;
        Self {
            shape: *shape,
            pass,
            depth: if alone { 1 } else { config.pipeline_depth },
            send_rows: rows,
            recv_rows: rows,
            expert_rows: rows,
            foreign_slots: if alone { 0 } else { config.foreign_slots },
        }
    }

    /// Dispatch bytes per row of one pipeline copy: send, receive and output rows with their
    /// metadata and the send row's token index (backward: also dY rows and d(weights)).
    /// Saturates at `usize::MAX` for a shape whose row does not fit.
    pub fn dispatch_bytes_per_row(shape: &Shape, pass: Pass) -> usize {
        let (h, k, b) = (shape.hidden, shape.top_k, shape.elem_bytes());
        let meta = saturating_product(&[std::mem::size_of::<RouteMeta>(), k]);
        match pass {
            Pass::Forward => {
                saturating_sum(&[saturating_product(&[3, h, b]), saturating_product(&[2, meta]), 4])
            }
            Pass::Backward => saturating_sum(&[
                saturating_product(&[5, h, b]),
                saturating_product(&[2, meta]),
                4,
                saturating_product(&[8, k]),
            ]),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// Rows of the send buffer per copy.
    pub fn send_rows(&self) -> usize {
        self.send_rows
    }
    /// Rows of the receive buffer per copy.
    pub fn recv_rows(&self) -> usize {
        self.recv_rows
    }
    /// G: rows of one expert GEMM.
    pub fn expert_rows(&self) -> usize {
        self.expert_rows
    }
    /// Foreign weight slots.
    pub fn foreign_slots(&self) -> usize {
        self.foreign_slots
    }
    /// Pipeline copies D.
    pub fn depth(&self) -> usize {
        self.depth
    }
    /// The pass.
    pub fn pass(&self) -> Pass {
        self.pass
    }
    /// Local expert slots, M + F.
    pub fn local_slots(&self) -> usize {
        self.shape.local_experts().saturating_add(self.foreign_slots)
    }

    /// Every region in reservation order, in bytes, computed in u128 so no product overflows,
    /// with whether it lives on the host (`true`) or the device.
    fn regions_wide(&self) -> Vec<(u128, bool)> {
        let s = &self.shape;
        let w = |x: usize| x as u128;
        // Products saturate: a region past `usize` is an overflow whatever its exact size.
        let p = |factors: &[u128]| factors.iter().fold(1u128, |acc, &f| acc.saturating_mul(f));
        let (n, h, i, k, b) = (w(s.tokens), w(s.hidden), w(s.intermediate), w(s.top_k), w(s.elem_bytes()));
        let meta = w(std::mem::size_of::<RouteMeta>());
        let group = w(std::mem::size_of::<GroupEntry>());
        let (send, recv, g, slots) =
            (w(self.send_rows), w(self.recv_rows), w(self.expert_rows), w(self.foreign_slots));
        let expert = p(&[3, h, i]);
        let bwd = self.pass == Pass::Backward;
        let (host, dev) = (|r| (r, true), |r| (r, false));
        let mut out = vec![
            host(p(&[4, n, k])),
            host(p(&[4, n, k])),
            host(p(&[4, w(s.ranks).saturating_add(1)])),
            dev(p(&[slots, expert, b])),
        ];
        if bwd {
            // The foreign gradients' return buffer (an owner receives them though it helps none):
            // none with one rank, whose experts are all its own.
            let returns = w(usize::from(s.ranks > 1));
            out.extend([dev(p(&[slots, expert, 4])), dev(p(&[returns, h, i, 4]))]);
        }
        for _ in 0..self.depth {
            out.extend(
                [
                    p(&[send, 4]),
                    p(&[send, h, b]),
                    p(&[recv, h, b]),
                    p(&[recv, h, b]),
                    p(&[send, k, meta]),
                    p(&[recv, k, meta]),
                ]
                .map(dev),
            );
            if bwd {
                out.extend([p(&[send, h, b]), p(&[recv, h, b]), p(&[recv, k, 4]), p(&[send, k, 4])].map(dev));
            }
        }
        let staging = p(&[w(staging_slots(self.depth)), recv, k, meta]);
        let grouping = p(&[4, w(s.local_experts()).saturating_add(slots).saturating_add(1)]);
        out.extend([staging, p(&[recv, k, group]), grouping].map(host));
        // The round's lists (every group a range): rows and weights; backward adds the metadata
        // entries and the identity index of G rows.
        out.extend([p(&[recv, k, 4]), p(&[recv, k, 4])].map(dev));
        if bwd {
            out.extend(
                [p(&[recv, k, 4]), p(&[g, 4]), p(&[send, k, 4]), p(&[send, k, 4]), p(&[send, k, 4]), 4]
                    .map(dev),
            );
        }
        out.extend([p(&[g, h, b]), p(&[g, h.max(i), b]), p(&[2, g, i, b])].map(dev));
        if bwd {
            out.extend([p(&[g, h, b]), p(&[g, i, b]), p(&[g, 4])].map(dev));
        }
        // An empty buffer takes no region (a baseline rank may receive nothing).
        out.retain(|&(bytes, _)| bytes > 0);
        out
    }

    /// Every non-empty region in reservation order, in bytes: what the round schedule reserves,
    /// and what the CPU executor carves from its workspace, exactly. A region past `usize` reads
    /// `usize::MAX`; a [`Plan`] never has one.
    pub fn regions(&self) -> Vec<usize> {
        self.regions_wide().into_iter().map(|(r, _)| usize::try_from(r).unwrap_or(usize::MAX)).collect()
    }

    /// Bytes of the regions that live on the host whatever the backend (route tables, received
    /// metadata's staging, grouping arrays), alignment included: a device executor's host
    /// workspace.
    pub fn host_workspace_bytes(&self) -> usize {
        let host: Vec<usize> = self
            .regions_wide()
            .into_iter()
            .filter(|&(_, on_host)| on_host)
            .map(|(r, _)| usize::try_from(r).unwrap_or(usize::MAX))
            .collect();
        Arena::bytes_for(&host).unwrap_or(usize::MAX)
    }

    /// Bytes of the regions that live on the device (every region but the route tables, the
    /// received metadata's staging and the grouping arrays), unaligned: what a device backend
    /// allocates for the pass, one buffer a region. Saturates at `usize::MAX`.
    pub fn device_region_bytes(&self) -> usize {
        let bytes = self
            .regions_wide()
            .into_iter()
            .filter(|&(_, on_host)| !on_host)
            .fold(0u128, |a, (r, _)| a.saturating_add(r));
        usize::try_from(bytes).unwrap_or(usize::MAX)
    }

    /// The alignment of each buffer a device executor carves from lent memory.
    pub const DEVICE_ALIGN: usize = 256;

    /// The most buffers one pass allocates on a device: its regions (17 + 10 per pipeline copy,
    /// empty ones included: a device buffer holds at least one element), its outputs (at most
    /// 5) and a few a binding adds (an empty weight slot), with room to spare.
    pub fn device_buffers_bound(&self) -> usize {
        self.depth.saturating_mul(10).saturating_add(32)
    }

    /// Bytes of lent device memory the pass carves every buffer from, each
    /// [`DEVICE_ALIGN`](Self::DEVICE_ALIGN)-aligned: [`device_bytes`](Self::device_bytes) and
    /// one alignment per buffer ([`device_buffers_bound`](Self::device_buffers_bound)).
    pub fn device_arena_bytes(&self) -> usize {
        self.device_bytes().saturating_add(Self::DEVICE_ALIGN.saturating_mul(self.device_buffers_bound()))
    }

    /// The device memory the pass holds besides its inputs on a GPU: its device regions
    /// ([`device_region_bytes`](Self::device_region_bytes)) and its outputs, all f32 (forward: y
    /// N×H; backward: dX N×H, d(weights) N×k and the native weight gradients, 3·M·H·I in
    /// either layout). Saturates at `usize::MAX`.
    pub fn device_bytes(&self) -> usize {
        let s = &self.shape;
        let rows = saturating_product(&[s.tokens, s.hidden]);
        let outputs = match self.pass {
            Pass::Forward => rows,
            Pass::Backward => saturating_sum(&[
                rows,
                saturating_product(&[s.tokens, s.top_k]),
                saturating_product(&[3, s.local_experts(), s.hidden, s.intermediate]),
            ]),
        };
        self.device_region_bytes().saturating_add(saturating_product(&[outputs, 4]))
    }

    /// Bytes of the whole reservation, alignment included, or [`SizeOverflow`] when they do
    /// not fit a `usize`.
    ///
    /// [`SizeOverflow`]: flatpeak_common::Error::SizeOverflow
    pub fn checked_workspace_bytes(&self) -> Result<usize> {
        let overflow =
            || Error::Common(flatpeak_common::Error::SizeOverflow { what: "llep workspace bytes" });
        let regions: Vec<usize> = self
            .regions_wide()
            .into_iter()
            .map(|(r, _)| usize::try_from(r))
            .collect::<Result<_, _>>()
            .map_err(|_| overflow())?;
        Ok(Arena::bytes_for(&regions)?)
    }

    /// Bytes of the whole reservation, alignment included (`usize::MAX` where
    /// [`checked_workspace_bytes`](Buffers::checked_workspace_bytes) overflows).
    pub fn workspace_bytes(&self) -> usize {
        self.checked_workspace_bytes().unwrap_or(usize::MAX)
    }
    // The byte accessors below saturate at `usize::MAX`: a PipelinedLLEP plan's buffers all fit
    // (its workspace was checked), a baseline's (sized per call) or a rounds count may not.

    /// Send-side dispatch bytes (all copies): x rows (and dY rows) with their metadata and
    /// token index.
    pub fn send_bytes(&self) -> usize {
        let (h, k, b) = (self.shape.hidden, self.shape.top_k, self.shape.elem_bytes());
        let per_row = match self.pass {
            Pass::Forward => saturating_sum(&[saturating_product(&[h, b]), saturating_product(&[8, k]), 4]),
            Pass::Backward => {
                saturating_sum(&[saturating_product(&[2, h, b]), saturating_product(&[12, k]), 4])
            }
        };
        saturating_product(&[self.depth, self.send_rows, per_row])
    }
    /// Receive-side dispatch bytes (all copies): received rows, output rows and metadata.
    pub fn recv_bytes(&self) -> usize {
        let (h, k, b) = (self.shape.hidden, self.shape.top_k, self.shape.elem_bytes());
        let per_row = match self.pass {
            Pass::Forward => saturating_sum(&[saturating_product(&[2, h, b]), saturating_product(&[8, k])]),
            Pass::Backward => saturating_sum(&[saturating_product(&[3, h, b]), saturating_product(&[12, k])]),
        };
        saturating_product(&[self.depth, self.recv_rows, per_row])
    }
    /// Expert GEMM inputs, outputs and SwiGLU intermediates (G rows): X, Y (H or I wide,
    /// whichever is wider: forward keeps h there), gate and up; backward adds dY and h.
    pub fn expert_intermediate_bytes(&self) -> usize {
        let (h, i, b) = (self.shape.hidden, self.shape.intermediate, self.shape.elem_bytes());
        let width = match self.pass {
            Pass::Forward => saturating_sum(&[h, h.max(i), saturating_product(&[2, i])]),
            Pass::Backward => {
                saturating_sum(&[saturating_product(&[2, h]), h.max(i), saturating_product(&[3, i])])
            }
        };
        saturating_product(&[self.expert_rows, width, b])
    }
    /// Foreign expert weights (and, in backward, their fp32 gradients and one return buffer;
    /// nothing with one rank).
    pub fn foreign_weight_bytes(&self) -> usize {
        let s = &self.shape;
        let w = saturating_product(&[self.foreign_slots, s.expert_elems(), s.elem_bytes()]);
        match self.pass {
            Pass::Forward => w,
            Pass::Backward => saturating_sum(&[
                w,
                saturating_product(&[self.foreign_slots, s.expert_elems(), 4]),
                saturating_product(&[usize::from(s.ranks > 1), s.hidden, s.intermediate, 4]),
            ]),
        }
    }
    /// The fp32 N×H accumulator the combine scatter-adds into (forward: y; backward: dX). Every
    /// executor accumulates straight into the returned output, so it is not in the workspace.
    pub fn accumulator_bytes(&self) -> usize {
        saturating_product(&[self.shape.tokens, self.shape.hidden, 4])
    }
    /// The route tables, `8·N·k` bytes: the documented O(N) per-token state.
    pub fn route_table_bytes(&self) -> usize {
        saturating_product(&[8, self.shape.tokens, self.shape.top_k])
    }
    /// The bound of what [`Mode::SaveActivations`] keeps from forward to backward for K
    /// rounds: every round's receive buffer of rows with their metadata and per-route SwiGLU
    /// pre-activations, `K·recv_rows·(H·b + 8·k + 2·k·I·b)` plus K + 1 route offsets and
    /// alignment; [`Schedule::saved_bytes`](crate::Schedule::saved_bytes) is the exact figure of one routing. 0 when checkpointed.
    pub fn saved_activation_bytes(&self, mode: Mode, rounds: usize) -> usize {
        match mode {
            Mode::Checkpointed => 0,
            Mode::SaveActivations => {
                let s = &self.shape;
                let (h, i, k, b) = (s.hidden, s.intermediate, s.top_k, s.elem_bytes());
                let rows = saturating_product(&[rounds, self.recv_rows]);
                let meta = std::mem::size_of::<RouteMeta>();
                let pre_activations = saturating_product(&[rows, k, i, b]);
                let regions = [
                    saturating_product(&[rows, h, b]),
                    saturating_product(&[rows, k, meta]),
                    pre_activations,
                    pre_activations,
                    saturating_product(&[4, rounds.saturating_add(1)]),
                ];
                Arena::bytes_for(&regions).unwrap_or(usize::MAX)
            }
        }
    }
}

/// `Σ terms`, saturating at `usize::MAX`.
fn saturating_sum(terms: &[usize]) -> usize {
    terms.iter().fold(0usize, |s, &t| s.saturating_add(t))
}

/// Staging slots of received metadata: two when the next round is fetched ahead.
pub(crate) fn staging_slots(depth: usize) -> usize {
    depth.clamp(1, 2)
}
