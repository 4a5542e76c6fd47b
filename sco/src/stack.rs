//! A checkpointed stack driver: forward with checkpoints, then backward with recompute, with
//! the boundaries on the device (plain checkpointing), offloaded through any
//! [`CheckpointStore`] (SCO), or not checkpointed at all (every layer's internals saved).
//! A framework adopts SCO either through this driver or through an offloader's raw API.
//!
//! Device memory for boundaries: `plan.workspace_bytes()` (the store's ring, `slots·s`) with
//! [`Checkpointing::Offload`], `L·s` with the other two; [`StepOutput::boundary_high_water_bytes`]
//! reports what a step held.

use flatpeak_common::{Budget, Link};

use crate::error::{Error, Result};
use crate::offloader::CheckpointOffloader;
use crate::plan::{Config, Plan, Shape};
use crate::store::{CheckpointStore, Host, Owned, TensorMut, TensorRef, Tensors, check_len};

/// One layer of a stack mapping a boundary tensor of `width()` elements to another, computing
/// on the tensors of family `F` (host `f32` slices by default; a CUDA layer implements
/// `Layer<sco::cuda::CudaTensors<T>>`).
pub trait Layer<F: Tensors = Host>: Send + Sync {
    /// Elements of the input (and output) boundary tensor.
    fn width(&self) -> usize;
    /// Elements of this layer's parameter gradient.
    fn param_count(&self) -> usize;
    /// `y = f(x)`.
    fn forward(&self, x: TensorRef<'_, F>, y: TensorMut<'_, F>) -> Result<()>;
    /// `y = f(x)`, also returning the internals backward needs (no checkpointing).
    fn forward_saving(&self, x: TensorRef<'_, F>, y: TensorMut<'_, F>) -> Result<Owned<F>>;
    /// Given the layer input `x` and `dy`, writes `dx` and the parameter gradient. With
    /// `saved = None` it recomputes its internals from `x` (checkpointing); it must then produce
    /// bitwise the same result as with the internals `forward_saving` returned.
    fn backward(
        &self,
        x: TensorRef<'_, F>,
        saved: Option<TensorRef<'_, F>>,
        dy: TensorRef<'_, F>,
        dx: TensorMut<'_, F>,
        dparams: TensorMut<'_, F>,
    ) -> Result<()>;
}

/// Where the boundaries live between forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checkpointing {
    /// No checkpointing: every layer's internals are saved; no recompute.
    Off,
    /// Plain checkpointing: all L boundaries stay on the device; backward recomputes.
    OnDevice,
    /// Selective checkpoint offload: boundaries in the host arena, a fixed device ring.
    #[default]
    Offload,
}

/// What one step computed, as tensors `O` of the stack's family (`Vec<f32>` on the host).
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput<O = Vec<f32>> {
    /// The stack's output.
    pub output: O,
    /// Gradient with respect to the stack's input.
    pub grad_input: O,
    /// Per-layer parameter gradients.
    pub param_grads: Vec<O>,
    /// Most boundary bytes held on the device at once during the step.
    pub boundary_high_water_bytes: usize,
}

/// A stack of layers run with one of the [`Checkpointing`] schedules, offloading through a
/// store `S` (the CPU offloader by default).
#[derive(Debug)]
pub struct CheckpointedStack<L, S: CheckpointStore = CheckpointOffloader<f32>> {
    layers: Vec<L>,
    mode: Checkpointing,
    plan: Plan,
    tensors: S::Tensors,
    offloader: Option<S>,
    /// Plain checkpointing's L boundary buffers, reserved once like the offloader's ring.
    resident: Vec<Owned<S::Tensors>>,
    width: usize,
}

/// The common width of `layers`; [`Error::ShapeMismatch`] when they differ.
fn common_width<F: Tensors, L: Layer<F>>(layers: &[L]) -> Result<usize> {
    let width = layers.first().map_or(0, Layer::width);
    for l in layers {
        check_len("layer width (all layers alike)", width, l.width())?;
    }
    Ok(width)
}

