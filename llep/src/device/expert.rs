//! One expert over one group of n ≤ G received routes, as [`DeviceOps`]: its SwiGLU forward,
//! its backward with the forward recomputed, and its backward from saved pre-activations. The
//! group's X rows are in the scratch and its lists (rows, weights, metadata entries) in the
//! group buffers when these run.
//!
//! Forward: `g = X·W_gate`, `u = X·W_up`, `h = silu(g) ⊙ u`, `y = h·W_down`. Backward, with
//! `δ_t = w_t·dY_t`: `dw_t = ⟨dY_t, y_t⟩`, `dW_down += hᵀ·δ`, `dh = δ·W_downᵀ`,
//! `dg = dh ⊙ u ⊙ silu'(g)`, `du = dh ⊙ silu(g)`, `dW_gate += Xᵀ·dg`, `dW_up += Xᵀ·du`,
//! `dX_t = dg·W_gateᵀ + du·W_upᵀ`. Both backwards take y's role from `r = dY·W_downᵀ`:
//! `dw_t = ⟨r_t, h_t⟩` (= ⟨dY_t, y_t⟩ since `y = h·W_down`) and `dh_t = w_t·r_t`, so neither
//! recomputes y: from saved g and u six GEMMs, recomputing them eight (instead of nine).
//!
//! Under [`WeightLayout::Linear`] each weight is stored transposed (torch's `x·Wᵀ`): the same
//! GEMMs read it with the other orientation, and each weight gradient is formed transposed
//! (`dW_gateᵀ += dgᵀ·X`, `dW_downᵀ += δᵀ·h`), so nothing is copied either way. There each
//! expert's gate and up rows are one stored 2I×H matrix (`gate_up_proj`), so gate and up are one
//! GEMM into rows of `[g | u]` ([`PreAt::Fused`]), and so are their weight gradient
//! (`d gate_up_proj += [dg | du]ᵀ·X`) and their share of dX (`[dg | du]·W_gate_up`): two GEMMs a
//! group forward, five backward recomputing, four from saved pre-activations.

use flatpeak_common::gemm::Accumulate;

use super::reserve::{GroupBufs, Scratch};
use super::{DeviceGradients, DeviceInputs, DeviceOps, GemmDims, IndexedRows, Operand, PreAt};
use crate::config::{Shape, WeightLayout};
use crate::error::Result;

