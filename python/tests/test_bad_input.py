"""Bad input is a Python exception naming the offending values; nothing crashes the interpreter."""

import pytest
import torch
import torch.nn.functional as F

import flatpeak
from flatpeak import _flatpeak as ext
from flatpeak.torch import StreamAdamW, linear_cross_entropy

N, D, V = 9, 4, 11


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g).to(dtype)
    w = torch.randn(V, D, generator=g).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    return x, w, t


def test_wrong_dtypes_are_type_errors_naming_the_argument():
    x, w, t = inputs()
    with pytest.raises(TypeError, match=r"weight: expected dtype torch.float32, got torch.bfloat16"):
        linear_cross_entropy(x, w.bfloat16(), t)
    with pytest.raises(TypeError, match=r"input: expected dtype torch.float32 or torch.bfloat16, got torch.float64$"):
        linear_cross_entropy(x.double(), w, t)
    with pytest.raises(TypeError, match=r"input: expected dtype torch.float32 or torch.bfloat16, got torch.float16: "
                                        r"float16 is not supported .* use bfloat16"):
        linear_cross_entropy(x.half(), w.half(), t)
    with pytest.raises(TypeError, match=r"target: expected dtype torch.int64, got torch.int32"):
        linear_cross_entropy(x, w, t.int())
    with pytest.raises(TypeError, match=r"bias: expected dtype torch.float32"):
        linear_cross_entropy(x, w, t, torch.zeros(V, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"token_weights: expected dtype torch.float32"):
        linear_cross_entropy(x, w, t, token_weights=torch.ones(N, dtype=torch.float64))


def test_non_contiguous_views_are_accepted_as_torch_accepts_them():
    """A transposed weight, a transposed input and a batched input with permuted strides give
    torch's loss and gradients (each copied once), and the gradients reach the original tensors."""
    import torch.nn.functional as F

    torch.manual_seed(3)
    cases = [
        (torch.randn(N, D), torch.randn(D, V).t(), torch.randint(0, V, (N,))),
        (torch.randn(D, N).t(), torch.randn(V, D), torch.randint(0, V, (N,))),
        (torch.randn(3, D, 3).transpose(1, 2), torch.randn(V, D), torch.randint(0, V, (3, 3))),
    ]
    for x, w, t in cases:
        assert not (x.is_contiguous() and w.is_contiguous())
        x.requires_grad_()
        w.requires_grad_()
        loss = linear_cross_entropy(x, w, t)
        loss.backward()
        gx, gw = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        ref = F.cross_entropy((x @ w.t()).reshape(-1, V), t.reshape(-1))
        ref.backward()
        assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
        assert torch.allclose(gx, x.grad, rtol=1e-4, atol=1e-6)
        assert torch.allclose(gw, w.grad, rtol=1e-4, atol=1e-6)


def test_targets_out_of_range_name_the_token_and_value():
    x, w, t = inputs()
    t[5] = V
    with pytest.raises(ValueError, match=rf"target {V} of token 5 is outside 0..{V}"):
        linear_cross_entropy(x, w, t)
    t[5] = -7
    with pytest.raises(ValueError, match=r"target -7 of token 5"):
        linear_cross_entropy(x, w, t)


def test_shape_mismatches_are_value_errors():
    x, w, t = inputs()
    with pytest.raises(ValueError, match=r"hidden sizes differ"):
        linear_cross_entropy(x, torch.randn(V, D + 1), t)
    with pytest.raises(ValueError, match=r"target: expected shape \[9\], got \[8\]"):
        linear_cross_entropy(x, w, t[:8])
    with pytest.raises(ValueError, match=r"bias: expected shape \[11\], got \[10\]"):
        linear_cross_entropy(x, w, t, torch.zeros(V - 1))
    with pytest.raises(ValueError, match=r"input must be \[tokens, hidden\]"):
        linear_cross_entropy(x.reshape(-1), w, t)


def test_bad_options_and_weights_are_value_errors():
    x, w, t = inputs()
    with pytest.raises(ValueError, match=r"reduction"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing"):
        linear_cross_entropy(x, w, t, label_smoothing=-0.1)
    # torch's range, [0, 1], checked before the cast to f32 (which would round either value to 1).
    with pytest.raises(ValueError, match=r"label_smoothing: expected a value in \[0, 1\], got 1.000000001"):
        linear_cross_entropy(x, w, t, label_smoothing=1.000000001)
    torch.testing.assert_close(linear_cross_entropy(x, w, t, label_smoothing=1 - 1e-9),
                               F.cross_entropy(x @ w.T, t, label_smoothing=1 - 1e-9), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"softcap"):
        linear_cross_entropy(x, w, t, softcap=0.0)
    with pytest.raises(ValueError, match=r"precision"):
        linear_cross_entropy(x, w, t, precision="fp8")
    # TF32 is a tensor-core format: on CPU tensors it is refused, never run as something else.
    with pytest.raises(ValueError, match=r"tf32 GEMMs are not offered for f32 inputs on the CPU"):
        linear_cross_entropy(x, w, t, precision="tf32")
    tw = torch.ones(N)
    tw[3] = float("nan")
    with pytest.raises(ValueError, match=r"weight NaN of token 3"):
        linear_cross_entropy(x, w, t, token_weights=tw)


def test_a_tensor_on_another_device_is_a_value_error():
    x, w, t = inputs()
    options = ext.LossOptions()
    loss, lse = torch.empty(()), torch.empty(N)
    with pytest.raises(ValueError, match=r"weight: .*on `meta`|weight: a tensor on `meta`"):
        ext.lce_forward(options, (x, w.to("meta"), t, None, None), (loss, lse))
    with pytest.raises(TypeError, match=r"expected a torch.Tensor, got list"):
        ext.lce_forward(options, (x, [1.0], t, None, None), (loss, lse))


def test_cuda_tensors_without_the_cuda_build_say_how_to_build_it():
    if flatpeak.cuda_built() or not torch.cuda.is_available():
        pytest.skip("needs a GPU and a build without the cuda feature")
    x, w, t = inputs()
    with pytest.raises(ValueError, match=r"--features cuda"):
        linear_cross_entropy(x.cuda(), w.cuda(), t.cuda())


def test_outputs_aliasing_inputs_are_refused():
    x, w, t = inputs()
    lse_is_x = x.reshape(-1)[:N]
    with pytest.raises(ValueError, match=r"lse_out shares memory with input"):
        ext.lce_forward(ext.LossOptions(), (x, w, t, None, None), (torch.empty(()), lse_is_x))


def test_stream_adamw_bad_parameters():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = StreamAdamW([p])
    p.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"(param|grad): expected dtype torch.float32, got torch.float64"):
        opt.step()
    q = torch.nn.Parameter(torch.ones(4, 4))
    opt = StreamAdamW([q])
    q.grad = torch.ones(4, 4).t()  # non-contiguous gradient
    with pytest.raises(ValueError, match=r"grad: expected a contiguous tensor"):
        opt.step()
    assert torch.equal(q.detach(), torch.ones(4, 4))


def test_stream_adamw_checks_every_group_before_writing_any():
    good = torch.nn.Parameter(torch.ones(5))
    bad = torch.nn.Parameter(torch.ones(5))
    opt = StreamAdamW([{"params": [good]}, {"params": [bad]}], lr=0.1)
    good.grad, bad.grad = torch.ones(5), torch.ones(5)
    opt.step()
    before = good.detach().clone()
    opt.state[bad]["exp_avg"] = torch.zeros(6)  # a corrupt state tensor, in the second group
    with pytest.raises(ValueError, match=r"exp_avg: expected shape \[5\], got \[6\]"):
        opt.step()
    assert torch.equal(good.detach(), before)
    assert int(opt.state[good]["step"].item()) == 1


def test_a_target_of_another_shape_is_refused_even_with_the_same_element_count():
    x = torch.randn(2, 6, 8)
    w = torch.randn(11, 8)
    t = torch.randint(0, 11, (2, 6))
    for bad in (t.reshape(6, 2), t.reshape(12), t.reshape(3, 4)):
        leading = r"target: expected shape \[2, 6\], got .* \(the leading shape of input \[2, 6, 8\]\)"
        with pytest.raises(ValueError, match=leading):
            linear_cross_entropy(x, w, bad, reduction="none")
    with pytest.raises(ValueError, match=r"token_weights: expected shape \[2, 6\]"):
        linear_cross_entropy(x, w, t, token_weights=torch.ones(12))
    x2 = x.reshape(12, 8)
    with pytest.raises(ValueError, match=r"target: expected shape \[12\]"):
        linear_cross_entropy(x2, w, t)
    # The right shapes still run, and per-token losses come back in the target's shape.
    assert linear_cross_entropy(x, w, t, reduction="none").shape == (2, 6)


@pytest.mark.parametrize("fused", [True, False])
def test_double_backward_raises_instead_of_dropping_the_penalty(fused):
    x, w, t = inputs()
    x.requires_grad_()
    w.requires_grad_()

    def loss_of():
        out = linear_cross_entropy(x, w, t, return_lse=not fused)
        return out[0] if not fused else out

    (gx,) = torch.autograd.grad(loss_of(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy is differentiable once"):
        gx.pow(2).sum().backward()
    # With respect to the weight alone (a gradient penalty's usual form), through
    # torch.autograd.grad: raises too, where a detached guard returned None.
    for wrt in ([w], [x], [x, w]):
        (gx,) = torch.autograd.grad(loss_of(), x, create_graph=True)
        with pytest.raises(RuntimeError, match=r"differentiable once"):
            torch.autograd.grad(gx.pow(2).sum(), wrt, allow_unused=True)
    (gw,) = torch.autograd.grad(loss_of(), w, create_graph=True)
    with pytest.raises(RuntimeError, match=r"differentiable once"):
        torch.autograd.grad(gw.pow(2).sum(), [x], allow_unused=True)
    # Without create_graph, one backward works as before and leaves a plain gradient.
    x.grad = w.grad = None
    loss_of().backward()
    assert x.grad is not None and x.grad.grad_fn is None and w.grad.grad_fn is None


@pytest.mark.parametrize("activations", ["recompute", "save"])
def test_double_backward_through_the_experts_raises(activations):
    from flatpeak.torch import moe_swiglu

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    gate_up = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    down = torch.randn(2, 8, 3, generator=g, requires_grad=True)
    ids = torch.randint(0, 2, (6, 2), generator=g)
    weights = torch.rand(6, 2, generator=g, requires_grad=True)
    y = moe_swiglu(x, ids, weights, gate_up, down, activations=activations)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"moe_swiglu is differentiable once"):
        torch.autograd.grad(gx.pow(2).sum(), [gate_up], allow_unused=True)
    y = moe_swiglu(x, ids, weights, gate_up, down, activations=activations)
    y.square().sum().backward()
    assert gate_up.grad is not None and gate_up.grad.grad_fn is None


@pytest.mark.parametrize("where", ["weight", "target", "bias", "input"])
def test_tensors_on_different_devices_meta_included_are_refused(where):
    x, w, t = inputs()
    b = torch.zeros(V)
    tensors = dict(input=x, weight=w, target=t, bias=b)
    tensors[where] = tensors[where].to("meta")
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least "
                                           r"two devices, (cpu and meta|meta and cpu)!"):
        linear_cross_entropy(tensors["input"], tensors["weight"], tensors["target"], tensors["bias"])
    # All on meta is a traced (fake) call: shapes only, as torch's ops give.
    meta = linear_cross_entropy(x.to("meta"), w.to("meta"), t.to("meta"), reduction="none")
    assert meta.device.type == "meta" and meta.shape == (N,)


@pytest.mark.parametrize("name", ["input", "weight", "target", "bias", "token_weights"])
def test_a_non_tensor_argument_is_a_type_error_naming_it(name):
    x, w, t = inputs()
    kwargs = dict(input=x, weight=w, target=t, bias=None, token_weights=None)
    kwargs[name] = [1.0, 2.0]
    with pytest.raises(TypeError, match=rf"{name}: expected a torch.Tensor, got list"):
        linear_cross_entropy(kwargs.pop("input"), kwargs.pop("weight"), kwargs.pop("target"), kwargs.pop("bias"),
                             **kwargs)


@pytest.mark.parametrize("where", ["hidden_states", "topk_ids", "topk_weights", "gate_up_proj", "down_proj"])
def test_moe_swiglu_with_one_argument_on_meta_is_refused_as_the_loss_refuses_it(where):
    from flatpeak.torch import moe_swiglu

    g = torch.Generator().manual_seed(0)
    args = dict(hidden_states=torch.randn(6, 8, generator=g), topk_ids=torch.randint(0, 4, (6, 2), generator=g),
                topk_weights=torch.rand(6, 2, generator=g), gate_up_proj=torch.randn(4, 10, 8, generator=g),
                down_proj=torch.randn(4, 8, 5, generator=g))
    args[where] = args[where].to("meta")
    with pytest.raises(RuntimeError, match=r"two devices, (cpu and meta|meta and cpu)!"):
        moe_swiglu(**args)


@pytest.mark.parametrize("sizes,name", [((4, 0, 6), "hidden_size"), ((4, 8, 0), "intermediate_size"),
                                        ((4, 8, -2), "intermediate_size"), ((0, 8, 6), "num_experts")])
def test_moe_experts_of_no_size_is_a_value_error_naming_it(sizes, name):
    from flatpeak.torch import MoEExperts

    with pytest.raises(ValueError, match=name):
        MoEExperts(*sizes)
