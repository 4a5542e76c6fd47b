//! [`DeviceOps`] on the host: the CPU backend of the one round schedule ([`crate::device`]).
//! Buffers are host memory — the caller's tensors read in place ([`HostBuf::Input`]), scratch
//! carved from the executor's [`Workspace`] in the order of
//! [`Buffers::regions`](crate::Buffers::regions) ([`HostBuf::Carved`]: the workspace is reserved
//! once and never grows), and the returned outputs ([`HostBuf::Output`]). The kernels are
//! plain loops with the `.cu` kernels' arithmetic, the GEMM is [`flatpeak_common::gemm::matmul`]
//! (bitwise identical for any thread count) and all-to-all is the [`Communicator`]'s. Every
//! operation runs when it is issued, so the schedule's pipeline is a plain sequence here, and
//! lists the schedule fills (`fill_index`) are written straight into their buffers.
//!
//! Reproducible: fixed round, destination, expert and row orders, sequential accumulation in
//! scatters and dot products, and a GEMM whose result does not depend on its threads.

use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, Threads, matmul};
use flatpeak_common::{Communicator, CommunicatorExt, Workspace};

use crate::device::{DeviceOps, GemmDims, Operand, Orientation, need};
use crate::error::{Error, Result};

/// A host buffer of the CPU backend.
pub enum HostBuf<'a> {
    /// A caller's tensor, read in place (writing to it is an error).
    Input(&'a [f32]),
    /// Scratch carved from the executor's workspace.
    Carved(&'a mut [f32]),
    /// An output the call returns (zeroed when made).
    Output(Vec<f32>),
}

impl std::fmt::Debug for HostBuf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            HostBuf::Input(_) => "Input",
            HostBuf::Carved(_) => "Carved",
            HostBuf::Output(_) => "Output",
        };
        write!(f, "HostBuf::{kind}({} f32)", self.as_slice().len())
    }
}

impl HostBuf<'_> {
    /// The elements.
    pub fn as_slice(&self) -> &[f32] {
        match self {
            HostBuf::Input(s) => s,
            HostBuf::Carved(s) => s,
            HostBuf::Output(v) => v,
        }
    }

    /// The elements, writable: an [`HostBuf::Input`] is a [`Error::ShapeMismatch`] (no
    /// writable element).
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        match self {
            HostBuf::Input(s) => Err(Error::ShapeMismatch {
                what: "writable buffer (a caller's input)",
                expected: s.len(),
                got: 0,
            }),
            HostBuf::Carved(s) => Ok(s),
            HostBuf::Output(v) => Ok(v),
        }
    }

    /// The elements as an owned vector (an output's own, moved; otherwise copied).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            HostBuf::Output(v) => v,
            other => other.as_slice().to_vec(),
        }
    }
}

/// The CPU as the device of one rank of a host communicator group, its buffers carved from `ws`.
#[derive(Debug)]
pub struct HostOps<'w, C: ?Sized> {
    comm: &'w C,
    ws: &'w Workspace,
    threads: Threads,
}

impl<'w, C: Communicator + ?Sized> HostOps<'w, C> {
    /// The host device of `comm`'s rank: scratch from `ws` (reset it before each pass), GEMMs
    /// on `threads`.
    pub fn new(comm: &'w C, ws: &'w Workspace, threads: Threads) -> Self {
        Self { comm, ws, threads }
    }
}

/// `v[at..at + len]`, or [`Error::ShapeMismatch`].
pub(crate) fn span<'a, T>(what: &'static str, v: &'a [T], at: usize, len: usize) -> Result<&'a [T]> {
    v.get(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: v.len() })
}

/// `v[at..at + len]` mutably, or [`Error::ShapeMismatch`].
pub(crate) fn span_mut<'a, T>(
    what: &'static str,
    v: &'a mut [T],
    at: usize,
    len: usize,
) -> Result<&'a mut [T]> {
    let found = v.len();
    v.get_mut(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: found })
}

/// A GEMM operand on the host: its storage, first element and orientation.
pub(crate) type HostOperand<'a> = (&'a [f32], usize, Orientation);

/// A GEMM operand of `rows × cols` (as op(·) sees it), stored in `data` from `offset`.
fn operand<'a>(
    what: &'static str,
    (data, offset, orientation): HostOperand<'a>,
    rows: usize,
    cols: usize,
) -> Result<MatRef<'a, f32>> {
    let data = span(what, data, offset, rows * cols)?;
    Ok(if orientation == Orientation::Transposed {
        MatRef::row_major(data, cols, rows)?.t()
    } else {
        MatRef::row_major(data, rows, cols)?
    })
}

/// `C = op(A)·op(B)` (or `+=`) on host slices by the CPU GEMM: the GEMM of every host backend.
pub(crate) fn host_gemm(
    GemmDims { m, n, k }: GemmDims,
    (a, b): (HostOperand<'_>, HostOperand<'_>),
    (c, c_offset): (&mut [f32], usize),
    accumulate: Accumulate,
    threads: Threads,
) -> Result<()> {
    let c = span_mut("gemm C (m·n)", c, c_offset, m * n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if accumulate == Accumulate::Replace {
            c.fill(0.0);
        }
        return Ok(());
    }
    let (a, b) = (operand("gemm A (m·k)", a, m, k)?, operand("gemm B (k·n)", b, k, n)?);
    let options = MatmulOptions::with_accumulate(accumulate).threads(threads);
    Ok(matmul(MatMut::row_major(c, m, n)?, a, b, options)?)
}

