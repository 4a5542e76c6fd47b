//! A checkpointed stack driver: forward with checkpoints, then backward with recompute, with
//! the boundaries on the device (plain checkpointing), offloaded through a
//! [`CheckpointOffloader`] (SCO), or not checkpointed at all (every layer's internals saved).
//! A framework adopts SCO either through this driver or through the raw offloader.

use flatpeak_common::{Budget, Link};

use crate::error::{Error, Result};
use crate::offloader::CheckpointOffloader;
use crate::plan::{Config, Plan, Shape};

/// One layer of a stack mapping a boundary tensor of `width()` elements to another.
pub trait Layer: Send + Sync {
    /// Elements of the input (and output) boundary tensor.
    fn width(&self) -> usize;
    /// Elements of this layer's parameter gradient.
    fn param_count(&self) -> usize;
    /// `y = f(x)`.
    fn forward(&self, x: &[f32], y: &mut [f32]) -> Result<()>;
    /// `y = f(x)`, also returning the internals backward needs (no checkpointing).
    fn forward_saving(&self, x: &[f32], y: &mut [f32]) -> Result<Vec<f32>>;
    /// Given the layer input `x` and `dy`, writes `dx` and the parameter gradient. With
    /// `saved = None` it recomputes its internals from `x` (checkpointing); it must then produce
    /// bitwise the same result as with the internals `forward_saving` returned.
    fn backward(
        &self,
        x: &[f32],
        saved: Option<&[f32]>,
        dy: &[f32],
        dx: &mut [f32],
        dparams: &mut [f32],
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

/// What one step computed.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// The stack's output.
    pub output: Vec<f32>,
    /// Gradient with respect to the stack's input.
    pub grad_input: Vec<f32>,
    /// Per-layer parameter gradients.
    pub param_grads: Vec<Vec<f32>>,
    /// Most boundary bytes held on the device at once during the step.
    pub boundary_high_water_bytes: usize,
}

/// A stack of layers run with one of the [`Checkpointing`] schedules.
#[derive(Debug)]
pub struct CheckpointedStack<L: Layer> {
    layers: Vec<L>,
    mode: Checkpointing,
    plan: Plan,
    offloader: Option<CheckpointOffloader<f32>>,
    /// Plain checkpointing's L boundary buffers, reserved once like the offloader's ring.
    resident: Vec<Vec<f32>>,
    width: usize,
}

impl<L: Layer> CheckpointedStack<L> {
    /// A stack of `layers` (all of the same width). With [`Checkpointing::Offload`] the ring and
    /// the host arena of the plan are reserved now, once, and reused by every step.
    pub fn new(layers: Vec<L>, mode: Checkpointing, config: &Config, link: Link) -> Result<Self> {
        let width = layers.first().map_or(0, Layer::width);
        for l in &layers {
            if l.width() != width {
                return Err(Error::ShapeMismatch {
                    what: "layer width (all layers alike)",
                    expected: width,
                    got: l.width(),
                });
            }
        }
        let plan = Plan::new(config, Shape::of::<f32>(layers.len(), width), Budget::Unlimited)?;
        let offloader = (mode == Checkpointing::Offload).then(|| CheckpointOffloader::new(plan, link));
        let resident =
            if mode == Checkpointing::Offload { Vec::new() } else { vec![vec![0f32; width]; layers.len()] };
        Ok(Self { layers, mode, plan, offloader, resident, width })
    }

    /// The SCO plan (the same sizes whatever the mode).
    pub fn plan(&self) -> Plan {
        self.plan
    }

    /// The layers.
    pub fn layers(&self) -> &[L] {
        &self.layers
    }

    /// Forward over every layer, `loss_grad(output)` for the upstream gradient, then backward.
    pub fn step(&mut self, input: &[f32], loss_grad: impl FnOnce(&[f32]) -> Vec<f32>) -> Result<StepOutput> {
        let w = self.width;
        if input.len() != w {
            return Err(Error::ShapeMismatch { what: "stack input (width)", expected: w, got: input.len() });
        }
        match self.mode {
            Checkpointing::Off | Checkpointing::OnDevice => self.step_resident(input, loss_grad),
            Checkpointing::Offload => self.step_offload(input, loss_grad),
        }
    }

    fn step_resident(
        &mut self,
        input: &[f32],
        loss_grad: impl FnOnce(&[f32]) -> Vec<f32>,
    ) -> Result<StepOutput> {
        let (w, n) = (self.width, self.layers.len());
        let save = self.mode == Checkpointing::Off;
        let mut saved: Vec<Vec<f32>> = Vec::with_capacity(n);
        let boundaries = &mut self.resident;
        boundaries[0].copy_from_slice(input);
        let mut x = vec![0f32; w];
        for (i, layer) in self.layers.iter().enumerate() {
            let (done, rest) = boundaries.split_at_mut(i + 1);
            let y = rest.first_mut().map_or(&mut x, |next| next);
            if save {
                saved.push(layer.forward_saving(&done[i], y)?);
            } else {
                layer.forward(&done[i], y)?;
            }
        }
        let output = x;
        let mut dy = loss_grad(&output);
        check_grad(&dy, w)?;
        let mut param_grads = vec![Vec::new(); n];
        for i in (0..n).rev() {
            let mut dx = vec![0f32; w];
            let mut dp = vec![0f32; self.layers[i].param_count()];
            let internals = saved.get(i).map(Vec::as_slice);
            self.layers[i].backward(&boundaries[i], internals, &dy, &mut dx, &mut dp)?;
            param_grads[i] = dp;
            dy = dx;
        }
        let boundary_high_water_bytes = n * w * std::mem::size_of::<f32>();
        Ok(StepOutput { output, grad_input: dy, param_grads, boundary_high_water_bytes })
    }

    fn step_offload(
        &mut self,
        input: &[f32],
        loss_grad: impl FnOnce(&[f32]) -> Vec<f32>,
    ) -> Result<StepOutput> {
        let (w, n) = (self.width, self.layers.len());
        let Some(off) = self.offloader.as_mut() else {
            return Err(Error::invalid_config("offloader", "none", "present in Offload mode"));
        };
        let d = off.plan().config().prefetch_distance;
        off.offload_copy(0, input)?;
        let mut output = vec![0f32; w];
        for i in 0..n {
            let x = off.fetch(i)?;
            if i + 1 < n {
                let mut y = off.writer()?;
                self.layers[i].forward(&x, &mut y)?;
                drop(x);
                off.offload(i + 1, y)?;
            } else {
                self.layers[i].forward(&x, &mut output)?;
            }
        }
        let mut dy = loss_grad(&output);
        check_grad(&dy, w)?;
        let mut param_grads = vec![Vec::new(); n];
        for i in (0..n).rev() {
            if i >= d && d > 0 {
                off.prefetch(i - d)?; // H2D of x_{i−d} overlaps layer i's recompute and backward
            }
            let x = off.fetch(i)?;
            let mut dx = vec![0f32; w];
            let mut dp = vec![0f32; self.layers[i].param_count()];
            self.layers[i].backward(&x, None, &dy, &mut dx, &mut dp)?;
            drop(x);
            off.release(i)?;
            param_grads[i] = dp;
            dy = dx;
        }
        off.finish_step()?;
        let boundary_high_water_bytes = off.high_water_bytes();
        Ok(StepOutput { output, grad_input: dy, param_grads, boundary_high_water_bytes })
    }
}

fn check_grad(dy: &[f32], width: usize) -> Result<()> {
    if dy.len() == width {
        Ok(())
    } else {
        Err(Error::ShapeMismatch { what: "loss gradient (width)", expected: width, got: dy.len() })
    }
}
