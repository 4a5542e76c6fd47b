//! # flatpeak-py — flatpeak for PyTorch
//!
//! The extension module `flatpeak._flatpeak` behind the `flatpeak` Python package. It is glue:
//! each entry converts its arguments (torch tensors read in place, checked and lent by
//! `tensor.rs` and, on a GPU, `cuda_tensor.rs`: the binding's only `unsafe`), calls one crate
//! entry — ring-dtp's loss and rings, llep's layer, stream-adamw's step, sco's slot ring — and
//! converts the result. The agreement of a multi-rank call, its plan, padding and schedule are
//! the crates'; a `torch.distributed` group is one transport of theirs (`torch_group.rs`). One
//! entry per operation whatever the device; the executors are kept between calls in one bounded
//! cache (`cache.rs`). The autograd wiring (`torch.library.custom_op`) and the optimizer live in
//! Python (`flatpeak/torch/`).
//!
//! Built by maturin (`pip install ./python`); its tests are `python/tests` (pytest).

mod adamw;
mod adamw_args;
#[cfg(feature = "cuda")]
mod adamw_cuda;
mod cache;
#[cfg(feature = "cuda")]
mod cuda_group;
#[cfg(feature = "cuda")]
mod cuda_tensor;
mod error;
mod loss;
mod loss_args;
#[cfg(feature = "cuda")]
mod loss_cuda;
#[cfg(feature = "cuda")]
mod loss_device;
mod moe;
mod moe_args;
#[cfg(feature = "cuda")]
mod moe_cuda;
mod offload;
mod pool;
mod ring_loss;
#[cfg(feature = "cuda")]
mod ring_loss_cuda;
mod tensor;
mod torch_group;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _flatpeak(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<loss_args::LossOptions>()?;
    m.add_function(wrap_pyfunction!(loss::lce_forward, m)?)?;
    m.add_function(wrap_pyfunction!(loss::lce_backward, m)?)?;
    m.add_function(wrap_pyfunction!(loss::lce_forward_backward, m)?)?;
    m.add_function(wrap_pyfunction!(loss::cached_loss_executors, m)?)?;
    m.add_function(wrap_pyfunction!(loss::clear_loss_executors, m)?)?;
    m.add_function(wrap_pyfunction!(ring_loss::lce_ring_forward, m)?)?;
    m.add_function(wrap_pyfunction!(ring_loss::lce_ring_backward, m)?)?;
    m.add_class::<moe_args::MoEOptions>()?;
    m.add_function(wrap_pyfunction!(moe::moe_forward, m)?)?;
    m.add_function(wrap_pyfunction!(moe::moe_backward, m)?)?;
    m.add_function(wrap_pyfunction!(moe::moe_saved_bytes, m)?)?;
    m.add_class::<offload::PySlotRing>()?;
    m.add_class::<adamw_args::AdamWOptions>()?;
    m.add_class::<adamw::Decision>()?;
    m.add_function(wrap_pyfunction!(adamw::adamw_step, m)?)?;
    m.add_function(wrap_pyfunction!(cache::executor_cache_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cache::cached_executors, m)?)?;
    m.add_function(wrap_pyfunction!(cache::clear_executor_cache, m)?)?;
    m.add_function(wrap_pyfunction!(cache::executor_cache_limit, m)?)?;
    m.add_function(wrap_pyfunction!(cache::set_executor_cache_limit, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_class::<adamw_cuda::CudaAdamW>()?;
    m.add("CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
