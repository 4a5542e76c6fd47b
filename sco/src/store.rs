//! What a [`CheckpointedStack`](crate::CheckpointedStack) drives: a [`CheckpointStore`] (the
//! offloaders implement it: [`CheckpointOffloader`](crate::CheckpointOffloader) on the CPU
//! fallback, `cuda::CudaCheckpointOffloader` with the `cuda` feature) and the [`Tensors`] its
//! layers compute on (host slices, [`Host`]; device views, `cuda::CudaTensors`).
//!
//! The store lends its boundaries only for the length of a closure, so the trait holds for
//! either backend's borrows (a host lock guard, a device view of a ring slot) without `unsafe`
//! and without a boundary outliving the call that lent it.

use std::fmt;
use std::marker::PhantomData;

use bytemuck::Pod;

use crate::error::{Error, Result};
use crate::plan::Plan;

/// A family of tensors on one device, as layers see them: a read view, a write view and an
/// owned tensor of one element type, and how to make and copy them. A value of the family is
/// what allocates (a stream on a GPU; nothing on the host).
pub trait Tensors: Clone + fmt::Debug {
    /// Element type.
    type Elem: 'static;
    /// A tensor read by a layer (`&[T]` on the host).
    type Ref<'a>;
    /// A tensor written by a layer (`&mut [T]` on the host).
    type Mut<'a>;
    /// A tensor the stack owns for a step: its output and gradients (`Vec<T>` on the host).
    type Owned: fmt::Debug;

    /// `len` zeros.
    fn zeros(&self, len: usize) -> Result<Self::Owned>;
    /// `dst ← src`; [`Error::ShapeMismatch`] unless the lengths agree.
    fn copy(&self, src: Self::Ref<'_>, dst: Self::Mut<'_>) -> Result<()>;
    /// A read view of `t`.
    fn view(t: &Self::Owned) -> Self::Ref<'_>;
    /// A write view of `t`.
    fn view_mut(t: &mut Self::Owned) -> Self::Mut<'_>;
    /// Elements of `t`.
    fn len(t: &Self::Ref<'_>) -> usize;
}

/// A read view in family `F`.
pub type TensorRef<'a, F> = <F as Tensors>::Ref<'a>;
/// A write view in family `F`.
pub type TensorMut<'a, F> = <F as Tensors>::Mut<'a>;
/// An owned tensor in family `F`.
pub type Owned<F> = <F as Tensors>::Owned;

/// Host tensors of `T`: `&[T]`, `&mut [T]`, `Vec<T>`.
pub struct Host<T = f32>(PhantomData<fn() -> T>);

impl<T> Host<T> {
    /// The host family.
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}
impl<T> Default for Host<T> {
    fn default() -> Self {
        Self::new()
    }
}
impl<T> Clone for Host<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Host<T> {}
impl<T> fmt::Debug for Host<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Host<{}>", std::any::type_name::<T>())
    }
}

impl<T: Pod + fmt::Debug> Tensors for Host<T> {
    type Elem = T;
    type Ref<'a> = &'a [T];
    type Mut<'a> = &'a mut [T];
    type Owned = Vec<T>;

    fn zeros(&self, len: usize) -> Result<Vec<T>> {
        Ok(vec![T::zeroed(); len])
    }
    fn copy(&self, src: &[T], dst: &mut [T]) -> Result<()> {
        check_len("tensor copy (elements)", dst.len(), src.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }
    fn view(t: &Vec<T>) -> &[T] {
        t
    }
    fn view_mut(t: &mut Vec<T>) -> &mut [T] {
        t
    }
    fn len(t: &&[T]) -> usize {
        t.len()
    }
}

/// [`Error::ShapeMismatch`] unless `got == expected`.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if got == expected { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got }) }
}

/// Checkpoint boundaries offloaded through a fixed device ring: what a
/// [`CheckpointedStack`](crate::CheckpointedStack) needs from an offloader, on any backend.
///
/// Memory bound: an implementor holds at most `plan().slots()` boundaries on the device
/// (`plan().workspace_bytes()` bytes, independent of depth) and `plan().host_arena_bytes()` of
/// host memory, both reserved when it is built. Each step offloads each layer's boundary once,
/// brings them back in any order, and ends with [`finish_step`](Self::finish_step).
///
/// Boundaries are lent to closures: a boundary is read (and a fresh slot written) only inside
/// the call that lends it. Misuse is a typed error: a layer past the plan
/// ([`Error::LayerOutOfRange`]), offloaded twice ([`Error::AlreadyOffloaded`]), fetched or
/// released without being offloaded ([`Error::NotOffloaded`]), or more boundaries held than the
/// ring has slots ([`Error::RingFull`]).
pub trait CheckpointStore {
    /// The tensors the boundaries are lent as.
    type Tensors: Tensors;

    /// The plan the ring and the arena were reserved for.
    fn plan(&self) -> &Plan;
    /// The family of this store's device, to allocate step tensors beside its ring.
    fn tensors(&self) -> Self::Tensors;
    /// Copies `tensor` into a free slot and offloads it as `layer`'s boundary.
    fn offload_from(&mut self, layer: usize, tensor: TensorRef<'_, Self::Tensors>) -> Result<()>;
    /// One layer's forward under checkpointing: runs `f(x, y)` with `x` boundary `layer` (brought
    /// back if needed) and `y` a free slot, then offloads `y` as boundary `layer + 1`. When `f`
    /// fails, the slot is given back and nothing is offloaded.
    fn forward_into<R>(
        &mut self,
        layer: usize,
        f: impl FnOnce(TensorRef<'_, Self::Tensors>, TensorMut<'_, Self::Tensors>) -> Result<R>,
    ) -> Result<R>;
    /// Starts bringing `layer`'s boundary back to the device (a no-op when it is resident); it
    /// then stays there until [`release`](Self::release) (one of the k_keep newest: until then,
    /// or until newer boundaries displace it).
    fn prefetch(&mut self, layer: usize) -> Result<()>;
    /// Runs `f` on `layer`'s boundary on the device, once its copy landed.
    fn fetch_with<R>(
        &mut self,
        layer: usize,
        f: impl FnOnce(TensorRef<'_, Self::Tensors>) -> Result<R>,
    ) -> Result<R>;
    /// Backward is done with `layer`'s boundary: its slot may be reused.
    fn release(&mut self, layer: usize) -> Result<()>;
    /// Waits for every copy in flight and forgets this step's boundaries (the ring and the arena
    /// stay reserved).
    fn finish_step(&mut self) -> Result<()>;
    /// Device bytes of the most slots ever held at once; at most `plan().workspace_bytes()`.
    fn high_water_bytes(&self) -> usize;
}
