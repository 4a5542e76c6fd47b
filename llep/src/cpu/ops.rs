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
use flatpeak_common::gemm_bf16::Bf16Kernel;
use flatpeak_common::{Communicator, CommunicatorExt, DType, Workspace};
use half::bf16;

use super::elem::{self, IndexScale, View, ViewMut, mismatch, span, span_mut};
use crate::device::{DeviceOps, GemmDims, IndexedRows, Operand, Orientation, PreAt, need, same_type};
use crate::error::{Error, Result};

/// A host buffer of the CPU backend: f32, or bf16 (the storage type of a bf16 layer).
pub enum HostBuf<'a> {
    /// A caller's f32 tensor, read in place (writing to it is an error).
    Input(&'a [f32]),
    /// A caller's bf16 tensor, read in place.
    InputBf16(&'a [bf16]),
    /// f32 scratch carved from the executor's workspace.
    Carved(&'a mut [f32]),
    /// bf16 scratch carved from the executor's workspace.
    CarvedBf16(&'a mut [bf16]),
    /// An f32 output the call returns (zeroed when made).
    Output(Vec<f32>),
}

impl std::fmt::Debug for HostBuf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            HostBuf::Input(_) | HostBuf::InputBf16(_) => "Input",
            HostBuf::Carved(_) | HostBuf::CarvedBf16(_) => "Carved",
            HostBuf::Output(_) => "Output",
        };
        write!(f, "HostBuf::{kind}({} {})", self.len(), self.dtype())
    }
}

impl HostBuf<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.view().dtype()
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.view().len()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn view(&self) -> View<'_> {
        match self {
            HostBuf::Input(s) => View::F32(s),
            HostBuf::Carved(s) => View::F32(s),
            HostBuf::Output(v) => View::F32(v),
            HostBuf::InputBf16(s) => View::Bf16(s),
            HostBuf::CarvedBf16(s) => View::Bf16(s),
        }
    }

    /// The elements, writable: a caller's input is a [`Error::ShapeMismatch`] (no writable
    /// element).
    pub(crate) fn view_mut(&mut self) -> Result<ViewMut<'_>> {
        match self {
            HostBuf::Input(_) | HostBuf::InputBf16(_) => {
                let expected = self.len();
                Err(Error::ShapeMismatch { what: "writable buffer (a caller's input)", expected, got: 0 })
            }
            HostBuf::Carved(s) => Ok(ViewMut::F32(s)),
            HostBuf::CarvedBf16(s) => Ok(ViewMut::Bf16(s)),
            HostBuf::Output(v) => Ok(ViewMut::F32(v)),
        }
    }

    /// The f32 elements, or [`Error::DtypeMismatch`] for a bf16 buffer.
    pub fn as_slice(&self) -> Result<&[f32]> {
        match self.view() {
            View::F32(s) => Ok(s),
            View::Bf16(_) => Err(mismatch("f32 buffer", DType::F32, DType::Bf16)),
        }
    }

    /// The f32 elements, writable: a caller's input is a [`Error::ShapeMismatch`], a bf16
    /// buffer a [`Error::DtypeMismatch`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        match self.view_mut()? {
            ViewMut::F32(s) => Ok(s),
            ViewMut::Bf16(_) => Err(mismatch("f32 buffer", DType::F32, DType::Bf16)),
        }
    }

    /// The f32 elements as an owned vector (an output's own, moved; otherwise copied), or
    /// [`Error::DtypeMismatch`] for a bf16 buffer.
    pub fn into_vec(self) -> Result<Vec<f32>> {
        match self {
            HostBuf::Output(v) => Ok(v),
            other => Ok(other.as_slice()?.to_vec()),
        }
    }
}

/// The CPU as the device of one rank of a host communicator group, its buffers carved from `ws`.
#[derive(Debug)]
pub struct HostOps<'w, C: ?Sized> {
    comm: &'w C,
    ws: &'w Workspace,
    threads: Threads,
    bf16_kernel: Bf16Kernel,
}

impl<'w, C: Communicator + ?Sized> HostOps<'w, C> {
    /// The host device of `comm`'s rank: scratch from `ws` (reset it before each pass), GEMMs
    /// on `threads`, bf16 GEMMs on the CPU's bf16 instructions where it has them.
    pub fn new(comm: &'w C, ws: &'w Workspace, threads: Threads) -> Self {
        Self { comm, ws, threads, bf16_kernel: Bf16Kernel::Detect }
    }

