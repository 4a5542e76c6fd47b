"""Type stubs of the ``flatpeak._flatpeak`` extension (``python/src``): the glue the Python
package calls. Tensors are ``torch.Tensor``; an ``Optional`` tensor is one the call may go
without."""

from typing import Any, List, Optional, Sequence, Tuple, final

from torch import Tensor
from typing_extensions import Self

__all__ = [
    "LossOptions",
    "lce_forward",
    "lce_backward",
    "lce_forward_backward",
    "cached_loss_executors",
    "clear_loss_executors",
    "lce_ring_forward",
    "lce_ring_backward",
    "MoEOptions",
    "moe_forward",
    "moe_backward",
    "moe_saved_bytes",
    "SlotRing",
    "AdamWOptions",
    "StepDecision",
    "adamw_step",
    "executor_cache_bytes",
    "cached_executors",
    "clear_executor_cache",
    "executor_cache_limit",
    "set_executor_cache_limit",
    "CUDA",
]

#: Whether this build carries the CUDA path (the ``cuda`` cargo feature).
CUDA: bool

# -- linear cross-entropy ------------------------------------------------------------------------

@final
class LossOptions:
    """The loss's options, checked once."""

    def __new__(
        cls,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        budget_bytes: Optional[int] = None,
        precision: str = "native",
    ) -> Self: ...
    def workspace_bytes(self, tokens: int, hidden: int, vocab: int, bf16: bool) -> int:
        """Bytes of the working set the plan reserves for this shape on a CPU."""
    def cuda_workspace_bytes(self, tokens: int, hidden: int, vocab: int, bf16: bool) -> int:
        """Bytes of the CUDA workspace tensor of this shape (the ``cuda`` build only)."""

#: ``(input, weight, target, bias, token_weights)``.
_LossArgs = Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]
#: ``(dx, dw, dbias)``, each ``None`` when not wanted.
_GradArgs = Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]

def lce_forward(options: LossOptions, args: _LossArgs, outputs: Tuple[Tensor, Tensor]) -> None: ...
def lce_backward(
    options: LossOptions,
    args: _LossArgs,
    lse: Tensor,
    upstream: Tuple[Tensor, Optional[Tensor]],
    grads_out: _GradArgs,
) -> None: ...
def lce_forward_backward(
    options: LossOptions, args: _LossArgs, outputs: Tuple[Tensor, Tensor], grads_out: _GradArgs
) -> None: ...
def cached_loss_executors() -> int: ...
def clear_loss_executors() -> None: ...
def lce_ring_forward(
    options: LossOptions, group: object, ring: Optional[str], args: _LossArgs, outputs: Tuple[Tensor, Tensor]
) -> None: ...
def lce_ring_backward(
    options: LossOptions,
    group: object,
    ring: Optional[str],
    args: _LossArgs,
    lse: Tensor,
    upstream: Tuple[Tensor, Optional[Tensor]],
    grads_out: _GradArgs,
) -> None: ...

# -- MoE experts ---------------------------------------------------------------------------------

@final
class MoEOptions:
    """The MoE layer's options, checked once."""

    def __new__(
        cls,
        *,
        scheme: str = "pipelined",
        pair_cap_rows: Optional[int] = None,
        budget_bytes: Optional[int] = None,
        max_tokens_factor: Optional[float] = None,
        min_tokens_per_gemm: Optional[int] = None,
        imbalance_threshold: Optional[float] = None,
        activations: str = "recompute",
    ) -> Self: ...

#: ``(hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj)``.
_MoEArgs = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
#: ``(rounds, recv_high_water_rows, recv_high_water_bytes, workspace_bytes, saved_bytes,
#: device_bytes)``.
_ForwardStats = Tuple[int, int, int, int, int, int]

def moe_forward(
    options: MoEOptions,
    group: Optional[object],
    args: _MoEArgs,
    num_experts: Optional[int],
    outputs: Tuple[Tensor, Tensor, Optional[Tensor]],
) -> _ForwardStats: ...
def moe_backward(
    options: MoEOptions,
    group: Optional[object],
    args: _MoEArgs,
    num_experts: Optional[int],
    upstream: Tuple[Tensor, Optional[Tensor]],
    grads_out: Tuple[Tensor, Tensor, Tensor, Tensor],
) -> None: ...
def moe_saved_bytes(
    options: MoEOptions, group: Optional[object], args: _MoEArgs, num_experts: Optional[int]
) -> int: ...

# -- checkpoint offload --------------------------------------------------------------------------

@final
class SlotRing:
    """sco's slot accounting of one checkpointed sequence."""

    def __new__(
        cls,
        layers: int,
        boundary_bytes: int,
        *,
        keep_resident: int = 1,
        in_flight: int = 2,
        prefetch_distance: int = 1,
    ) -> Self: ...
    def slots(self) -> int: ...
    def workspace_bytes(self) -> int: ...
    def layers(self) -> int: ...
    def reserve(self) -> Tuple[str, int]: ...
    def cancel(self, slot: int) -> None: ...
    def offload(self, layer: int, slot: int) -> int: ...
    def d2h_landed(self, layer: int) -> None: ...
    def want(self, layer: int) -> bool: ...
    def start_h2d(self, layer: int, slot: int) -> Optional[int]: ...
    def h2d_landed(self, layer: int) -> None: ...
    def lend(self, layer: int) -> Tuple[str, int]: ...
    def resident(self, layer: int) -> Tuple[str, int]: ...
    def unlend(self, layer: int) -> None: ...
    def release(self, layer: int) -> None: ...
    def copies_in_flight(self) -> bool: ...
    def finish_step(self) -> None: ...
    def slot_holders(self) -> List[Optional[int]]: ...
    def slots_in_use(self) -> int: ...
    def high_water_slots(self) -> int: ...

# -- AdamW ---------------------------------------------------------------------------------------

@final
class AdamWOptions:
    """One param group's hyperparameters, checked."""

    def __new__(
        cls,
        *,
        lr: float,
        betas: Tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        maximize: bool,
        max_norm: Optional[float] = None,
    ) -> Self: ...

@final
class StepDecision:
    """What one step did."""

    @property
    def skipped(self) -> bool: ...
    @property
    def grad_norm(self) -> float: ...
    @property
    def clip_coef(self) -> float: ...
    @property
    def statistics_seconds(self) -> float: ...
    @property
    def update_seconds(self) -> float: ...

#: ``(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, bf16_param)``.
_ParamState = Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Tensor, Optional[Tensor]]

def adamw_step(
    groups: Sequence[Tuple[AdamWOptions, Sequence[_ParamState], int]],
    offloaded: Sequence[Tuple["CudaAdamW", Tensor, Tensor, AdamWOptions, int]] = ...,
    *,
    group: Optional[Any] = None,
    on_nonfinite: str = "skip",
    threads: Optional[int] = None,
    refused: Optional[BaseException] = None,
) -> StepDecision: ...

@final
class CudaAdamW:
    """The offloaded optimizer of one CUDA parameter (the ``cuda`` build only)."""

    def __new__(cls, param: Tensor, master: Tensor, options: AdamWOptions, bucket_elems: int) -> Self: ...
    def export_into(
        self, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Optional[Tensor] = None
    ) -> int: ...
    def import_from(
        self, step: int, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Optional[Tensor] = None
    ) -> None: ...

# -- the executor cache --------------------------------------------------------------------------

def executor_cache_bytes() -> int: ...
def cached_executors() -> int: ...
def clear_executor_cache() -> None: ...
def executor_cache_limit() -> int: ...
def set_executor_cache_limit(limit_bytes: int) -> None: ...
