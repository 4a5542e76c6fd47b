//! [`CountOps`]: the round schedule run without data, counting what a CUDA device would do for
//! it — kernel launches by entry point, cuBLAS GEMMs with their shapes, host uploads and the
//! downloads the host waits on, exchanges, allocations — and the bytes the custom kernels move.
//! It is the same schedule every backend runs ([`forward`](super::forward),
//! [`backward`](super::backward)); each [`DeviceOps`] call is counted as `crate::cuda::CudaOps`
//! issues it (one launch, one cuBLAS call, one copy), so a call's device work at any shape is
//! known on any machine, and a test can hold the counts that must not grow.
//!
//! Buffers hold no elements (only their length and type); index buffers hold their entries,
//! since the schedule reads the received route metadata back to form the groups. A kernel's
//! bytes are its reads plus its writes at the element sizes it is launched with.

use std::cell::RefCell;

use flatpeak_common::device_counts::{DeviceCounts, GemmCall};
use flatpeak_common::{Communicator, CommunicatorExt, DType};

use super::{DeviceOps, GemmDims, IndexedRows, Operand, PreAt, need};
use crate::error::{Error, Result};
use crate::kernels::{entry, scatter_entry};
use flatpeak_common::gemm::Accumulate;

/// A buffer of the counting backend: its length and element type, no elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountBuf {
    len: usize,
    dtype: DType,
}

/// The counting backend over `comm` (the exchanges of route metadata run over it for real).
#[derive(Debug)]
pub struct CountOps<'c, C: Communicator + ?Sized> {
    comm: &'c C,
    counts: RefCell<DeviceCounts>,
}

impl<'c, C: Communicator + ?Sized> CountOps<'c, C> {
    /// A backend that has counted nothing yet.
    pub fn new(comm: &'c C) -> Self {
        Self { comm, counts: RefCell::new(DeviceCounts::default()) }
    }
    /// What it has counted so far.
    pub fn counts(&self) -> DeviceCounts {
        self.counts.borrow().clone()
    }
    /// Forgets what it counted (a pass counted on its own).
    pub fn reset(&self) {
        *self.counts.borrow_mut() = DeviceCounts::default();
    }
    fn with(&self, f: impl FnOnce(&mut DeviceCounts)) {
        f(&mut self.counts.borrow_mut());
    }
}

fn elems(buf: &CountBuf, offset: usize, len: usize, what: &'static str) -> Result<()> {
    need(what, offset.saturating_add(len), buf.len)
}

/// A buffer of `len` elements of `elem` bytes reserved: as a device backend allocates it (at
/// least one element) and as it is carved from lent memory (rounded up to the alignment).
fn count_alloc(c: &mut DeviceCounts, len: usize, elem: usize) {
    c.allocations += 1;
    c.allocated_bytes += (len * elem) as u64;
    c.arena_bytes += (len.max(1) * elem).next_multiple_of(crate::Buffers::DEVICE_ALIGN) as u64;
}

fn size(dtype: DType) -> usize {
    dtype.size_in_bytes()
}

