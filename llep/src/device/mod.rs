//! The round schedule, written once over [`DeviceOps`] — buffers, the five kernels of
//! `kernels/llep.cu` (f32 and bf16 instantiations), a strided GEMM (f32, or bf16 with f32
//! accumulation), copies and all-to-all — and run by every backend: the CPU
//! ([`crate::cpu::HostOps`]: host memory carved from the executor's [`Workspace`](crate::Workspace)), a CUDA device
//! (`crate::cuda::CudaOps`, feature `cuda`) and the SIMT emulator (`crate::emu_ops::EmuOps`, feature
//! `cuda-emu`). [`crate::Executor`] picks the backend from a [`Device`](crate::Device).
//!
//! The host plans ([`crate::cpu::schedule`] or [`crate::Schedule::from_top_k`]) and keeps the
//! routing (N×k ids and weights) and the route tables (8·N·k bytes). Per round it writes the
//! round's index lists (tokens in send order, each sent row's routes, and, grouped by expert,
//! the received rows, their routing weights and metadata entries: one upload per list, each
//! group a range of it) into index buffers fixed at launch. Per round the send rows are gathered straight from the un-expanded N×H input
//! (`llep_gather_rows`), all-to-all'd into the fixed receive buffer, grouped by local expert, and
//! each group of ≤ G routes runs `gate = X·W_gate`, `up = X·W_up`, `h = silu(gate) ⊙ up`
//! (`llep_swiglu`), `y = h·W_down`; `out[row_t] += w_t·y_t` (`llep_scatter_add_rows`, direct where
//! the rows are distinct, as a group's are: [`ScatterLayout`]); the rows go
//! back and are scatter-added into the fp32 N×H output in send order. Backward runs the rounds
//! in reverse, recomputing each group's pre-activations (not y) and running its backward at once
//! (`r = dY·W_downᵀ`, `dw_t = ⟨r_t, h_t⟩` by `llep_row_dot`, `llep_swiglu_backward`, five more
//! GEMMs; in torch's layout gate and up are one GEMM); foreign experts' gradients return to
//! their owners once at the end. In [`Mode::SaveActivations`](crate::Mode::SaveActivations),
//! [`forward`] given a [`Store`] also keeps every round's received rows, routes and
//! pre-activations there, and [`backward`] given it dispatches dY only and runs six GEMMs per
//! group from it (four in torch's layout). The
//! received route metadata (8 bytes per route) is read back to the host each round to form the
//! groups: the one host round trip per round.
//!
//! Memory per rank, fixed at launch whatever the routing: exactly the regions of
//! [`Buffers::regions`](crate::Buffers::regions) for the pass, in that order — on the host the
//! route tables, the received metadata's staging and the grouping arrays
//! ([`Buffers::host_workspace_bytes`](crate::Buffers::host_workspace_bytes)); on the device the D
//! copies of the send, receive and output rows with their index and metadata buffers (backward
//! adds dY rows and d(weights)), the group lists, the expert scratch of G rows and the F_max
//! foreign slots (backward adds their gradients). Inputs, the N×H output and the returned
//! gradients are the caller's. Every backend runs the same operations in the same order; the
//! GEMM and the reduction order of `row_dot` are the only differences between them.

mod count;
mod expert;
mod host;
mod pipeline;
mod reserve;
mod scatter_groups;
mod schedule;

use flatpeak_common::DType;
use flatpeak_common::gemm::Accumulate;

use crate::error::{Error, Result};
use crate::layer::{Gradients, Routing};
use crate::plan::RouteMeta;

pub use count::{CountBuf, CountOps, StepCounts, count_step};
pub use scatter_groups::{ScatterGroups, ScatterLayout};
pub use schedule::{backward, forward};

/// How a GEMM operand is read from its storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Orientation {
    /// The operand is the stored matrix: an `r×c` operand is stored `r×c`.
    #[default]
    AsStored,
    /// The operand is the transpose of the stored matrix: an `r×c` operand is stored `c×r`.
    Transposed,
}

/// One GEMM operand: a row-major matrix stored in `buf` from element `offset`, read in the
/// given [`Orientation`].
#[derive(Debug)]
pub struct Operand<'a, B> {
    /// The buffer holding the matrix.
    pub buf: &'a B,
    /// First element of the matrix in `buf`.
    pub offset: usize,
    /// As stored or transposed.
    pub orientation: Orientation,
}