impl<L: Layer> CheckpointedStack<L> {
    /// A stack of `layers` (all of the same width) on the CPU fallback. With
    /// [`Checkpointing::Offload`] the ring and the host arena of the plan are reserved now, once,
    /// and reused by every step; `link` sets the copy engines' speed.
    pub fn new(layers: Vec<L>, mode: Checkpointing, config: &Config, link: Link) -> Result<Self> {
        let width = common_width(&layers)?;
        link.validate()?;
        let plan = Plan::new(config, Shape::of::<f32>(layers.len(), width), Budget::Unlimited)?;
        let offloader =
            (mode == Checkpointing::Offload).then(|| CheckpointOffloader::new(plan, link)).transpose()?;
        let resident = match mode {
            Checkpointing::Offload => Vec::new(),
            _ => vec![vec![0f32; width]; layers.len()],
        };
        Ok(Self { layers, mode, plan, tensors: Host::new(), offloader, resident, width })
    }
}

impl<L: Layer<S::Tensors>, S: CheckpointStore> CheckpointedStack<L, S> {
    /// A stack of `layers` offloading through `store` ([`Checkpointing::Offload`]) on the
    /// store's device, e.g. a `cuda::CudaCheckpointOffloader` with layers on device views. The
    /// store's plan must be for these layers: its depth, width and element size
    /// ([`Error::ShapeMismatch`] otherwise).
    pub fn with_store(layers: Vec<L>, store: S) -> Result<Self> {
        let width = common_width(&layers)?;
        let plan = *store.plan();
        check_len("stack depth (the store's plan)", plan.layers(), layers.len())?;
        check_len("layer width (the store's boundary elements)", plan.boundary_elems(), width)?;
        let elem = std::mem::size_of::<<S::Tensors as Tensors>::Elem>();
        check_len("element bytes (the store's plan)", plan.shape().element_bytes, elem)?;
        let tensors = store.tensors();
        let mode = Checkpointing::Offload;
        Ok(Self { layers, mode, plan, tensors, offloader: Some(store), resident: Vec::new(), width })
    }

    /// The SCO plan (the same sizes whatever the mode).
    pub fn plan(&self) -> Plan {
        self.plan
    }

    /// The layers.
    pub fn layers(&self) -> &[L] {
        &self.layers
    }

    /// The store boundaries are offloaded through (`None` unless [`Checkpointing::Offload`]).
    pub fn store(&self) -> Option<&S> {
        self.offloader.as_ref()
    }