impl<C: Communicator + ?Sized> DeviceOps for CountOps<'_, C> {
    type Buf = CountBuf;
    type Index = Vec<u32>;

    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn alloc(&self, len: usize, dtype: DType) -> Result<CountBuf> {
        match dtype {
            DType::F32 | DType::Bf16 => {}
            other => {
                return Err(Error::UnsupportedDtype {
                    backend: "the counting backend",
                    dtype: other,
                    supported: "f32, bf16",
                });
            }
        }
        self.with(|c| count_alloc(c, len, size(dtype)));
        Ok(CountBuf { len, dtype })
    }
    fn alloc_index(&self, len: usize) -> Result<Vec<u32>> {
        self.with(|c| count_alloc(c, len, 4));
        Ok(vec![0; len])
    }
    fn buf_len(&self, buf: &CountBuf) -> usize {
        buf.len
    }
    fn buf_dtype(&self, buf: &CountBuf) -> DType {
        buf.dtype
    }
    fn upload(&self, host: &[f32]) -> Result<CountBuf> {
        self.with(|c| {
            count_alloc(c, host.len(), 4);
            c.upload(4 * host.len());
        });
        Ok(CountBuf { len: host.len(), dtype: DType::F32 })
    }
    fn write_index(&self, host: &[u32], dst: &mut Vec<u32>) -> Result<()> {
        need("index buffer", host.len(), dst.len())?;
        dst[..host.len()].copy_from_slice(host);
        if !host.is_empty() {
            self.with(|c| c.upload(4 * host.len()));
        }
        Ok(())
    }
    fn write(&self, host: &[f32], dst: &mut CountBuf) -> Result<()> {
        elems(dst, 0, host.len(), "write (f32 elements)")?;
        if !host.is_empty() {
            self.with(|c| c.upload(4 * host.len()));
        }
        Ok(())
    }
    fn download(&self, src: &CountBuf, len: usize) -> Result<Vec<f32>> {
        elems(src, 0, len, "download")?;
        self.with(|c| c.host_syncs += 1);
        Ok(vec![0.0; len])
    }
    fn download_index(&self, src: &Vec<u32>, len: usize) -> Result<Vec<u32>> {
        need("index download", len, src.len())?;
        self.with(|c| c.host_syncs += 1);
        Ok(src[..len].to_vec())
    }
    fn zero(&self, dst: &mut CountBuf, len: usize) -> Result<()> {
        elems(dst, 0, len, "zero")?;
        if len > 0 {
            self.with(|c| c.launch("memset", len * size(dst.dtype)));
        }
        Ok(())
    }
    fn copy(
        &self,
        (src, sa): (&CountBuf, usize),
        (dst, da): (&mut CountBuf, usize),
        len: usize,
    ) -> Result<()> {
        elems(src, sa, len, "copy src")?;
        elems(dst, da, len, "copy dst")?;
        if len > 0 {
            self.with(|c| {
                c.copies += 1;
                c.kernel_bytes += (2 * len * size(src.dtype)) as u64;
            });
        }
        Ok(())
    }
    fn gather_rows(&self, sel: IndexedRows<'_, CountBuf, Vec<u32>>, dst: &mut CountBuf) -> Result<()> {
        if sel.is_empty() {
            return Ok(());
        }
        let (rows, width, b) = (sel.rows, sel.width, size(sel.src.dtype));
        elems(dst, 0, rows * width, "gather dst (rows·width)")?;
        sel.index_range(sel.index.len())?;
        if let Some(s) = sel.scale {
            sel.scale_range(s.len)?;
        }
        let scale = if sel.scale.is_some() { 4 * rows } else { 0 };
        self.with(|c| {
            c.launch(
                entry("llep_gather_rows", "llep_gather_rows_bf16", sel.src.dtype),
                2 * rows * width * b + 4 * rows + scale,
            )
        });
        Ok(())
    }
    fn scatter_add_rows(&self, sel: IndexedRows<'_, CountBuf, Vec<u32>>, acc: &mut CountBuf) -> Result<()> {
        if sel.is_empty() {
            return Ok(());
        }
        let (rows, width) = (sel.rows, sel.width);
        elems(sel.src, 0, rows * width, "scatter src (rows·width)")?;
        let index = &sel.index[sel.index_range(sel.index.len())?];
        if let Some(s) = sel.scale {
            sel.scale_range(s.len)?;
        }
        let layout = super::ScatterLayout::of(index, acc.len / width)?;
        let scale = if sel.scale.is_some() { 4 * rows } else { 0 };
        let name = scatter_entry(sel.src.dtype, acc.dtype, &layout)?;
        // Every source row read once, every destination read and written once, and the index
        // (direct) or the uploaded groups (grouped).
        let (dests, index_bytes, upload) = match &layout {
            super::ScatterLayout::Direct => (rows, 4 * rows, 0),
            super::ScatterLayout::Grouped(g) => (g.groups(), 4 * g.packed().len(), 4 * g.packed().len()),
        };
        let bytes =
            rows * width * size(sel.src.dtype) + 2 * dests * width * size(acc.dtype) + index_bytes + scale;
        self.with(|c| {
            if upload > 0 {
                c.upload(upload);
            }
            c.launch(name, bytes);
        });
        Ok(())
    }
    fn swiglu(&self, gu: &CountBuf, at: PreAt, n: usize, h: &mut CountBuf) -> Result<()> {
        at.check(n, gu.len)?;
        elems(h, 0, n, "swiglu h")?;
        if n > 0 {
            self.with(|c| {
                c.launch(entry("llep_swiglu", "llep_swiglu_bf16", gu.dtype), 3 * n * size(gu.dtype))
            });
        }
        Ok(())
    }
    fn swiglu_backward(&self, gu: &mut CountBuf, at: PreAt, dh: &CountBuf, n: usize) -> Result<()> {
        at.check(n, gu.len)?;
        elems(dh, 0, n, "swiglu_backward dh")?;
        if n > 0 {
            self.with(|c| {
                c.launch(
                    entry("llep_swiglu_backward", "llep_swiglu_backward_bf16", gu.dtype),
                    5 * n * size(gu.dtype),
                )
            });
        }
        Ok(())
    }
    fn row_dot(
        &self,
        a: &CountBuf,
        b: &CountBuf,
        rows: usize,
        width: usize,
        out: &mut CountBuf,
    ) -> Result<()> {
        elems(a, 0, rows * width, "row_dot a")?;
        elems(b, 0, rows * width, "row_dot b")?;
        elems(out, 0, rows, "row_dot out")?;
        if rows > 0 {
            self.with(|c| {
                c.launch(
                    entry("llep_row_dot", "llep_row_dot_bf16", a.dtype),
                    2 * rows * width * size(a.dtype) + 4 * rows,
                )
            });
        }
        Ok(())
    }
    fn gemm(
        &self,
        dims: GemmDims,
        a: Operand<'_, CountBuf>,
        b: Operand<'_, CountBuf>,
        c: &mut CountBuf,
        c_offset: usize,
        accumulate: Accumulate,
    ) -> Result<()> {
        let GemmDims { m, n, k } = dims;
        elems(a.buf, a.offset, m * k, "gemm A")?;
        elems(b.buf, b.offset, k * n, "gemm B")?;
        elems(c, c_offset, m * n, "gemm C")?;
        if a.buf.dtype != b.buf.dtype {
            return Err(Error::DtypeMismatch {
                what: "gemm B (A's type)",
                expected: a.buf.dtype,
                found: b.buf.dtype,
            });
        }
        if m * n > 0 {
            let (dtype, out, accumulate) = (a.buf.dtype, c.dtype, accumulate == Accumulate::Add);
            self.with(|counts| counts.gemm(GemmCall { m, n, k, dtype, out, accumulate }));
        }
        Ok(())
    }
    fn all_to_all_v(
        &self,
        (send, sa): (&CountBuf, usize),
        send_counts: &[usize],
        (recv, ra): (&mut CountBuf, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr): (usize, usize) = (send_counts.iter().sum(), recv_counts.iter().sum());
        elems(send, sa, ns, "all_to_all_v send elements")?;
        elems(recv, ra, nr, "all_to_all_v recv elements")?;
        // Still a collective, without the rows: a word to every peer keeps the ranks in step.
        let ones = vec![1usize; self.comm.world_size()];
        let (mine, mut theirs) = (vec![0u32; ones.len()], vec![0u32; ones.len()]);
        self.comm.all_to_all_v(&mine, &ones, &mut theirs, &ones)?;
        self.with(|c| {
            c.exchanges += 1;
            c.kernel_bytes += ((ns + nr) * size(send.dtype)) as u64;
        });
        Ok(())
    }
    fn all_to_all_v_index(
        &self,
        send: &Vec<u32>,
        send_counts: &[usize],
        recv: &mut Vec<u32>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr): (usize, usize) = (send_counts.iter().sum(), recv_counts.iter().sum());
        need("all_to_all_v send elements", ns, send.len())?;
        need("all_to_all_v recv elements", nr, recv.len())?;
        self.comm.all_to_all_v(&send[..ns], send_counts, &mut recv[..nr], recv_counts)?;
        self.with(|c| {
            c.exchanges += 1;
            c.kernel_bytes += (4 * (ns + nr)) as u64;
        });
        Ok(())
    }
}