impl<B> Clone for Operand<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Operand<'_, B> {}

impl<'a, B> Operand<'a, B> {
    /// The stored matrix as is, from `offset`.
    pub fn plain(buf: &'a B, offset: usize) -> Self {
        Self { buf, offset, orientation: Orientation::AsStored }
    }
    /// The transpose of the stored matrix, from `offset`.
    pub fn t(buf: &'a B, offset: usize) -> Self {
        Self { buf, offset, orientation: Orientation::Transposed }
    }
}

/// The rows a [`gather_rows`](DeviceOps::gather_rows) or
/// [`scatter_add_rows`](DeviceOps::scatter_add_rows) moves: `rows` rows of `width` elements, row
/// `r` with entry `index[index_at + r]` and, when given, the f32 factor `scale[scale_at + r]`
/// (none: 1). The offsets let one round-wide list serve every expert group of the round (each
/// group a range of it), so a round uploads its lists once instead of once per group.
#[derive(Debug)]
pub struct IndexedRows<'a, B, I> {
    /// The rows' source: read at row `index[index_at + r]` (gather) or row `r` (scatter).
    pub src: &'a B,
    /// The entries, from `index_at`: the source row (gather) or the accumulator row (scatter).
    pub index: &'a I,
    /// The first entry of `index` these rows use.
    pub index_at: usize,
    /// How many rows.
    pub rows: usize,
    /// Elements per row.
    pub width: usize,
    /// Per-row factors (f32) from `scale_at`, or `None` for 1.
    pub scale: Option<&'a B>,
    /// The first factor of `scale` these rows use.
    pub scale_at: usize,
}

impl<'a, B, I> IndexedRows<'a, B, I> {
    /// `rows` rows of `width` from `src` by `index` (from its first entry), unscaled.
    pub fn new(src: &'a B, index: &'a I, rows: usize, width: usize) -> Self {
        Self { src, index, index_at: 0, rows, width, scale: None, scale_at: 0 }
    }
    /// These rows, row `r` multiplied by `scale[r]` (f32), or by `scale[scale_at + r]` after
    /// [`from`](Self::from) or [`scale_from`](Self::scale_from).
    pub fn scaled(self, scale: &'a B) -> Self {
        Self { scale: Some(scale), ..self }
    }
    /// These rows read from entry `at` of both the index and the scale (one group's range of a
    /// round-wide list).
    pub fn from(self, at: usize) -> Self {
        Self { index_at: at, scale_at: at, ..self }
    }
    /// These rows' scale read from factor `at` (the index unchanged).
    pub fn scale_from(self, at: usize) -> Self {
        Self { scale_at: at, ..self }
    }
    /// The index range these rows use, `index_at..index_at + rows`, or
    /// [`Error::ShapeMismatch`] when a list of `len` entries does not hold it.
    pub fn index_range(&self, len: usize) -> Result<std::ops::Range<usize>> {
        let end = self.index_at.saturating_add(self.rows);
        need("gather/scatter index (entries from its offset)", end, len)?;
        Ok(self.index_at..end)
    }
    /// The scale range these rows use, `scale_at..scale_at + rows`, or
    /// [`Error::ShapeMismatch`] when a scale of `len` factors does not hold it.
    pub fn scale_range(&self, len: usize) -> Result<std::ops::Range<usize>> {
        let end = self.scale_at.saturating_add(self.rows);
        need("gather/scatter scale (factors from its offset)", end, len)?;
        Ok(self.scale_at..end)
    }
    /// No row or no element: the operation does nothing.
    pub fn is_empty(&self) -> bool {
        self.rows == 0 || self.width == 0
    }
}

/// Where one expert group's gate and up pre-activations lie in the scratch's pre-activation
/// buffer (n elements each, disjoint): split (llep's two projections, each a contiguous n×I
/// block) or fused (torch's `gate_up_proj` in one GEMM: n/I rows of `[gate | up]`, 2·I wide).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreAt {
    /// Gate from element `gate`, up from element `up`, each contiguous.
    Split {
        /// First element of the gate block.
        gate: usize,
        /// First element of the up block.
        up: usize,
    },
    /// Rows of `[gate | up]` from element 0, `width` of each a row.
    Fused {
        /// Elements of gate (and of up) per row: I.
        width: usize,
    },
}