    /// This device with its bf16 GEMMs on `bf16_kernel`.
    pub fn with_bf16_kernel(self, bf16_kernel: Bf16Kernel) -> Self {
        Self { bf16_kernel, ..self }
    }
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

/// `len` zeros written now. `vec![0.0; len]` asks the allocator for zeroed memory, whose fresh
/// pages are first mapped to the shared zero page and then copied on the first write of an
/// accumulation (`+=`): a second fault and a TLB shoot-down across the group's threads per
/// page. Writing the zeros makes the first touch a plain write fault.
fn zeros(len: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.resize(len, 0.0);
    v
}

/// A read-only or writable view, so `same_type!` matches both kinds at once.
enum ElemRef<F, B> {
    F32(F),
    Bf16(B),
}

impl<F, B> ElemRef<F, B> {
    fn dtype(&self) -> DType {
        match self {
            ElemRef::F32(_) => DType::F32,
            ElemRef::Bf16(_) => DType::Bf16,
        }
    }
}

type ElemSlice<'a> = ElemRef<&'a [f32], &'a [bf16]>;
type ElemSliceMut<'a> = ElemRef<&'a mut [f32], &'a mut [bf16]>;

/// `buf[at..at + len]`, by type.
fn slice<'a>(what: &'static str, buf: &'a HostBuf<'_>, at: usize, len: usize) -> Result<ElemSlice<'a>> {
    Ok(match buf.view() {
        View::F32(s) => ElemRef::F32(span(what, s, at, len)?),
        View::Bf16(s) => ElemRef::Bf16(span(what, s, at, len)?),
    })
}

/// `buf[at..at + len]` writable, by type.
fn slice_mut<'a>(
    what: &'static str,
    buf: &'a mut HostBuf<'_>,
    at: usize,
    len: usize,
) -> Result<ElemSliceMut<'a>> {
    Ok(match buf.view_mut()? {
        ViewMut::F32(s) => ElemRef::F32(span_mut(what, s, at, len)?),
        ViewMut::Bf16(s) => ElemRef::Bf16(span_mut(what, s, at, len)?),
    })
}

/// The rows of a gather or scatter on the host.
type HostRows<'a, 'w> = IndexedRows<'a, HostBuf<'w>, &'w mut [u32]>;