/// Local expert `slot`'s weights: (buffer, offset) of W_gate, W_up (H×I) and W_down (I×H), or
/// of their transposes under [`WeightLayout::Linear`].
#[derive(Debug)]
pub(super) struct ExpertAt<'a, B> {
    gate: (&'a B, usize),
    up: (&'a B, usize),
    down: (&'a B, usize),
    layout: WeightLayout,
    hi: usize,
}

impl<'a, B> ExpertAt<'a, B> {
    /// W_gate and W_up as one stored `2I×H` matrix (`gate_up_proj`'s rows of this expert:
    /// torch's layout, gate rows then up rows in one buffer), read as stored; `None` in llep's
    /// split layout, whose gate and up cannot be read as one operand.
    fn gate_up(&self) -> Option<Operand<'a, B>> {
        let contiguous = std::ptr::eq(self.gate.0, self.up.0) && self.up.1 == self.gate.1 + self.hi;
        (self.layout.transposed() && contiguous).then(|| Operand::plain(self.gate.0, self.gate.1))
    }

    /// A stored weight as the right operand of llep's `x·W`: as stored ([`WeightLayout::Split`])
    /// or its transpose (`x·Wᵀ` of torch's layout).
    fn times(&self, (buf, at): (&'a B, usize)) -> Operand<'a, B> {
        if self.layout.transposed() { Operand::t(buf, at) } else { Operand::plain(buf, at) }
    }

    /// A stored weight as the right operand of `d·Wᵀ` (the backward's products).
    fn times_t(&self, (buf, at): (&'a B, usize)) -> Operand<'a, B> {
        if self.layout.transposed() { Operand::plain(buf, at) } else { Operand::t(buf, at) }
    }
}

impl<B> Clone for ExpertAt<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for ExpertAt<'_, B> {}

/// Native slots from the inputs, foreign ones from the fetched slots (each part H·I elements in
/// the layout's orientation, as fetched).
pub(super) fn expert_at<'a, B>(
    (s, layout): (&Shape, WeightLayout),
    inputs: &DeviceInputs<'a, B>,
    foreign: &'a B,
    slot: usize,
) -> ExpertAt<'a, B> {
    let hi = s.hidden * s.intermediate;
    let m = s.local_experts();
    if slot < m {
        let tensors = [inputs.gate, inputs.up, inputs.down];
        let part = |p| {
            let (tensor, at) = layout.part_at(s, slot, p);
            (tensors[tensor], at)
        };
        ExpertAt { gate: part(0), up: part(1), down: part(2), layout, hi }
    } else {
        let o = (slot - m) * 3 * hi;
        ExpertAt { gate: (foreign, o), up: (foreign, o + hi), down: (foreign, o + 2 * hi), layout, hi }
    }
}

/// Where local expert `slot`'s weight gradients accumulate, in the layout's orientation: the
/// native gradients or the foreign slot's gradient buffer (returned home at the end).
pub(super) struct GradAt<'a, B> {
    place: GradPlace<'a, B>,
    layout: WeightLayout,
}

enum GradPlace<'a, B> {
    Native { tensors: [&'a mut B; 3], shape: Shape, slot: usize },
    Foreign { buf: &'a mut B, offset: usize, hi: usize },
}

impl<B> GradAt<'_, B> {
    /// Part 0 (W_gate), 1 (W_up) or 2 (W_down): buffer and offset.
    fn part(&mut self, part: usize) -> (&mut B, usize) {
        match &mut self.place {
            GradPlace::Native { tensors, shape, slot } => {
                let (tensor, at) = self.layout.part_at(shape, *slot, part);
                (&mut *tensors[tensor], at)
            }
            GradPlace::Foreign { buf, offset, hi } => (&mut **buf, *offset + part * *hi),
        }
    }
}

pub(super) fn grad_at<'a, B>(
    (s, layout): (&Shape, WeightLayout),
    g: &'a mut DeviceGradients<B>,
    foreign_grad: &'a mut B,
    slot: usize,
) -> GradAt<'a, B> {
    let hi = s.hidden * s.intermediate;
    let m = s.local_experts();
    let place = if slot < m {
        GradPlace::Native { tensors: [&mut g.d_gate, &mut g.d_up, &mut g.d_down], shape: *s, slot }
    } else {
        GradPlace::Foreign { buf: foreign_grad, offset: (slot - m) * 3 * hi, hi }
    };
    GradAt { place, layout }
}

/// `C (m×n) ← A·B` or `+=`, C from (buffer, offset).
fn mm<O: DeviceOps>(
    ops: &O,
    (m, n, k): (usize, usize, usize),
    a: Operand<'_, O::Buf>,
    b: Operand<'_, O::Buf>,
    (c, at): (&mut O::Buf, usize),
    acc: Accumulate,
) -> Result<()> {
    ops.gemm(GemmDims { m, n, k }, a, b, c, at, acc)
}

/// The split pre-activations of the scratch: gate n×I from 0, up n×I from G·I.
fn split(sc: &Scratch<impl Sized>) -> PreAt {
    PreAt::Split { gate: 0, up: sc.up_at }
}

/// The layout a group's pre-activations take: fused rows where the weights are torch's
/// `gate_up_proj` (one GEMM), else split.
fn pre_at<B>(w: &ExpertAt<'_, B>, i: usize, sc: &Scratch<B>) -> PreAt {
    if w.gate_up().is_some() { PreAt::Fused { width: i } } else { split(sc) }
}

/// `gate ← X·W_gate`, `up ← X·W_up` for `n` rows of the scratch: under torch's layout one GEMM
/// over the stored `gate_up_proj` rows into rows of `[gate | up]` (each element the same dot
/// product as a split projection's), else two. Returns where they landed.
fn project<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    (h, i): (usize, usize),
    n: usize,
    sc: &mut Scratch<O::Buf>,
) -> Result<PreAt> {
    let x = || Operand::plain(&sc.x, 0);
    if let Some(gate_up) = w.gate_up() {
        let wt = Operand::t(gate_up.buf, gate_up.offset);
        mm(ops, (n, 2 * i, h), x(), wt, (&mut sc.pre, 0), Accumulate::Replace)?;
        return Ok(PreAt::Fused { width: i });
    }
    let (g, u) = (w.times(w.gate), w.times(w.up));
    mm(ops, (n, i, h), x(), g, (&mut sc.pre, 0), Accumulate::Replace)?;
    mm(ops, (n, i, h), x(), u, (&mut sc.pre, sc.up_at), Accumulate::Replace)?;
    Ok(split(sc))
}