impl PreAt {
    /// The kernels' layout of n elements, `(gate_at, up_at, width, pitch)`: element
    /// e = (e / width, e % width) reads gate at `gate_at + (e / width)·pitch + e % width` and up
    /// likewise from `up_at`.
    pub fn layout(self, n: usize) -> (usize, usize, usize, usize) {
        match self {
            Self::Split { gate, up } => (gate, up, n.max(1), n.max(1)),
            Self::Fused { width } => (0, width, width, 2 * width),
        }
    }

    /// Checks that the gate and up elements of n lie in a buffer of `len` and do not overlap (a
    /// layout that cannot hold them is the schedule's bug, never the caller's).
    pub fn check(self, n: usize, len: usize) -> Result<()> {
        match self {
            Self::Split { gate, up } => {
                need("swiglu pre-activations (gate)", gate.saturating_add(n), len)?;
                need("swiglu pre-activations (up)", up.saturating_add(n), len)?;
                let (lo, hi) = if gate <= up { (gate, up) } else { (up, gate) };
                if n > 0 && lo + n > hi {
                    return Err(Error::internal("the gate and up pre-activations overlap"));
                }
            }
            Self::Fused { width } => {
                if width == 0 || !n.is_multiple_of(width) {
                    return Err(Error::internal("fused pre-activations are whole rows"));
                }
                need("swiglu pre-activations (rows of gate and up)", n.saturating_mul(2), len)?;
            }
        }
        Ok(())
    }

    /// Elements of the buffer n elements span: one past the last gate or up element.
    pub fn extent(self, n: usize) -> usize {
        match self {
            Self::Split { gate, up } => gate.max(up).saturating_add(n),
            Self::Fused { .. } => n.saturating_mul(2),
        }
    }
}

/// Sizes of `C (m×n) = op(A) (m×k) · op(B) (k×n)`, all row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmDims {
    /// Rows of C and op(A).
    pub m: usize,
    /// Columns of C and op(B).
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
}

/// The primitive operations of the round schedule. `Buf` holds f32 or the layer's storage type
/// (bf16: tokens, weights, dispatch rows, the expert scratch), `Index` u32; every length
/// argument is in elements and every implementation checks that the buffers hold what an
/// operation touches before running it (a short buffer is [`Error::ShapeMismatch`]). Operations
/// on zero rows or elements do nothing. Every operation sees the effects of the operations
/// issued before it on the buffers it touches, and its own effects are complete before a later
/// one touches them; operations on disjoint buffers may run concurrently (CUDA: the all-to-alls
/// on the communicator's stream, the rest on a compute stream).
///
/// The schedule reserves every buffer of a call up front, in the order of
/// [`Buffers::regions`](crate::Buffers::regions), with [`alloc`](DeviceOps::alloc) and
/// [`alloc_index`](DeviceOps::alloc_index) (a host backend carves them from its workspace), and
/// its outputs with [`alloc_output`](DeviceOps::alloc_output).
pub trait DeviceOps {
    /// A device buffer of f32 or of the storage type.
    type Buf: std::fmt::Debug;
    /// A device buffer of u32 (row indices, route metadata).
    type Index: std::fmt::Debug;

    /// This rank in the device group.
    fn rank(&self) -> usize;
    /// Ranks in the device group.
    fn world_size(&self) -> usize;

