"""Worker processes of the FSDP2 ``flatpeak.transformers`` test (``test_fsdp.py``): a tiny
Qwen3-MoE patched by ``apply`` and wrapped by FSDP2 (each decoder layer a unit, ``lm_head`` its
own unit, the root), against the same model unpatched under the same wrapping, on 4 gloo ranks.
Each rank's loss is its summed loss divided by the global number of labels (``num_items_in_batch``)
and FSDP's division is off, so the reduced gradients are the global mean's."""

from __future__ import annotations

import _hf_models as hf
from _moe_workers import _init
from _spawn import reporting


def _wrap(torch, model, dense, efsdp=None):
    """FSDP2 as torchtitan wraps a decoder: the experts on ``efsdp`` (when expert-parallel), each
    decoder layer, ``lm_head`` alone, then the root; no division, plain sums (gloo)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if efsdp is not None:
        for layer in model.model.layers:
            fully_shard(layer.mlp.experts, mesh=efsdp)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dense)
    fully_shard(model.lm_head, mesh=dense)
    fully_shard(model, mesh=dense)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)


@reporting
def patched_under_fsdp2(rank: int, world: int, init_file: str):
    """Test 8: the loss through a separately sharded ``lm_head``, ``offload_checkpoints`` and
    ``apply(ep_mesh=)`` under FSDP2 equal the unpatched FSDP2 model (loss and every gradient);
    ``apply`` on a wrapped model is refused."""
    torch, dist = _init(rank, world, init_file)
    from torch.distributed.device_mesh import init_device_mesh

    import flatpeak.transformers as fpt

    dense = init_device_mesh("cpu", (world,))
    sparse = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    batches = [hf.batch(70 + r) for r in range(world)]
    items = sum(int((lab[:, 1:] != -100).sum()) for _, lab in batches)
    ids, labels = batches[rank]
    out = {}
    for case in ("loss", "offload", "ep"):
        runs = {}
        for patched in (False, True):
            model = hf.tiny_model("qwen3_moe", seed=5)
            efsdp = None
            if patched:
                fpt.apply(model, offload_checkpoints=case == "offload",
                          ep_mesh=sparse["ep"] if case == "ep" else None)
                efsdp = sparse["efsdp"] if case == "ep" else None
            _wrap(torch, model, dense, efsdp)
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False).loss
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            runs[patched] = (float(total), grads)
        (ref_loss, ref), (loss, got) = runs[False], runs[True]
        assert sorted(got) == sorted(ref), (case, sorted(set(got) ^ set(ref)))
        out[case] = dict(loss=abs(loss - ref_loss) / abs(ref_loss),
                         grads=max(hf.rel(got[n], ref[n]) for n in ref))
    # apply after wrapping is refused.
    wrapped = hf.tiny_model("qwen3_moe", seed=5)
    _wrap(torch, wrapped, dense)
    try:
        fpt.apply(wrapped)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out