/// Where the saving forward keeps a group's pre-activations: the store's, from route `cursor`
/// (2·I elements a route).
pub(super) struct KeepPre<'a, B> {
    pub(super) pre: &'a mut B,
    pub(super) cursor: usize,
}

/// The contiguous pieces of n routes' pre-activations (layout `at`) between the scratch and the
/// store (from element 2·I·cursor, the same layout packed): (scratch element, store element,
/// length).
fn pre_pieces((at, i, n): (PreAt, usize, usize), cursor: usize) -> Vec<(usize, usize, usize)> {
    let base = 2 * i * cursor;
    match at {
        PreAt::Fused { .. } => vec![(0, base, 2 * n * i)],
        PreAt::Split { gate, up } => vec![(gate, base, n * i), (up, base + n * i, n * i)],
    }
}

/// The saving forward's copy of a group's pre-activations into the store.
fn keep_pre<O: DeviceOps>(
    ops: &O,
    group: (PreAt, usize, usize),
    k: KeepPre<'_, O::Buf>,
    sc: &Scratch<O::Buf>,
) -> Result<()> {
    for (scratch_at, store_at, len) in pre_pieces(group, k.cursor) {
        ops.copy((&sc.pre, scratch_at), (&mut *k.pre, store_at), len)?;
    }
    Ok(())
}

/// The backward's copy of a group's kept pre-activations back into the scratch.
fn restore_pre<O: DeviceOps>(
    ops: &O,
    group: (PreAt, usize, usize),
    (store, cursor): (&O::Buf, usize),
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    for (scratch_at, store_at, len) in pre_pieces(group, cursor) {
        ops.copy((store, store_at), (&mut sc.pre, scratch_at), len)?;
    }
    Ok(())
}

/// Forward of one group: the expert's output rows land in the scratch's X (h in its Y, so no
/// G×I buffer beyond the pre-activations); with `keep`, `x·W_gate` and `x·W_up` are copied out
/// first. Under torch's layout gate and up are one GEMM over `gate_up_proj` (two GEMMs a
/// group instead of three), whether or not it keeps them: y is the same either way.
pub(super) fn forward<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    (h, i): (usize, usize),
    n: usize,
    sc: &mut Scratch<O::Buf>,
    keep: Option<KeepPre<'_, O::Buf>>,
) -> Result<()> {
    let at = project(ops, w, (h, i), n, sc)?;
    if let Some(k) = keep {
        keep_pre(ops, (at, i, n), k, sc)?;
    }
    ops.swiglu(&sc.pre, at, n * i, &mut sc.y)?;
    mm(ops, (n, h, i), Operand::plain(&sc.y, 0), w.times(w.down), (&mut sc.x, 0), Accumulate::Replace)
}

