"""``flatpeak.transformers.apply`` on real transformers model code: the patched model's loss and
every gradient equal the unpatched model's (f32: loss 1e-5, gradients 1e-4), with ignored labels,
``num_items_in_batch`` and the router's auxiliary loss; 10 optimizer steps give the same loss curve;
no ``[batch, seq, vocab]`` tensor is made; ``generate`` gives the same tokens; expert-parallel over
2 and 4 gloo processes matches the unpatched model's per-rank losses and gradients."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
import _hf_models as hf  # noqa: E402
import _hf_workers as hf_workers  # noqa: E402
from _spawn import spawn  # noqa: E402

import flatpeak.transformers as fpt  # noqa: E402

MODEL_TYPES = list(fpt.SUPPORTED_MODEL_TYPES)


def grads_match(ref, patched, bound=1e-4):
    bad = {}
    for (name, p), (_, q) in zip(ref.named_parameters(), patched.named_parameters()):
        if p.grad is None and q.grad is None:
            continue
        err = hf.rel(q.grad, p.grad) if p.grad.norm() > 0 else float(q.grad.abs().max())
        if err > bound:
            bad[name] = err
    return bad


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("items", [None, 37])
def test_loss_and_every_gradient_equal_the_unpatched_model(model_type, items):
    ref = hf.tiny_model(model_type)
    patched = fpt.apply(copy.deepcopy(ref))
    ids, labels = hf.batch(1)
    kwargs = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    a = ref(input_ids=ids, labels=labels, **kwargs)
    b = patched(input_ids=ids, labels=labels, **kwargs)
    assert b.logits is None
    assert hf.rel(b.loss, a.loss) <= 1e-5, (a.loss, b.loss)
    a.loss.backward()
    b.loss.backward()
    assert not grads_match(ref, patched)


@pytest.mark.parametrize(("model_type", "offload_checkpoints"),
                         [(m, False) for m in MODEL_TYPES] + [("qwen3_moe", True)])
def test_saved_expert_activations_give_the_unpatched_gradients(model_type, offload_checkpoints):
    """expert_activations="save": the experts keep their rows and pre-activations (a tensor saved
    for backward, which offloaded checkpoints drop and recompute with the rest) for a backward
    without recompute."""
    ref = hf.tiny_model(model_type)
    patched = fpt.apply(copy.deepcopy(ref), expert_activations="save", offload_checkpoints=offload_checkpoints)
    ref.train()
    patched.train()
    ids, labels = hf.batch(2)
    a = ref(input_ids=ids, labels=labels, use_cache=False)
    b = patched(input_ids=ids, labels=labels, use_cache=False)
    assert hf.rel(b.loss, a.loss) <= 1e-5, (a.loss, b.loss)
    kept = [m.flatpeak_stats.saved_bytes for m in patched.modules() if hasattr(m, "flatpeak_stats")]
    assert kept and all(k > 0 for k in kept), kept
    a.loss.backward()
    b.loss.backward()
    assert not grads_match(ref, patched)


def test_shift_labels_are_honoured_when_passed():
    ref = hf.tiny_model("qwen3_moe")
    patched = fpt.apply(copy.deepcopy(ref))
    ids, labels = hf.batch(8)
    # Labels already shifted by the caller (as packed-sequence pipelines pass them), with a
    # shift that differs from the default one: the last two positions ignored.
    shift = torch.nn.functional.pad(labels[:, 2:], (0, 2), value=-100).contiguous()
    a = ref(input_ids=ids, shift_labels=shift, labels=labels)
    b = patched(input_ids=ids, shift_labels=shift, labels=labels)
    assert hf.rel(b.loss, a.loss) <= 1e-5
    default = patched(input_ids=ids, labels=labels).loss
    assert hf.rel(b.loss, default) > 1e-3  # the passed shift was used, not the default one
    a.loss.backward()
    b.loss.backward()
    assert not grads_match(ref, patched)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen3_next", "minimax", "minimax_m2", "ernie4_5_moe",
                                        "flex_olmo"])
def test_the_router_auxiliary_loss_is_still_added(model_type):
    ref = hf.tiny_model(model_type)
    patched = fpt.apply(copy.deepcopy(ref))
    ids, labels = hf.batch(2)
    a = ref(input_ids=ids, labels=labels, output_router_logits=True)
    b = patched(input_ids=ids, labels=labels, output_router_logits=True)
    assert a.aux_loss is not None and hf.rel(b.aux_loss, a.aux_loss) <= 1e-6
    assert hf.rel(b.loss, a.loss) <= 1e-5
    a.loss.backward()
    b.loss.backward()
    assert not grads_match(ref, patched)


def test_a_model_that_adds_no_router_loss_gets_none_and_its_router_logits():
    # AFMoE's forward returns its router logits and leaves any auxiliary loss to the trainer.
    ref = hf.tiny_model("afmoe")
    patched = fpt.apply(copy.deepcopy(ref))
    ids, labels = hf.batch(2)
    a = ref(input_ids=ids, labels=labels, output_router_logits=True)
    b = patched(input_ids=ids, labels=labels, output_router_logits=True)
    assert a.aux_loss is None and b.aux_loss is None
    assert len(b.router_logits) == len(a.router_logits) >= 1
    assert all(torch.equal(x, y) for x, y in zip(a.router_logits, b.router_logits))
    assert hf.rel(b.loss, a.loss) <= 1e-5


def test_a_forward_that_adds_a_router_loss_its_module_cannot_compute_is_refused():
    class Custom(transformers.Qwen3MoeForCausalLM):
        def forward(self, input_ids=None, labels=None, output_router_logits=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, output_router_logits=output_router_logits,
                                  **kwargs)
            return out  # its own load_balancing_loss_func, which this module does not define

    model = Custom(hf.tiny_config("qwen3_moe")).float()
    with pytest.raises(ValueError, match="Custom: its forward adds the router's auxiliary loss, but its module has "
                                         "no load_balancing_loss_func"):
        fpt.apply(model)
    assert getattr(model, "_flatpeak_patch", None) is None


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_ten_optimizer_steps_give_the_same_loss_curve(model_type):
    ref = hf.tiny_model(model_type)
    patched = fpt.apply(copy.deepcopy(ref))
    curves = []
    for model in (ref, patched):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for step in range(10):
            ids, labels = hf.batch(100 + step % 2)  # two batches in turn: the loss has to fall
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
        curves.append(curve)
    diffs = [abs(a - b) / abs(a) for a, b in zip(*curves)]
    assert max(diffs) <= 1e-4, curves
    assert curves[0][-1] < curves[0][0]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_offloaded_checkpoints_give_the_unpatched_gradients(model_type):
    from flatpeak.torch._offload import ring_of

    ref = hf.tiny_model(model_type)
    patched = fpt.apply(copy.deepcopy(ref), offload_checkpoints=True)
    patched.train()
    ref.train()
    for seed in (6, 7):  # two steps: the ring is reused
        ref.zero_grad()
        patched.zero_grad()
        ids, labels = hf.batch(seed)
        a = ref(input_ids=ids, labels=labels, use_cache=False)
        b = patched(input_ids=ids, labels=labels, use_cache=False)
        assert hf.rel(b.loss, a.loss) <= 1e-5
        a.loss.backward()
        b.loss.backward()
        assert not grads_match(ref, patched)
    ring = ring_of(patched.model.layers)
    assert 1 <= ring.ring.high_water_slots() <= ring.ring.slots()
    assert ring.ring.slots_in_use() == 0


def test_no_batch_seq_vocab_tensor_is_made():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.shapes.add(tuple(t.shape))
            return out

    model = fpt.apply(hf.tiny_model("qwen3_moe"))
    ids, labels = hf.batch(3)
    b, s = ids.shape
    with Shapes() as seen:
        model(input_ids=ids, labels=labels).loss.backward()
    logits_shapes = {(b, s, hf.VOCAB), (b * s, hf.VOCAB), (b, s - 1, hf.VOCAB), (b * (s - 1), hf.VOCAB)}
    assert not seen.shapes & logits_shapes, sorted(seen.shapes & logits_shapes)
    # The unpatched model does make them (the check can fail).
    with Shapes() as unpatched:
        hf.tiny_model("qwen3_moe")(input_ids=ids, labels=labels).loss.backward()
    assert unpatched.shapes & logits_shapes


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_generate_gives_the_same_tokens(model_type):
    ref = hf.tiny_model(model_type)
    patched = fpt.apply(copy.deepcopy(ref))
    ids, _ = hf.batch(4, batch_size=1, seq=6)
    a = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    b = patched.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b), (a, b)


def test_experts_implementation_flatpeak_selects_the_experts_alone():
    ref = hf.tiny_model("mixtral")
    config = copy.deepcopy(ref.config)
    config._experts_implementation = "flatpeak"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict(ref.state_dict())
    assert model.config._experts_implementation == "flatpeak"
    ids, labels = hf.batch(5)
    a, b = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert b.logits is not None  # the loss is transformers' own here
    assert hf.rel(b.loss, a.loss) <= 1e-5


def test_unsupported_models_and_bad_arguments_are_refused():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported.*qwen3_moe"):
        fpt.apply(llama)
    model = fpt.apply(hf.tiny_model("qwen3_moe"))
    with pytest.raises(ValueError, match="already patched"):
        fpt.apply(model)
    with pytest.raises(ValueError, match="need experts=True"):
        fpt.apply(hf.tiny_model("qwen3_moe"), experts=False, group=object())
    untouched = hf.tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="expert_activations: expected 'recompute' or 'save', got 'all'"):
        fpt.apply(untouched, expert_activations="all")
    assert getattr(untouched, "_flatpeak_patch", None) is None


@pytest.mark.parametrize(("world", "worker"), [(2, "expert_parallel"), (4, "expert_parallel"),
                                             (2, "expert_parallel_shared_experts")])
def test_expert_parallel_over_gloo_matches_the_unpatched_model(world, worker):
    reports = spawn(getattr(hf_workers, worker), world=world, timeout=240)
    errors = {r: p for r, (s, p) in reports.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    assert sorted(reports) == list(range(world))
