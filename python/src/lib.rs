//! # flatpeak-py — flatpeak for PyTorch
//!
//! The extension module `flatpeak._flatpeak` behind the `flatpeak` Python package
//! (`flatpeak.torch.linear_cross_entropy`, `flatpeak.torch.StreamAdamW`). It reads torch
//! tensors in place — each checked for device, dtype, shape, contiguity and alignment
//! (`tensor.rs`), a wrong one a `TypeError`/`ValueError` naming the argument — and runs
//! ring-dtp and stream-adamw on their storage with the GIL released. The autograd wiring
//! (`torch.library.custom_op`) and the optimizer live in Python (`flatpeak/torch/`).
//!
//! Built by maturin (`pip install ./python`); its tests are `python/tests` (pytest).

mod adamw;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_adamw;
#[cfg(feature = "cuda")]
mod cuda_group;
#[cfg(feature = "cuda")]
mod cuda_moe;
#[cfg(feature = "cuda")]
mod cuda_ring;
mod error;
mod loss;
mod moe;
mod moe_call;
mod offload;
mod ring_loss;
mod tensor;
mod torch_group;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _flatpeak(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<loss::LossOptions>()?;
    m.add_function(wrap_pyfunction!(loss::lce_forward, m)?)?;
    m.add_function(wrap_pyfunction!(loss::lce_backward, m)?)?;
    m.add_function(wrap_pyfunction!(loss::lce_forward_backward, m)?)?;
    m.add_function(wrap_pyfunction!(loss::cached_loss_executors, m)?)?;
    m.add_function(wrap_pyfunction!(loss::clear_loss_executors, m)?)?;
    m.add_function(wrap_pyfunction!(ring_loss::lce_ring_forward, m)?)?;
    m.add_function(wrap_pyfunction!(ring_loss::lce_ring_backward, m)?)?;
    m.add("DEFAULT_BUDGET_BYTES", loss::DEFAULT_BUDGET_BYTES)?;
    m.add_class::<moe::MoEOptions>()?;
    m.add_function(wrap_pyfunction!(moe::moe_forward, m)?)?;
    m.add_function(wrap_pyfunction!(moe::moe_backward, m)?)?;
    m.add_function(wrap_pyfunction!(moe::moe_saved_bytes, m)?)?;
    m.add_class::<offload::PySlotRing>()?;
    m.add_class::<adamw::AdamWOptions>()?;
    m.add_class::<adamw::Decision>()?;
    m.add_function(wrap_pyfunction!(adamw::adamw_step, m)?)?;
    m.add_function(wrap_pyfunction!(adamw::grad_sq_sum_all, m)?)?;
    #[cfg(feature = "cuda")]
    {
        m.add_function(wrap_pyfunction!(cuda::lce_forward_cuda, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::lce_backward_cuda, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::lce_forward_backward_cuda, m)?)?;
        m.add_class::<cuda_adamw::CudaAdamW>()?;
        m.add_function(wrap_pyfunction!(cuda_moe::moe_forward_cuda, m)?)?;
        m.add_function(wrap_pyfunction!(cuda_moe::moe_backward_cuda, m)?)?;
        m.add_function(wrap_pyfunction!(cuda_ring::lce_ring_forward_cuda, m)?)?;
        m.add_function(wrap_pyfunction!(cuda_ring::lce_ring_backward_cuda, m)?)?;
    }
    m.add("CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