    /// A scratch buffer of `len` elements of `dtype` for this call; its contents are
    /// unspecified (the schedule writes every element before reading it). A device may reserve
    /// one element for `len = 0`. A dtype the backend does not run is
    /// [`Error::UnsupportedDtype`].
    fn alloc(&self, len: usize, dtype: DType) -> Result<Self::Buf>;
    /// A scratch buffer of `len` u32 for this call, as [`alloc`](DeviceOps::alloc).
    fn alloc_index(&self, len: usize) -> Result<Self::Index>;
    /// A zeroed buffer of `len` f32 that outlives the call (the output, the gradients). The
    /// default is [`alloc`](DeviceOps::alloc), for implementations whose `alloc` zeroes.
    fn alloc_output(&self, len: usize) -> Result<Self::Buf> {
        self.alloc(len, DType::F32)
    }
    /// Elements `buf` holds.
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    /// The element type of `buf`.
    fn buf_dtype(&self, buf: &Self::Buf) -> DType;
    /// A new f32 buffer holding `host`.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// `dst[..host.len()] = host`.
    fn write_index(&self, host: &[u32], dst: &mut Self::Index) -> Result<()>;
    /// `dst[..host.len()] = host` (an f32 buffer).
    fn write(&self, host: &[f32], dst: &mut Self::Buf) -> Result<()>;
    /// `src[..len]` of an f32 buffer on the host.
    fn download(&self, src: &Self::Buf, len: usize) -> Result<Vec<f32>>;
    /// `src[..len]` on the host.
    fn download_index(&self, src: &Self::Index, len: usize) -> Result<Vec<u32>>;
    /// `dst = src[..dst.len()]` on the host, into memory the caller reserved. The default goes
    /// through [`download_index`](DeviceOps::download_index).
    fn download_index_into(&self, src: &Self::Index, dst: &mut [u32]) -> Result<()> {
        let v = self.download_index(src, dst.len())?;
        need("index download", dst.len(), v.len())?;
        dst.copy_from_slice(&v[..dst.len()]);
        Ok(())
    }
    /// Fills `dst[..written]` from the host: `fill` gets `len` host elements to write and
    /// returns how many it wrote (at most `len`). A host backend hands it the buffer itself; the
    /// default stages it and [`write_index`](DeviceOps::write_index)s what was written.
    fn fill_index<F>(&self, dst: &mut Self::Index, len: usize, fill: F) -> Result<usize>
    where
        F: FnOnce(&mut [u32]) -> Result<usize>,
    {
        let what = "index entries written (at most the length filled)";
        write_staged(what, len, fill, |staged| self.write_index(staged, dst))
    }
    /// [`fill_index`](DeviceOps::fill_index) of f32.
    fn fill<F>(&self, dst: &mut Self::Buf, len: usize, fill: F) -> Result<usize>
    where
        F: FnOnce(&mut [f32]) -> Result<usize>,
    {
        let what = "elements written (at most the length filled)";
        write_staged(what, len, fill, |staged| self.write(staged, dst))
    }
    /// `dst[..len] = 0`.
    fn zero(&self, dst: &mut Self::Buf, len: usize) -> Result<()>;
    /// `dst[dst_at..dst_at + len] = src[src_at..src_at + len]` (device to device).
    fn copy(&self, src: (&Self::Buf, usize), dst: (&mut Self::Buf, usize), len: usize) -> Result<()>;