/// The round buffers and lists one expert group's backward reads and fills: the group is routes
/// `start..start + n` of the round's lists.
pub(super) struct GroupIo<'a, O: DeviceOps> {
    pub(super) recv_dy: &'a O::Buf,
    pub(super) dx_rows: &'a mut O::Buf,
    pub(super) dw: &'a mut O::Buf,
    pub(super) lists: &'a GroupBufs<O::Buf, O::Index>,
    pub(super) start: usize,
}

/// The shared end of both backwards, with dg and du in the scratch's pre-activations (layout
/// `at`) and X in its x: `dW_gate += Xᵀ·dg`, `dW_up += Xᵀ·du`, `dX_t = dg·W_gateᵀ + du·W_upᵀ`
/// added to row t. Under torch's layout (fused rows) `d gate_up_proj += [dg | du]ᵀ·X` and
/// `dX = [dg | du]·W_gate_up`: two GEMMs instead of four.
fn input_grads<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    mut grad: GradAt<'_, O::Buf>,
    (h, i, n, at): (usize, usize, usize, PreAt),
    io: GroupIo<'_, O>,
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    match (at, w.gate_up()) {
        (PreAt::Fused { .. }, Some(gate_up)) => {
            // Torch's layout stores gate_up_proj (and its gradient) as 2I×H: gate rows, then up.
            let dgu = Operand::t(&sc.pre, 0);
            mm(ops, (2 * i, h, n), dgu, Operand::plain(&sc.x, 0), grad.part(0), Accumulate::Add)?;
            mm(ops, (n, h, 2 * i), Operand::plain(&sc.pre, 0), gate_up, (&mut sc.y, 0), Accumulate::Replace)?;
        }
        (PreAt::Split { gate, up }, _) => {
            // dW_gate += Xᵀ·dg (H×I), or dgᵀ·X (I×H) in torch's layout; likewise dW_up.
            weight_grad(ops, grad.layout, (&sc.x, h), (&sc.pre, gate, i), n, grad.part(0))?;
            weight_grad(ops, grad.layout, (&sc.x, h), (&sc.pre, up, i), n, grad.part(1))?;
            let dg = Operand::plain(&sc.pre, gate);
            mm(ops, (n, h, i), dg, w.times_t(w.gate), (&mut sc.y, 0), Accumulate::Replace)?;
            let du = Operand::plain(&sc.pre, up);
            mm(ops, (n, h, i), du, w.times_t(w.up), (&mut sc.y, 0), Accumulate::Add)?;
        }
        (PreAt::Fused { .. }, None) => {
            return Err(crate::error::Error::internal("fused pre-activations come from gate_up_proj"));
        }
    }
    ops.scatter_add_rows(IndexedRows::new(&sc.y, &io.lists.rows, n, h).from(io.start), io.dx_rows)
}

/// The middle of both backwards, with `dw_t` in the scratch's dots and h in its h: the dots
/// added to the routes' d(weights) entries, dY gathered again scaled by the routing weights
/// (`δ_t = w_t·dY_t`), and `dW_down += hᵀ·δ`.
fn weights_and_down_grads<O: DeviceOps>(
    ops: &O,
    grad: &mut GradAt<'_, O::Buf>,
    (h, i, n): (usize, usize, usize),
    io: &mut GroupIo<'_, O>,
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    ops.scatter_add_rows(IndexedRows::new(&sc.dots, &io.lists.meta, n, 1).from(io.start), io.dw)?;
    let dy = IndexedRows::new(io.recv_dy, &io.lists.rows, n, h).scaled(&io.lists.weights).from(io.start);
    ops.gather_rows(dy, &mut sc.dy)?;
    // dW_down += hᵀ·(w⊙dY) (I×H), or (w⊙dY)ᵀ·h (H×I) in torch's layout.
    weight_grad(ops, grad.layout, (&sc.h, i), (&sc.dy, 0, h), n, grad.part(2))
}