/// What a training step of the layer asks of this rank's device: the forward, and the
/// backward that recomputes it ([`Mode::Checkpointed`](crate::Mode::Checkpointed)), each
/// counted on its own, for `launch` and this rank's `routing` (every rank of `comm` calls it).
/// The inputs are buffers of the layer's storage type; the schedule is the host's
/// ([`crate::cpu::schedule`]), as every device backend runs it.
pub fn count_step<C: Communicator + ?Sized>(
    comm: &C,
    launch: &crate::Plan,
    routing: &crate::layer::Routing<'_>,
) -> Result<StepCounts> {
    let plan = crate::cpu::schedule(comm, launch, routing)?;
    let (s, me) = (*launch.shape(), comm.rank());
    let ops = CountOps::new(comm);
    let dt = s.dtype;
    // The native weights in the config's layout (torch's: gate_up `[M][2I][H]`, up empty).
    let [gate_len, up_len, down_len] = launch.config().weight_layout.native_lens(&s);
    let (x, gate, up, down, dy) = (
        ops.alloc(s.tokens * s.hidden, dt)?,
        ops.alloc(gate_len, dt)?,
        ops.alloc(up_len, dt)?,
        ops.alloc(down_len, dt)?,
        ops.alloc(s.tokens * s.hidden, dt)?,
    );
    let dev = super::DeviceInputs { x: &x, routing: *routing, gate: &gate, up: &up, down: &down };
    // Each pass carves its host arrays from a workspace of its own, as an executor's would.
    let host = |pass| flatpeak_common::Workspace::new(plan.buffers(me, pass).host_workspace_bytes());
    ops.reset();
    super::forward(&ops, &host(crate::Pass::Forward)?, &plan, &dev, None)?;
    let forward = ops.counts();
    ops.reset();
    super::backward(&ops, &host(crate::Pass::Backward)?, &plan, &dev, &dy, None)?;
    Ok(StepCounts { rounds: plan.rounds(), forward, backward: ops.counts() })
}

/// A step's device work ([`count_step`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepCounts {
    /// The dispatch rounds the routing took.
    pub rounds: usize,
    /// The forward's.
    pub forward: DeviceCounts,
    /// The backward's (recomputing).
    pub backward: DeviceCounts,
}
