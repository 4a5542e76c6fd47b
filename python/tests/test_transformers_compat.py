"""A patched transformers model behaves as the unpatched one where users and ``Trainer`` touch
it: checkpoints round-trip both ways (``save_pretrained`` patched -> ``from_pretrained``
unpatched and the reverse, with and without ``offload_checkpoints``) for every supported family;
padded batches with the config's ``use_cache`` train as the unpatched model (both attention
implementations); transformers' gradient checkpointing composes with the offload in either
order; float16 is refused with what works; the model pickles and loads; deprecated keywords
warn as the model's own."""

from __future__ import annotations

import copy
import inspect
import io
import os
import pickle
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
import _hf_models as hf  # noqa: E402

import flatpeak.transformers as fpt  # noqa: E402
from flatpeak.torch._offload import ring_of  # noqa: E402

MODEL_TYPES = list(fpt.SUPPORTED_MODEL_TYPES)


def grads_differ(ref, patched, bound=1e-4):
    """The parameters (by name) whose gradients differ by more than ``bound`` (relative)."""
    want = {n: p.grad for n, p in ref.named_parameters()}
    bad = {}
    for name, q in patched.named_parameters():
        p = want.pop(name)
        if p is None and q.grad is None:
            continue
        err = hf.rel(q.grad, p) if p.norm() > 0 else float(q.grad.abs().max())
        if err > bound:
            bad[name] = err
    assert not want, f"names only the unpatched model has: {sorted(want)}"
    return bad