/// `dW += aᵀ·b` for the n rows of `a` (width `wa`) and `b` (width `wb`, from element `b_at`):
/// `wa × wb` as llep stores a weight, or its transpose `bᵀ·a` (`wb × wa`) under
/// [`WeightLayout::Linear`].
fn weight_grad<O: DeviceOps>(
    ops: &O,
    layout: WeightLayout,
    (a, wa): (&O::Buf, usize),
    (b, b_at, wb): (&O::Buf, usize, usize),
    n: usize,
    dw: (&mut O::Buf, usize),
) -> Result<()> {
    if layout.transposed() {
        mm(ops, (wb, wa, n), Operand::t(b, b_at), Operand::plain(a, 0), dw, Accumulate::Add)
    } else {
        mm(ops, (wa, wb, n), Operand::t(a, 0), Operand::plain(b, b_at), dw, Accumulate::Add)
    }
}

/// Backward of one group, recomputing its pre-activations (not y): then as
/// [`backward_saved`]. Eight GEMMs a group, five under torch's layout.
pub(super) fn backward<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    grad: GradAt<'_, O::Buf>,
    (h, i): (usize, usize),
    n: usize,
    io: GroupIo<'_, O>,
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    ops.gather_rows(IndexedRows::new(io.recv_dy, &io.lists.rows, n, h).from(io.start), &mut sc.dy)?;
    let at = project(ops, w, (h, i), n, sc)?;
    from_pre_activations(ops, w, grad, (h, i, n, at), io, sc)
}

/// Backward of one group from the pre-activations the saving forward kept (`pre`: the store's,
/// this group from route `cursor`), without recompute: six GEMMs a group, four under torch's
/// layout.
#[allow(clippy::too_many_arguments)] // the operands of one group, as in `backward`
pub(super) fn backward_saved<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    grad: GradAt<'_, O::Buf>,
    (h, i): (usize, usize),
    (n, cursor): (usize, usize),
    pre: &O::Buf,
    io: GroupIo<'_, O>,
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    ops.gather_rows(IndexedRows::new(io.recv_dy, &io.lists.rows, n, h).from(io.start), &mut sc.dy)?;
    let at = pre_at(&w, i, sc);
    restore_pre(ops, (at, i, n), (pre, cursor), sc)?;
    from_pre_activations(ops, w, grad, (h, i, n, at), io, sc)
}

/// Both backwards from dY (in the scratch's dY) and the pre-activations (layout `at`), without y:
/// `h = silu(g) ⊙ u`, `r = dY·W_downᵀ`, `dw_t = ⟨r_t, h_t⟩` (= ⟨dY_t, y_t⟩ since
/// `y = h·W_down`), the routes' d(weights) and `dW_down += hᵀ·δ`, `dh_t = w_t·r_t`, then the
/// SwiGLU backward and the input gradients.
fn from_pre_activations<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    mut grad: GradAt<'_, O::Buf>,
    (h, i, n, at): (usize, usize, usize, PreAt),
    mut io: GroupIo<'_, O>,
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    ops.swiglu(&sc.pre, at, n * i, &mut sc.h)?;
    let down_t = w.times_t(w.down);
    mm(ops, (n, i, h), Operand::plain(&sc.dy, 0), down_t, (&mut sc.y, 0), Accumulate::Replace)?;
    ops.row_dot(&sc.y, &sc.h, n, i, &mut sc.dots)?;
    weights_and_down_grads(ops, &mut grad, (h, i, n), &mut io, sc)?;
    // dh = w ⊙ r row by row: the identity index, the group's weights.
    let scaled = IndexedRows::new(&sc.y, &io.lists.seq, n, i).scaled(&io.lists.weights).scale_from(io.start);
    ops.gather_rows(scaled, &mut sc.h)?;
    ops.swiglu_backward(&mut sc.pre, at, &sc.h, n * i)?;
    input_grads(ops, w, grad, (h, i, n, at), io, sc)
}