    /// `dst[r] = scale_r·src[index[r]]` for `r < rows`, rows of `width` (`llep_gather_rows`;
    /// `src` and `dst` of one type). Every index must be a row of `src`.
    fn gather_rows(&self, sel: IndexedRows<'_, Self::Buf, Self::Index>, dst: &mut Self::Buf) -> Result<()>;
    /// `acc[index[r]] += scale_r·src[r]` for r = 0, 1, …, rows − 1 in order, rows of `width`
    /// (`llep_scatter_add_rows`: duplicates accumulate in input order, reproducibly; `acc` f32
    /// or of `src`'s type, `scale` f32).
    fn scatter_add_rows(
        &self,
        sel: IndexedRows<'_, Self::Buf, Self::Index>,
        acc: &mut Self::Buf,
    ) -> Result<()>;
    /// `h[..n] = silu(gate) ⊙ up`, gate and up the `n` elements of `gu` from `at.gate` and
    /// `at.up` (`llep_swiglu`; one type).
    fn swiglu(&self, gu: &Self::Buf, at: PreAt, n: usize, h: &mut Self::Buf) -> Result<()>;
    /// In place over `n` elements of `gu` at `at`, from `dh`: `gate ← dh ⊙ up ⊙ silu'(gate)`,
    /// `up ← dh ⊙ silu(gate)` (`llep_swiglu_backward`).
    fn swiglu_backward(&self, gu: &mut Self::Buf, at: PreAt, dh: &Self::Buf, n: usize) -> Result<()>;
    /// `out[r] = ⟨a_r, b_r⟩` for `r < rows`, rows of `width`, f64 partials (`llep_row_dot`;
    /// `a` and `b` of one type, `out` f32).
    fn row_dot(
        &self,
        a: &Self::Buf,
        b: &Self::Buf,
        rows: usize,
        width: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `C = op(A)·op(B)` (or `C += …` with [`Accumulate::Add`]), C row-major `m×n` from element
    /// `c_offset` of `c`, with f32 accumulation (no TF32): A and B of one type, C f32 or of
    /// theirs (a bf16 C is rounded once, from the f32 result).
    fn gemm(
        &self,
        dims: GemmDims,
        a: Operand<'_, Self::Buf>,
        b: Operand<'_, Self::Buf>,
        c: &mut Self::Buf,
        c_offset: usize,
        accumulate: Accumulate,
    ) -> Result<()>;

    /// All-to-all with variable counts: `send[send_offset..]` holds `send_counts[d]` elements for
    /// each rank d in rank order, `recv[recv_offset..]` receives `recv_counts[s]` from each rank
    /// s in rank order. Collective: every rank calls it.
    fn all_to_all_v(
        &self,
        send: (&Self::Buf, usize),
        send_counts: &[usize],
        recv: (&mut Self::Buf, usize),
        recv_counts: &[usize],
    ) -> Result<()>;
    /// Every operation issued before completes before any issued after starts, whatever
    /// stream or queue each runs on (no host wait). The schedule calls it at the start and end
    /// of a pass. The default does nothing: right for an implementation with one queue.
    fn fence(&self) -> Result<()> {
        Ok(())
    }

    /// [`DeviceOps::all_to_all_v`] of u32 (route metadata), from element 0.
    fn all_to_all_v_index(
        &self,
        send: &Self::Index,
        send_counts: &[usize],
        recv: &mut Self::Index,
        recv_counts: &[usize],
    ) -> Result<()>;
}

/// One rank's inputs on the device: tokens and native expert weights in device buffers, the
/// routing on the host (the plan and the route tables are built there).
#[derive(Debug)]
pub struct DeviceInputs<'a, B> {
    /// Tokens x, N×H.
    pub x: &'a B,
    /// Top-k ids and weights (host).
    pub routing: Routing<'a>,
    /// W_gate of the M native experts, `[M][H][I]`.
    pub gate: &'a B,
    /// W_up, `[M][H][I]`.
    pub up: &'a B,
    /// W_down, `[M][I][H]`.
    pub down: &'a B,
}

/// What [`backward`] returns, on the device (see [`Gradients`]).
#[derive(Debug)]
pub struct DeviceGradients<B> {
    /// dL/dx, N×H.
    pub dx: B,
    /// dL/dw_ij, N×k.
    pub d_weights: B,
    /// dL/dW_gate of the native experts, M·H·I.
    pub d_gate: B,
    /// dL/dW_up, M·H·I.
    pub d_up: B,
    /// dL/dW_down, M·I·H.
    pub d_down: B,
}

impl<B> DeviceGradients<B> {
    /// Copies every gradient to the host.
    pub fn download<O: DeviceOps<Buf = B>>(&self, ops: &O) -> Result<Gradients> {
        let all = |b: &B| ops.download(b, ops.buf_len(b));
        Ok(Gradients {
            dx: all(&self.dx)?,
            d_weights: all(&self.d_weights)?,
            d_gate: all(&self.d_gate)?,
            d_up: all(&self.d_up)?,
            d_down: all(&self.d_down)?,
        })
    }
}

/// What a saving [`forward`] keeps for [`backward`] in
/// [`Mode::SaveActivations`](crate::Mode::SaveActivations), as the regions of
/// [`Schedule::saved_regions`](crate::Schedule::saved_regions) (`Σ_s R[s][d]` received rows,
/// `L_d` computed routes, K rounds): received x rows (rows × H) on the device, their route
/// metadata (rows × k) on the host, every computed route's pre-activations `x·W_gate` and
/// `x·W_up` (routes × I each, round and group order) on the device, and each round's first route
/// (K + 1) on the host. [`crate::cpu::SavedActivations`] carves one from host memory.
#[derive(Debug)]
pub struct Store<'s, B> {
    /// Received x rows of every round, in round order.
    pub x: &'s mut B,
    /// Their route metadata, k entries per row.
    pub meta: &'s mut [RouteMeta],
    /// `x·W_gate` and `x·W_up` of every computed route, 2·I elements a route: each expert
    /// group's in the scratch's layout for that group (split: its gate block then its up block;
    /// torch's `gate_up_proj`: rows of `[gate | up]`), from element 2·I·(its first route).
    pub pre: &'s mut B,
    /// Round j's routes start at `route_start[j]`.
    pub route_start: &'s mut [u32],
}