def padded_batch(seed: int, batch_size: int = 3, seq: int = 12):
    """input_ids, an attention mask with rows padded on the right by 0, 3 and 5 positions (as
    a collator pads), and labels -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, hf.VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    for row, pad in enumerate((0, 3, 5)[:batch_size]):
        if pad:
            mask[row, -pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def sgd_step(model, lr=1e-2):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.zero_grad()


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpoints_round_trip_between_patched_and_unpatched_models(model_type, offload, tmp_path):
    """A trained patched model's ``save_pretrained`` loads into an unpatched model with no key
    missing or unexpected and the same logits; an unpatched checkpoint loads into a patched
    model the same way (and ``load_state_dict`` is strict both ways)."""
    patched = fpt.apply(hf.tiny_model(model_type), offload_checkpoints=offload)
    patched.train()
    ids, mask, labels = padded_batch(0)
    patched(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    sgd_step(patched)
    patched.eval()
    patched.save_pretrained(tmp_path / "patched")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "patched", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded.eval()
    with torch.no_grad():
        want = patched(input_ids=ids, attention_mask=mask).logits
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert hf.rel(got, want) <= 1e-5

    plain = hf.tiny_model(model_type, seed=1)
    plain.save_pretrained(tmp_path / "plain")
    reloaded = fpt.apply(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain"),
                         offload_checkpoints=offload).eval()
    other = fpt.apply(hf.tiny_model(model_type, seed=2), offload_checkpoints=offload)
    other.load_state_dict(plain.state_dict())  # strict
    plain.load_state_dict(other.state_dict())
    plain.eval()
    other.eval()
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        for model in (reloaded, other):
            assert hf.rel(model(input_ids=ids, attention_mask=mask).logits, want) <= 1e-5


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_padded_batches_train_as_the_unpatched_model(model_type, offload, attn):
    """Training steps on right-padded batches, ``use_cache`` left at the config's default (on):
    the loss and every gradient equal the unpatched model's (without checkpointing), two steps,
    under both attention implementations."""
    ref = hf.tiny_model(model_type, attn_implementation=attn)
    assert ref.config.use_cache
    patched = fpt.apply(copy.deepcopy(ref), offload_checkpoints=offload)
    ref.train()
    patched.train()
    for seed in (1, 2):
        ids, mask, labels = padded_batch(seed)
        a = ref(input_ids=ids, attention_mask=mask, labels=labels)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' "caching is incompatible with checkpointing"
            b = patched(input_ids=ids, attention_mask=mask, labels=labels)
        assert hf.rel(b.loss, a.loss) <= 1e-5, (a.loss, b.loss)
        a.loss.backward()
        b.loss.backward()
        assert not grads_differ(ref, patched)
        sgd_step(ref)
        sgd_step(patched)
    if offload:
        ring = ring_of(patched.model.layers)
        assert ring.ring.high_water_slots() >= 1 and ring.ring.slots_in_use() == 0


@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_transformers_checkpointing_composes_with_the_offload_in_either_order(order, enable):
    """What ``Trainer(gradient_checkpointing=True)`` does, before or after ``apply``: the
    offload stays the checkpointing (the ring holds the boundaries), gradients equal the
    unpatched model's; disabling transformers' checkpointing leaves it on."""
    ref = hf.tiny_model("qwen3_moe")
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is a deprecated alias
        if order == "before":
            getattr(model, enable)()
            fpt.apply(model, offload_checkpoints=True)
        else:
            fpt.apply(model, offload_checkpoints=True)
            getattr(model, enable)()
    assert model.is_activation_checkpointing
    ref.train()
    model.train()
    for disabled in (False, True):
        if disabled:
            model.activation_checkpointing_disable()
        ids, mask, labels = padded_batch(3 + disabled)
        a = ref(input_ids=ids, attention_mask=mask, labels=labels)
        b = model(input_ids=ids, attention_mask=mask, labels=labels)
        ring = ring_of(model.model.layers)
        assert ring.forwarded == len(model.model.layers)  # every layer's boundary went to the ring
        a.loss.backward()
        b.loss.backward()
        assert not grads_differ(ref, model)
        assert ring.ring.slots_in_use() == 0
        ref.zero_grad()
        model.zero_grad()


def test_float16_is_refused_with_what_works():
    model = hf.tiny_model("qwen3_moe").half()
    with pytest.raises(TypeError, match=r"torch\.float16; float16 is not supported .* use bfloat16, or float32 "
                                        r"weights under torch\.autocast\(dtype=torch\.bfloat16\)"):
        fpt.apply(model)
    assert getattr(model, "_flatpeak_patch", None) is None  # nothing applied
    # Made float16 after apply: its first forward says the same (the experts, then the loss).
    patched = fpt.apply(hf.tiny_model("qwen3_moe")).half()
    ids, mask, labels = padded_batch(0)
    with pytest.raises(TypeError, match=r"hidden_states: expected dtype torch\.float32 or torch\.bfloat16, got "
                                        r"torch\.float16: float16 is not supported"):
        patched(input_ids=ids, labels=labels)
    loss_only = fpt.apply(hf.tiny_model("qwen3_moe"), experts=False).half()
    with pytest.raises(TypeError, match=r"input: expected dtype torch\.float32 or torch\.bfloat16, got "
                                        r"torch\.float16: float16 is not supported"):
        loss_only(input_ids=ids, labels=labels)
    # What the message names works: bfloat16, and float32 weights under bfloat16 autocast.
    ref = hf.tiny_model("qwen3_moe")
    bf16 = fpt.apply(copy.deepcopy(ref).to(torch.bfloat16))
    assert torch.isfinite(bf16(input_ids=ids, labels=labels).loss)
    patched = fpt.apply(copy.deepcopy(ref))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = ref(input_ids=ids, labels=labels).loss
        b = patched(input_ids=ids, labels=labels).loss
    assert abs(a.item() - b.item()) <= 2e-2 * abs(a.item())


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
def test_a_patched_model_pickles_and_loads(offload):
    """``torch.save(model)`` / ``torch.load``, ``pickle`` and ``copy.deepcopy`` give a model that
    runs the patched forward on itself (the same loss and gradients), and the forward keeps the
    signature ``Trainer`` reads."""
    ref = hf.tiny_model("qwen3_moe")
    patched = fpt.apply(copy.deepcopy(ref), offload_checkpoints=offload)
    patched.train()
    ids, mask, labels = padded_batch(5)
    want = patched(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(patched)), copy.deepcopy(patched)]
    for loaded in copies:
        assert loaded.forward.model is loaded
        loaded.train()
        loaded.zero_grad()
        got = loaded(input_ids=ids, attention_mask=mask, labels=labels)
        assert got.logits is None  # the patched forward
        assert torch.equal(got.loss, want.loss)
        got.loss.backward()
        assert not grads_differ(patched, loaded, bound=0.0)
    parameters = inspect.signature(patched.forward).parameters
    assert "self" not in parameters
    for name in ("input_ids", "attention_mask", "labels", "num_items_in_batch", "kwargs"):
        assert name in parameters, name


def test_deprecated_keywords_warn_as_the_unpatched_model_does():
    """``past_key_values`` (deprecated for ``cache``) reaches the model's own handling: a
    FutureWarning naming it, and the cache it names is used."""
    from transformers import DynamicCache

    ref = hf.tiny_model("qwen3_moe").eval()
    patched = fpt.apply(copy.deepcopy(ref))
    ids = torch.randint(0, hf.VOCAB, (1, 6))
    outputs = []
    for model in (ref, patched):
        cache = DynamicCache(config=model.config)
        with pytest.warns(FutureWarning, match=r"`past_key_values` is deprecated .* Use `cache` instead"):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert out.cache is cache and cache.get_seq_length() == 6
        outputs.append(out.logits)
    assert hf.rel(outputs[1], outputs[0]) <= 1e-5