/// Every index below `bound` (rows of the indexed buffer), or [`Error::ShapeMismatch`].
fn check_index(index: &[u32], bound: usize) -> Result<()> {
    match index.iter().find(|&&i| i as usize >= bound) {
        Some(&i) => Err(Error::ShapeMismatch {
            what: "row index (rows of src)",
            expected: bound,
            got: i as usize + 1,
        }),
        None => Ok(()),
    }
}

fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// `len` zeros written now. `vec![0.0; len]` asks the allocator for zeroed memory, whose fresh
/// pages are first mapped to the shared zero page and then copied on the first write of an
/// accumulation (`+=`): a second fault and a TLB shoot-down across the group's threads per
/// page. Writing the zeros makes the first touch a plain write fault.
fn zeros(len: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.resize(len, 0.0);
    v
}

impl<'w, C: Communicator + ?Sized> DeviceOps for HostOps<'w, C> {
    type Buf = HostBuf<'w>;
    type Index = &'w mut [u32];

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn alloc(&self, len: usize) -> Result<HostBuf<'w>> {
        Ok(HostBuf::Carved(if len == 0 { Default::default() } else { self.ws.take(len)? }))
    }

    fn alloc_index(&self, len: usize) -> Result<&'w mut [u32]> {
        Ok(if len == 0 { Default::default() } else { self.ws.take(len)? })
    }

    fn alloc_output(&self, len: usize) -> Result<HostBuf<'w>> {
        Ok(HostBuf::Output(zeros(len)))
    }

    fn buf_len(&self, buf: &HostBuf<'w>) -> usize {
        buf.as_slice().len()
    }

    fn upload(&self, host: &[f32]) -> Result<HostBuf<'w>> {
        Ok(HostBuf::Output(host.to_vec()))
    }

    fn write_index(&self, host: &[u32], dst: &mut &'w mut [u32]) -> Result<()> {
        span_mut("index buffer", dst, 0, host.len())?.copy_from_slice(host);
        Ok(())
    }

    fn write(&self, host: &[f32], dst: &mut HostBuf<'w>) -> Result<()> {
        span_mut("buffer", dst.as_mut_slice()?, 0, host.len())?.copy_from_slice(host);
        Ok(())
    }

    fn download(&self, src: &HostBuf<'w>, len: usize) -> Result<Vec<f32>> {
        Ok(span("download", src.as_slice(), 0, len)?.to_vec())
    }

    fn download_index(&self, src: &&'w mut [u32], len: usize) -> Result<Vec<u32>> {
        Ok(span("index download", src, 0, len)?.to_vec())
    }

    fn download_index_into(&self, src: &&'w mut [u32], dst: &mut [u32]) -> Result<()> {
        dst.copy_from_slice(span("index download", src, 0, dst.len())?);
        Ok(())
    }

    fn fill_index<F>(&self, dst: &mut &'w mut [u32], len: usize, fill: F) -> Result<usize>
    where
        F: FnOnce(&mut [u32]) -> Result<usize>,
    {
        let written = fill(span_mut("index buffer", dst, 0, len)?)?;
        need("index entries filled (at most the length)", written, len).map(|()| written)
    }

    fn fill<F>(&self, dst: &mut HostBuf<'w>, len: usize, fill: F) -> Result<usize>
    where
        F: FnOnce(&mut [f32]) -> Result<usize>,
    {
        let written = fill(span_mut("buffer", dst.as_mut_slice()?, 0, len)?)?;
        need("elements filled (at most the length)", written, len).map(|()| written)
    }

    fn zero(&self, dst: &mut HostBuf<'w>, len: usize) -> Result<()> {
        span_mut("zero fill", dst.as_mut_slice()?, 0, len)?.fill(0.0);
        Ok(())
    }

    fn copy(
        &self,
        (src, src_at): (&HostBuf<'w>, usize),
        (dst, dst_at): (&mut HostBuf<'w>, usize),
        len: usize,
    ) -> Result<()> {
        let from = span("copy source", src.as_slice(), src_at, len)?;
        span_mut("copy destination", dst.as_mut_slice()?, dst_at, len)?.copy_from_slice(from);
        Ok(())
    }

    fn gather_rows(
        &self,
        src: &HostBuf<'w>,
        index: &&'w mut [u32],
        rows: usize,
        scale: Option<&HostBuf<'w>>,
        width: usize,
        dst: &mut HostBuf<'w>,
    ) -> Result<()> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let (src, index) = (src.as_slice(), span("gather index (rows)", index, 0, rows)?);
        check_index(index, src.len() / width)?;
        let dst = span_mut("gather dst (rows·width)", dst.as_mut_slice()?, 0, rows * width)?;
        let scale = scale.map(|s| span("gather scale (rows)", s.as_slice(), 0, rows)).transpose()?;
        for (r, (out, &i)) in dst.chunks_exact_mut(width).zip(index).enumerate() {
            let row = &src[i as usize * width..][..width];
            match scale {
                None => out.copy_from_slice(row),
                Some(s) => {
                    let w = s[r];
                    out.iter_mut().zip(row).for_each(|(o, v)| *o = w * v);
                }
            }
        }
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        src: &HostBuf<'w>,
        index: &&'w mut [u32],
        rows: usize,
        scale: Option<&HostBuf<'w>>,
        width: usize,
        acc: &mut HostBuf<'w>,
    ) -> Result<()> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let index = span("scatter index (rows)", index, 0, rows)?;
        let src = span("scatter src (rows·width)", src.as_slice(), 0, rows * width)?;
        let acc = acc.as_mut_slice()?;
        check_index(index, acc.len() / width)?;
        let scale = scale.map(|s| span("scatter scale (rows)", s.as_slice(), 0, rows)).transpose()?;
        for (r, (row, &i)) in src.chunks_exact(width).zip(index).enumerate() {
            let out = &mut acc[i as usize * width..][..width];
            match scale {
                None => out.iter_mut().zip(row).for_each(|(o, v)| *o += v),
                Some(s) => {
                    let w = s[r];
                    out.iter_mut().zip(row).for_each(|(o, v)| *o += w * v);
                }
            }
        }
        Ok(())
    }

    fn swiglu(&self, gate: &HostBuf<'w>, up: &HostBuf<'w>, n: usize, h: &mut HostBuf<'w>) -> Result<()> {
        let (g, u) = (span("swiglu gate", gate.as_slice(), 0, n)?, span("swiglu up", up.as_slice(), 0, n)?);
        let h = span_mut("swiglu h", h.as_mut_slice()?, 0, n)?;
        for ((o, &g), &u) in h.iter_mut().zip(g).zip(u) {
            *o = g * sigmoid(g) * u;
        }
        Ok(())
    }

    fn swiglu_backward(
        &self,
        gate: &mut HostBuf<'w>,
        up: &mut HostBuf<'w>,
        dh: &HostBuf<'w>,
        n: usize,
    ) -> Result<()> {
        let dh = span("swiglu_backward dh", dh.as_slice(), 0, n)?;
        let gate = span_mut("swiglu_backward gate", gate.as_mut_slice()?, 0, n)?;
        let up = span_mut("swiglu_backward up", up.as_mut_slice()?, 0, n)?;
        for ((g, u), &d) in gate.iter_mut().zip(up.iter_mut()).zip(dh) {
            let (gv, uv) = (*g, *u);
            let s = sigmoid(gv);
            *g = d * uv * (s * (1.0 + gv * (1.0 - s)));
            *u = d * (gv * s);
        }
        Ok(())
    }

    fn row_dot(
        &self,
        a: &HostBuf<'w>,
        b: &HostBuf<'w>,
        rows: usize,
        width: usize,
        out: &mut HostBuf<'w>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let a = span("row_dot a", a.as_slice(), 0, rows * width)?;
        let b = span("row_dot b", b.as_slice(), 0, rows * width)?;
        let out = span_mut("row_dot out (rows)", out.as_mut_slice()?, 0, rows)?;
        for (r, o) in out.iter_mut().enumerate() {
            let (x, y) = (&a[r * width..][..width], &b[r * width..][..width]);
            // f64 partials: one per route, cheap, and exact enough to compare against f64.
            *o = x.iter().zip(y).map(|(p, q)| *p as f64 * *q as f64).sum::<f64>() as f32;
        }
        Ok(())
    }

    fn gemm(
        &self,
        dims: GemmDims,
        a: Operand<'_, HostBuf<'w>>,
        b: Operand<'_, HostBuf<'w>>,
        c: &mut HostBuf<'w>,
        c_offset: usize,
        accumulate: Accumulate,
    ) -> Result<()> {
        let (a, b) =
            ((a.buf.as_slice(), a.offset, a.orientation), (b.buf.as_slice(), b.offset, b.orientation));
        host_gemm(dims, (a, b), (c.as_mut_slice()?, c_offset), accumulate, self.threads)
    }

    fn all_to_all_v(
        &self,
        (send, send_at): (&HostBuf<'w>, usize),
        send_counts: &[usize],
        (recv, recv_at): (&mut HostBuf<'w>, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum());
        let send = span("all_to_all_v send elements", send.as_slice(), send_at, ns)?;
        let recv = span_mut("all_to_all_v recv elements", recv.as_mut_slice()?, recv_at, nr)?;
        Ok(self.comm.all_to_all_v(send, send_counts, recv, recv_counts)?)
    }

    fn all_to_all_v_index(
        &self,
        send: &&'w mut [u32],
        send_counts: &[usize],
        recv: &mut &'w mut [u32],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum());
        let send = span("all_to_all_v send elements", send, 0, ns)?;
        let recv = span_mut("all_to_all_v recv elements", recv, 0, nr)?;
        Ok(self.comm.all_to_all_v(send, send_counts, recv, recv_counts)?)
    }
}