/// Runs `$body` with each named buffer — a value of `$ty`, an enum of one variant per element
/// type (`F32`, `Bf16`) with a `dtype()` — bound to its elements when all hold one type; else
/// returns [`Error::DtypeMismatch`] naming `$what` (never a reinterpretation). The dispatch of
/// every backend's typed buffers.
macro_rules! same_type {
    ($ty:ident, $what:expr; $($v:ident),+ => $body:expr) => {{
        let found = [$($v.dtype()),+];
        match ($($v),+) {
            ($($ty::F32($v)),+) => $body,
            ($($ty::Bf16($v)),+) => $body,
            #[allow(unreachable_patterns)]
            _ => {
                let other = found.iter().copied().find(|&d| d != found[0]).unwrap_or(found[0]);
                return Err($crate::error::Error::DtypeMismatch { what: $what, expected: found[0], found: other });
            }
        }
    }};
}
pub(crate) use same_type;

/// Defines a backend's typed buffer `$name`, the enum [`same_type!`] dispatches on: elements in a
/// `$store<f32>` (`F32`) or a `$store<bf16>` (`Bf16`), with its length, its element type and its
/// f32 elements checked ([`Error::DtypeMismatch`] on bf16).
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
macro_rules! typed_buf {
    ($(#[$attr:meta])* $name:ident($store:ident)) => {
        $(#[$attr])*
        pub enum $name {
            /// f32 elements.
            F32($store<f32>),
            /// bf16 elements.
            Bf16($store<half::bf16>),
        }

        impl $name {
            /// Elements it holds.
            pub fn len(&self) -> usize {
                match self {
                    $name::F32(s) => s.len(),
                    $name::Bf16(s) => s.len(),
                }
            }
            /// Whether it holds no elements.
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }
            /// Its element type.
            pub fn dtype(&self) -> flatpeak_common::DType {
                match self {
                    $name::F32(_) => flatpeak_common::DType::F32,
                    $name::Bf16(_) => flatpeak_common::DType::Bf16,
                }
            }
            /// Its f32 elements, or [`Error::DtypeMismatch`](crate::Error::DtypeMismatch) naming
            /// `what`.
            pub fn as_f32(&self, what: &'static str) -> $crate::error::Result<&$store<f32>> {
                match self {
                    $name::F32(s) => Ok(s),
                    $name::Bf16(_) => Err($name::not_f32(what)),
                }
            }
            /// Its f32 elements, writable, or
            /// [`Error::DtypeMismatch`](crate::Error::DtypeMismatch) naming `what`.
            pub fn as_f32_mut(&mut self, what: &'static str) -> $crate::error::Result<&mut $store<f32>> {
                match self {
                    $name::F32(s) => Ok(s),
                    $name::Bf16(_) => Err($name::not_f32(what)),
                }
            }
            /// A bf16 buffer where f32 elements were asked for (`what`).
            fn not_f32(what: &'static str) -> $crate::error::Error {
                $crate::error::Error::DtypeMismatch {
                    what,
                    expected: flatpeak_common::DType::F32,
                    found: flatpeak_common::DType::Bf16,
                }
            }
        }
    };
}
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
pub(crate) use typed_buf;

/// The default [`fill_index`](DeviceOps::fill_index) and [`fill`](DeviceOps::fill): `fill`
/// writes into `len` zeroed host elements, and the first `written` of them go to the device by
/// `write`; returns `written`, or [`Error::ShapeMismatch`] naming `what` when `fill` says it
/// wrote more than `len`.
fn write_staged<T: Copy + Default>(
    what: &'static str,
    len: usize,
    fill: impl FnOnce(&mut [T]) -> Result<usize>,
    write: impl FnOnce(&[T]) -> Result<()>,
) -> Result<usize> {
    let mut staging = vec![T::default(); len];
    let written = fill(&mut staging)?;
    if written > len {
        return Err(Error::ShapeMismatch { what, expected: len, got: written });
    }
    staging.truncate(written);
    write(&staging)?;
    Ok(written)
}

/// `found ≥ expected`, or [`Error::ShapeMismatch`] naming `what`: the length check every
/// implementation runs before touching a buffer.
pub fn need(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if found >= expected { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got: found }) }
}