    /// Forward over every layer, `loss_grad(output)` for the upstream gradient (on the stack's
    /// device; its error ends the step), then backward.
    pub fn step(
        &mut self,
        input: TensorRef<'_, S::Tensors>,
        loss_grad: impl FnOnce(TensorRef<'_, S::Tensors>) -> Result<Owned<S::Tensors>>,
    ) -> Result<StepOutput<Owned<S::Tensors>>> {
        check_len("stack input (width)", self.width, S::Tensors::len(&input))?;
        match self.mode {
            Checkpointing::Off | Checkpointing::OnDevice => self.step_resident(input, loss_grad),
            Checkpointing::Offload => {
                let result = self.step_offload(input, loss_grad);
                if result.is_err()
                    && let Some(off) = self.offloader.as_mut()
                {
                    // Leave the store ready for the next step; the step's own error is the one
                    // to report.
                    let _ = off.finish_step();
                }
                result
            }
        }
    }

    fn step_resident(
        &mut self,
        input: TensorRef<'_, S::Tensors>,
        loss_grad: impl FnOnce(TensorRef<'_, S::Tensors>) -> Result<Owned<S::Tensors>>,
    ) -> Result<StepOutput<Owned<S::Tensors>>> {
        let (w, n, t) = (self.width, self.layers.len(), &self.tensors);
        let save = self.mode == Checkpointing::Off;
        let mut saved = Vec::with_capacity(if save { n } else { 0 });
        let boundaries = &mut self.resident;
        let first = boundaries.first_mut().ok_or(Error::invalid_config("layers", n, "at least 1"))?;
        t.copy(input, S::Tensors::view_mut(first))?;
        let mut output = t.zeros(w)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (done, rest) = boundaries.split_at_mut(i + 1);
            let y = S::Tensors::view_mut(rest.first_mut().unwrap_or(&mut output));
            let x = S::Tensors::view(&done[i]);
            if save {
                saved.push(layer.forward_saving(x, y)?);
            } else {
                layer.forward(x, y)?;
            }
        }
        let mut dy = loss_grad(S::Tensors::view(&output))?;
        check_grad::<S::Tensors>(&dy, w)?;
        let mut param_grads = Vec::with_capacity(n);
        for (i, layer) in self.layers.iter().enumerate().rev() {
            let (mut dx, mut dp) = (t.zeros(w)?, t.zeros(layer.param_count())?);
            let internals = saved.get(i).map(S::Tensors::view);
            let x = S::Tensors::view(&boundaries[i]);
            let (dy_view, dx_view) = (S::Tensors::view(&dy), S::Tensors::view_mut(&mut dx));
            layer.backward(x, internals, dy_view, dx_view, S::Tensors::view_mut(&mut dp))?;
            param_grads.push(dp);
            dy = dx;
        }
        param_grads.reverse();
        let boundary_high_water_bytes = n * self.plan.boundary_bytes();
        Ok(StepOutput { output, grad_input: dy, param_grads, boundary_high_water_bytes })
    }

    fn step_offload(
        &mut self,
        input: TensorRef<'_, S::Tensors>,
        loss_grad: impl FnOnce(TensorRef<'_, S::Tensors>) -> Result<Owned<S::Tensors>>,
    ) -> Result<StepOutput<Owned<S::Tensors>>> {
        let Some(off) = self.offloader.as_mut() else {
            return Err(Error::internal("a stack in Offload mode holds its offloader"));
        };
        let (w, n, t) = (self.width, self.layers.len(), &self.tensors);
        let d = off.plan().config().prefetch_distance;
        off.offload_from(0, input)?;
        let mut output = t.zeros(w)?;
        for (i, layer) in self.layers.iter().enumerate() {
            if i + 1 < n {
                off.forward_into(i, |x, y| layer.forward(x, y))?;
            } else {
                off.fetch_with(i, |x| layer.forward(x, S::Tensors::view_mut(&mut output)))?;
            }
        }
        let mut dy = loss_grad(S::Tensors::view(&output))?;
        check_grad::<S::Tensors>(&dy, w)?;
        let mut param_grads = Vec::with_capacity(n);
        for (i, layer) in self.layers.iter().enumerate().rev() {
            if i >= d && d > 0 {
                off.prefetch(i - d)?; // H2D of x_{i−d} overlaps layer i's recompute and backward
            }
            let (mut dx, mut dp) = (t.zeros(w)?, t.zeros(layer.param_count())?);
            off.fetch_with(i, |x| {
                let (dy_view, dx_view) = (S::Tensors::view(&dy), S::Tensors::view_mut(&mut dx));
                layer.backward(x, None, dy_view, dx_view, S::Tensors::view_mut(&mut dp))
            })?;
            off.release(i)?;
            param_grads.push(dp);
            dy = dx;
        }
        param_grads.reverse();
        off.finish_step()?;
        let boundary_high_water_bytes = off.high_water_bytes();
        Ok(StepOutput { output, grad_input: dy, param_grads, boundary_high_water_bytes })
    }
}

fn check_grad<F: Tensors>(dy: &F::Owned, width: usize) -> Result<()> {
    check_len("loss gradient (width)", width, F::len(&F::view(dy)))
}