/// The index entries and the routing-weight scale (f32, `rows` of them) of a gather or scatter
/// whose entries must be rows of a buffer of `len` elements; `None` when it moves nothing.
fn host_rows<'a>(sel: &HostRows<'a, '_>, len: usize) -> Result<Option<IndexScale<'a>>> {
    if sel.is_empty() {
        return Ok(None);
    }
    let index: &'a [u32] = sel.index;
    let index = &index[sel.index_range(index.len())?];
    check_index(index, len / sel.width)?;
    let scale = match sel.scale {
        Some(s) => {
            let s = s.as_slice()?;
            Some(&s[sel.scale_range(s.len())?])
        }
        None => None,
    };
    Ok(Some((index, scale)))
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

    fn alloc(&self, len: usize, dtype: DType) -> Result<HostBuf<'w>> {
        Ok(match dtype {
            DType::F32 => HostBuf::Carved(if len == 0 { Default::default() } else { self.ws.take(len)? }),
            DType::Bf16 => {
                HostBuf::CarvedBf16(if len == 0 { Default::default() } else { self.ws.take(len)? })
            }
            other => {
                return Err(Error::UnsupportedDtype {
                    dtype: other,
                    backend: "the CPU",
                    supported: "f32 and bf16",
                });
            }
        })
    }

    fn alloc_index(&self, len: usize) -> Result<&'w mut [u32]> {
        Ok(if len == 0 { Default::default() } else { self.ws.take(len)? })
    }

    fn alloc_output(&self, len: usize) -> Result<HostBuf<'w>> {
        Ok(HostBuf::Output(zeros(len)))
    }

    fn buf_len(&self, buf: &HostBuf<'w>) -> usize {
        buf.len()
    }

    fn buf_dtype(&self, buf: &HostBuf<'w>) -> DType {
        buf.dtype()
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
        Ok(span("download", src.as_slice()?, 0, len)?.to_vec())
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
        match slice_mut("zero fill", dst, 0, len)? {
            ElemRef::F32(d) => d.fill(0.0),
            ElemRef::Bf16(d) => d.fill(bf16::ZERO),
        }
        Ok(())
    }

    fn copy(
        &self,
        (src, src_at): (&HostBuf<'w>, usize),
        (dst, dst_at): (&mut HostBuf<'w>, usize),
        len: usize,
    ) -> Result<()> {
        let from = slice("copy source", src, src_at, len)?;
        let to = slice_mut("copy destination", dst, dst_at, len)?;
        same_type!(ElemRef, "copy (source and destination)"; from, to => to.copy_from_slice(from));
        Ok(())
    }

    fn gather_rows(&self, sel: HostRows<'_, 'w>, dst: &mut HostBuf<'w>) -> Result<()> {
        let Some((index, scale)) = host_rows(&sel, sel.src.len())? else { return Ok(()) };
        let (src, width) = (slice("gather src", sel.src, 0, sel.src.len())?, sel.width);
        let dst = slice_mut("gather dst (rows·width)", dst, 0, sel.rows * width)?;
        same_type!(ElemRef, "gather_rows (src and dst)"; src, dst => elem::gather(src, index, scale, width, dst, self.threads));
        Ok(())
    }

    fn scatter_add_rows(&self, sel: HostRows<'_, 'w>, acc: &mut HostBuf<'w>) -> Result<()> {
        let Some((index, scale)) = host_rows(&sel, acc.len())? else { return Ok(()) };
        let (width, acc_len) = (sel.width, acc.len());
        let src = slice("scatter src (rows·width)", sel.src, 0, sel.rows * width)?;
        let acc = slice_mut("scatter acc", acc, 0, acc_len)?;
        match (src, acc) {
            (ElemRef::F32(s), ElemRef::F32(a)) => elem::scatter_add(s, index, scale, width, a, self.threads),
            (ElemRef::Bf16(s), ElemRef::F32(a)) => elem::scatter_add(s, index, scale, width, a, self.threads),
            (ElemRef::Bf16(s), ElemRef::Bf16(a)) => {
                elem::scatter_add(s, index, scale, width, a, self.threads)
            }
            (ElemRef::F32(_), ElemRef::Bf16(_)) => {
                return Err(mismatch(
                    "scatter_add_rows acc (at least as wide as src)",
                    DType::F32,
                    DType::Bf16,
                ));
            }
        }
        Ok(())
    }

    fn swiglu(&self, gu: &HostBuf<'w>, at: PreAt, n: usize, h: &mut HostBuf<'w>) -> Result<()> {
        at.check(n, gu.len())?;
        let gu = slice("swiglu pre-activations", gu, 0, at.extent(n))?;
        let h = slice_mut("swiglu h", h, 0, n)?;
        same_type!(ElemRef, "swiglu (pre-activations and h)"; gu, h => elem::swiglu_at(gu, at, h, self.threads));
        Ok(())
    }

    fn swiglu_backward(&self, gu: &mut HostBuf<'w>, at: PreAt, dh: &HostBuf<'w>, n: usize) -> Result<()> {
        at.check(n, gu.len())?;
        let dh = slice("swiglu_backward dh", dh, 0, n)?;
        let gu = slice_mut("swiglu pre-activations", gu, 0, at.extent(n))?;
        same_type!(ElemRef, "swiglu_backward (pre-activations and dh)"; gu, dh =>
            elem::swiglu_backward_at(gu, at, dh, self.threads));
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
        let a = slice("row_dot a", a, 0, rows * width)?;
        let b = slice("row_dot b", b, 0, rows * width)?;
        let out = span_mut("row_dot out (rows)", out.as_mut_slice()?, 0, rows)?;
        same_type!(ElemRef, "row_dot (a and b)"; a, b => elem::row_dot(a, b, width, out, self.threads));
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
        match (a.buf.view(), b.buf.view()) {
            (View::F32(x), View::F32(y)) => {
                let (x, y) = ((x, a.offset, a.orientation), (y, b.offset, b.orientation));
                host_gemm(dims, (x, y), (c.as_mut_slice()?, c_offset), accumulate, self.threads)
            }
            (View::Bf16(x), View::Bf16(y)) => {
                let (x, y) = ((x, a.offset, a.orientation), (y, b.offset, b.orientation));
                elem::gemm_bf16(
                    dims,
                    (x, y),
                    (c.view_mut()?, c_offset),
                    accumulate,
                    (self.threads, self.bf16_kernel),
                )
            }
            (x, y) => Err(mismatch("gemm operands A and B", x.dtype(), y.dtype())),
        }
    }

    fn all_to_all_v(
        &self,
        (send, send_at): (&HostBuf<'w>, usize),
        send_counts: &[usize],
        (recv, recv_at): (&mut HostBuf<'w>, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum());
        let send = slice("all_to_all_v send elements", send, send_at, ns)?;
        let recv = slice_mut("all_to_all_v recv elements", recv, recv_at, nr)?;
        same_type!(ElemRef, "all_to_all_v (send and recv)"; send, recv =>
            self.comm.all_to_all_v(send, send_counts, recv, recv_counts)?);
        Ok(())
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
