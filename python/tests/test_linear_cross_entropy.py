"""flatpeak.torch.linear_cross_entropy against torch itself: loss and gradients against
``F.cross_entropy(F.linear(...))`` in float64 (or the formula composed in torch ops where torch
has no such option), opcheck, and torch.compile."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import flatpeak
from flatpeak.torch import LinearCrossEntropyLoss, linear_cross_entropy

# V is not a multiple of any block; N and D odd-sized too.
N, D, V = 67, 48, 1003
# The CUDA cases run where a GPU is and the package was built with `--features cuda`.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flatpeak.cuda_built() else [])


def rel(a, b):
    """Normwise relative error max|a - b| / max|b| (b nonzero) or max|a| (b all zero)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def make(seed, dtype=torch.float32, ignore="some", bias=False, weights=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g) * 1.5
    w = torch.randn(V, D, generator=g) * 0.2
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    if ignore == "some":
        t[::4] = -100
    elif ignore == "all":
        t[:] = -100
    tw = torch.rand(N, generator=g) + 0.25 if weights else None
    cast = lambda v: None if v is None else v.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(w), t.to(device), cast(b), None if tw is None else tw.to(device)


def reference(x, w, t, b, *, reduction, label_smoothing=0.0, z_loss=0.0, softcap=None, token_weights=None,
              ignore_index=-100):
    """The loss in float64 torch ops: F.cross_entropy(F.linear(...)) itself when torch has every
    option, else the formula composed from F.cross_entropy(reduction='none') and logsumexp."""
    logits = F.linear(x, w, b)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = t != ignore_index
    plain = z_loss == 0 and token_weights is None
    if plain and (reduction != "mean" or valid.any()):
        return F.cross_entropy(logits, t, reduction=reduction, ignore_index=ignore_index,
                               label_smoothing=label_smoothing)
    per = F.cross_entropy(logits, t, reduction="none", ignore_index=ignore_index, label_smoothing=label_smoothing)
    per = per + z_loss * torch.logsumexp(logits, -1) ** 2 * valid
    tw = torch.ones_like(per) if token_weights is None else token_weights.double()
    per = per * tw
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    denom = (tw * valid).sum()
    return per.sum() / denom if denom > 0 else per.sum() * 0.0


def grads_of(loss_fn, tensors, upstream=None):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    loss = loss_fn(*leaves)
    (loss if upstream is None else (loss * upstream).sum()).backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


CASES = list(itertools.product(["mean", "sum", "none"], ["none", "some", "all"], [0.0, 0.1, 1.0], [False, True],
                               [False, True]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction,ignore,label_smoothing,bias,weights", CASES)
def test_f32_matches_torch_f64(device, reduction, ignore, label_smoothing, bias, weights):
    x, w, t, b, tw = make(1, ignore=ignore, bias=bias, weights=weights, device=device)
    params = [x, w] + ([b] if bias else [])
    # A non-uniform upstream gradient for reduction none (a known bug class of fused losses).
    up = torch.linspace(-1.0, 2.0, N, device=device) if reduction == "none" else None

    def ours(x, w, b=None):
        return linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=label_smoothing,
                                    token_weights=tw)

    def theirs(x, w, b=None):
        return reference(x, w, t, b, reduction=reduction, label_smoothing=label_smoothing, token_weights=tw)

    loss, grads = grads_of(ours, params, up)
    ref_loss, ref_grads = grads_of(theirs, [p.double() for p in params], None if up is None else up.double())
    assert loss.dtype == torch.float32
    assert rel(loss, ref_loss) <= 1e-5
    assert rel(grads[0], ref_grads[0]) <= 1e-5  # dx
    for g, r in zip(grads[1:], ref_grads[1:]):  # dw, dbias
        assert rel(g, r) <= 1e-4
    if ignore == "all":
        assert loss.abs().max() == 0 and all(g.abs().max() == 0 for g in grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap,z_loss", [(None, 1e-3), (15.0, 0.0), (5.0, 1e-2)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_and_z_loss_match_the_composed_formula(device, softcap, z_loss, reduction):
    x, w, t, b, tw = make(2, bias=True, weights=True, device=device)
    up = torch.linspace(0.5, -1.5, N, device=device) if reduction == "none" else None
    kw = dict(reduction=reduction, label_smoothing=0.05, z_loss=z_loss, softcap=softcap, token_weights=tw)
    loss, grads = grads_of(lambda x, w, b: linear_cross_entropy(x, w, t, b, **kw), [x, w, b], up)
    ref, ref_grads = grads_of(lambda x, w, b: reference(x, w, t, b, **kw), [x.double(), w.double(), b.double()],
                              None if up is None else up.double())
    assert rel(loss, ref) <= 1e-5
    assert rel(grads[0], ref_grads[0]) <= 1e-5
    assert max(rel(grads[1], ref_grads[1]), rel(grads[2], ref_grads[2])) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_return_lse_and_its_gradient(device):
    x, w, t, b, _ = make(3, bias=True, device=device)
    h = torch.linspace(-0.3, 0.7, N, device=device)

    def ours(x, w, b):
        loss, lse = linear_cross_entropy(x, w, t, b, return_lse=True, z_loss=1e-3)
        return loss + (lse * h).sum()

    def theirs(x, w, b):
        lse = torch.logsumexp(F.linear(x, w, b), -1)
        return reference(x, w, t, b, reduction="mean", z_loss=1e-3) + (lse * h.double()).sum()

    loss, grads = grads_of(ours, [x, w, b])
    ref, ref_grads = grads_of(theirs, [x.double(), w.double(), b.double()])
    assert rel(loss, ref) <= 1e-5
    assert rel(grads[0], ref_grads[0]) <= 1e-5
    assert max(rel(grads[1], ref_grads[1]), rel(grads[2], ref_grads[2])) <= 1e-4
    _, lse = linear_cross_entropy(x, w, t, b, return_lse=True)
    assert lse.dtype == torch.float32 and rel(lse, torch.logsumexp(F.linear(x, w, b).double(), -1)) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_no_worse_than_torch_bf16(device, reduction, bias):
    x, w, t, b, _ = make(4, dtype=torch.bfloat16, bias=bias, device=device)
    params = [x, w] + ([b] if bias else [])
    up = torch.linspace(-1.0, 1.0, N, device=device) if reduction == "none" else None

    def ours(x, w, b=None):
        return linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=0.1)

    def theirs(x, w, b=None):
        return F.cross_entropy(F.linear(x, w, b), t, reduction=reduction, label_smoothing=0.1)

    loss, grads = grads_of(ours, params, None if up is None else up.bfloat16())
    torch_loss, torch_grads = grads_of(theirs, params, None if up is None else up.bfloat16())
    ref, ref_grads = grads_of(theirs, [p.double() for p in params], None if up is None else up.double())
    assert loss.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert rel(loss, ref) <= rel(torch_loss, ref) + 1e-2
    for g, tg, r in zip(grads, torch_grads, ref_grads):
        assert rel(g, r) <= rel(tg, r) + 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_precision_option(device):
    """``precision="f32"`` keeps a bf16 call's logit gradient in float32: its gradients are the
    float64 ones up to their final rounding to bfloat16 (half an ulp, 2**-9 relative, plus the
    float32 sums); ``"native"`` rounds the logit gradient too, within torch's own bf16 error."""
    x, w, t, _, _ = make(8, dtype=torch.bfloat16, device=device)
    ref_loss, ref_grads = grads_of(lambda x, w: F.cross_entropy(F.linear(x, w), t), [x.double(), w.double()])
    _, torch_grads = grads_of(lambda x, w: F.cross_entropy(F.linear(x, w), t), [x, w])
    for precision in ("f32", "native"):
        def call(x, w, precision=precision):
            return linear_cross_entropy(x, w, t, precision=precision)

        loss, grads = grads_of(call, [x, w])
        assert rel(loss, ref_loss) <= 2.0 ** -8
        for g, tg, r in zip(grads, torch_grads, ref_grads):
            assert g.dtype == torch.bfloat16
            if precision == "f32":
                assert rel(g, r) <= 2.0 ** -8, precision
            else:
                assert rel(g, r) <= rel(tg, r) + 1e-2, precision
    # TF32 is for float32 inputs on a GPU: bfloat16 inputs refuse it on every device.
    with pytest.raises(ValueError, match=r"tf32 GEMMs are not offered for bf16 inputs"):
        linear_cross_entropy(x, w, t, precision="tf32")
    assert "precision='f32'" in repr(LinearCrossEntropyLoss(precision="f32"))


def test_batch_seq_input_is_flattened():
    x, w, t, b, tw = make(5, bias=True, weights=True)
    x3, t3, tw3 = x[:66].reshape(6, 11, D), t[:66].reshape(6, 11), tw[:66].reshape(6, 11)
    flat = linear_cross_entropy(x[:66], w, t[:66], b, reduction="none", token_weights=tw[:66])
    per = linear_cross_entropy(x3, w, t3, b, reduction="none", token_weights=tw3)
    assert per.shape == (6, 11) and torch.equal(per.reshape(-1), flat)
    loss, lse = linear_cross_entropy(x3, w, t3, b, return_lse=True)
    assert loss.shape == () and lse.shape == (6, 11)


def test_module_wraps_the_function():
    x, w, t, b, _ = make(6, bias=True)
    module = LinearCrossEntropyLoss(label_smoothing=0.1, z_loss=1e-4)
    assert torch.equal(module(x, w, t, b), linear_cross_entropy(x, w, t, b, label_smoothing=0.1, z_loss=1e-4))
    with pytest.raises(ValueError, match="label_smoothing"):
        LinearCrossEntropyLoss(label_smoothing=1.5)


def test_budget_bounds_the_working_set_and_not_the_result():
    x, w, t, b, _ = make(7, bias=True)
    small = linear_cross_entropy(x, w, t, b, budget_bytes=64 << 10)
    large = linear_cross_entropy(x, w, t, b, budget_bytes=1 << 30)
    assert rel(small, large) <= 1e-6
    with pytest.raises(ValueError, match="budget"):
        linear_cross_entropy(x, w, t, b, budget_bytes=256)


def _op_args(bias=True, weights=True, reduction="mean"):
    x, w, t, b, tw = make(8, bias=bias, weights=weights)
    return x.requires_grad_(), w.requires_grad_(), t, None if b is None else b.requires_grad_(), tw, \
        -100, reduction, 0.1, 1e-3, None, None, "native"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_both_ops(reduction, bias):
    args = _op_args(bias=bias, reduction=reduction)
    torch.library.opcheck(torch.ops.flatpeak.linear_cross_entropy_forward.default, args)
    x, w, t, b, tw, *opts = args
    loss, lse = torch.ops.flatpeak.linear_cross_entropy_forward(*args)
    grad = torch.linspace(-1, 1, N) if reduction == "none" else torch.tensor(1.0)
    back = (grad, torch.linspace(0, 1, N), x.detach(), w.detach(), t, None if b is None else b.detach(), tw,
            lse.detach(), *opts)
    # Every gradient, and each skipped in turn (an empty output for it).
    for wanted in ([True, True, True], [False, True, True], [True, False, False]):
        torch.library.opcheck(torch.ops.flatpeak.linear_cross_entropy_backward.default, (*back, wanted))


def test_opcheck_fused_op():
    for bias in (False, True):
        for wanted in ([True, True, True], [False, True, True], [True, False, False]):
            torch.library.opcheck(torch.ops.flatpeak.linear_cross_entropy_fused.default,
                                  (*_op_args(bias=bias), wanted))


def _frozen_grads(loss_fn, x, w, b, frozen):
    """The gradients of ``loss_fn(x, w, b).sum() * 0.5`` with the tensor named ``frozen``
    requiring no grad: ``.grad`` of each (``None`` for the frozen one)."""
    leaves = {name: t.detach().clone().requires_grad_(name != frozen) for name, t in (("x", x), ("w", w), ("b", b))}
    (loss_fn(leaves["x"], leaves["w"], leaves["b"]).sum() * 0.5).backward()
    return {name: t.grad for name, t in leaves.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction,return_lse", [("mean", False), ("sum", False), ("none", False),
                                                  ("mean", True)])
@pytest.mark.parametrize("frozen", ["w", "x", "b"])
def test_a_frozen_tensor_gets_no_gradient_and_costs_none(monkeypatch, dtype, reduction, return_lse, frozen):
    """A frozen weight (or input, or bias) gets no gradient -- ``.grad`` stays ``None`` and the
    binding is handed no buffer for it (``None``: nothing allocated, no GEMM) -- and the other
    gradients are exactly those of the call where everything requires grad, on the fused path
    (reduced loss) and the two-pass one (``none``, or with the lse)."""
    from flatpeak.torch import _loss

    handed = []
    for name in ("lce_forward_backward", "lce_backward"):
        real = getattr(_loss._ext, name)
        monkeypatch.setattr(_loss._ext, name,
                            lambda *a, real=real: handed.append(a[-1]) or real(*a))
    x, w, t, b, _ = make(21, dtype=dtype, bias=True)

    def loss_of(x, w, b):
        out = linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=0.1, return_lse=return_lse)
        return out[0] + 1e-2 * out[1].sum() if return_lse else out

    full = _frozen_grads(loss_of, x, w, b, frozen=None)
    assert [all(g is not None for g in h) for h in handed] == [True]
    handed.clear()
    some = _frozen_grads(loss_of, x, w, b, frozen=frozen)
    index = {"x": 0, "w": 1, "b": 2}[frozen]
    assert len(handed) == 1 and handed[0][index] is None
    assert all(g is not None for i, g in enumerate(handed[0]) if i != index)
    for name, g in some.items():
        if name == frozen:
            assert g is None
        else:
            assert g.dtype == full[name].dtype and torch.equal(g, full[name]), name


def test_torch_compile_with_a_frozen_weight_matches_eager():
    """Under ``torch.compile(fullgraph=True)`` a frozen weight gets no gradient either, on both
    ops, and the input's and bias's match eager mode's."""
    x, w, t, b, _ = make(22, bias=True)

    def two_pass(x, w, b):
        loss, lse = linear_cross_entropy(x, w, t, b, label_smoothing=0.1, return_lse=True)
        return loss + 1e-2 * lse.sum()

    def fused(x, w, b):
        return 2.0 * linear_cross_entropy(x, w, t, b, label_smoothing=0.1)

    for step in (two_pass, fused):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        eager = _frozen_grads(step, x, w, b, frozen="w")
        traced = _frozen_grads(compiled, x, w, b, frozen="w")
        assert eager["w"] is None and traced["w"] is None
        for name in ("x", "b"):
            assert torch.equal(eager[name], traced[name]), (step.__name__, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_reduced_loss_fuses_forward_and_backward(monkeypatch, dtype, reduction):
    """With gradients wanted, forward also runs backward (one pass, 3 GEMMs a block); backward
    scales those gradients by the real upstream gradient. They match the two-pass call's."""
    from flatpeak.torch import _loss

    calls = []
    fused = _loss._ext.lce_forward_backward
    monkeypatch.setattr(_loss._ext, "lce_forward_backward", lambda *a: calls.append(1) or fused(*a))
    x, w, t, b, tw = make(12, dtype=dtype, bias=True, weights=True)
    params = [x, w, b]

    def loss_of(x, w, b):
        return linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=0.1, token_weights=tw)

    def two_pass(x, w, b):  # return_lse keeps the lse's gradient open: forward, then backward
        return linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=0.1, token_weights=tw,
                                    return_lse=True)[0]

    upstream = torch.tensor(-2.5)
    loss, grads = grads_of(loss_of, params, upstream)
    assert len(calls) == 1
    ref_loss, ref_grads = grads_of(two_pass, params, upstream)
    assert len(calls) == 1
    assert torch.equal(loss, ref_loss)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype and rel(g, r) <= tol
    # Without gradients nothing is fused.
    with torch.no_grad():
        assert torch.equal(loss_of(x, w, b), loss)
    assert len(calls) == 1


@pytest.mark.parametrize("budget_bytes", [None, 64 << 10])  # fused, and vocabulary blocks
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_gradients_are_the_fp32_gradients_rounded_once(budget_bytes, bias):
    """Given bf16 dX and dW buffers (what the CPU path allocates for bf16 inputs), the crate
    accumulates in fp32 and rounds once: bit for bit the fp32 buffers' gradients rounded to
    bf16, in the fused call and in backward (dbias stays fp32, equal)."""
    from flatpeak.torch import _loss
    from flatpeak.torch._lce_common import options as _options

    x, w, t, b, tw = make(21, dtype=torch.bfloat16, bias=bias, weights=True)
    options = _options((-100, "mean", 0.1, 1e-3, None, budget_bytes, "native"))
    args = (x, w, t, None if b is None else b.float(), tw.float())  # bias and weights are fp32

    def buffers(dtype):
        return (torch.empty(N, D, dtype=dtype), torch.empty(V, D, dtype=dtype),
                torch.empty(V) if bias else None)

    lse = torch.empty(N)
    fp32, bf16 = buffers(torch.float32), buffers(torch.bfloat16)
    for grads in (fp32, bf16):
        _loss._ext.lce_forward_backward(options, args, (torch.empty(()), lse), grads)
    for got, want in zip(bf16, fp32):
        if want is not None:
            want = want.to(got.dtype)
            assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))
    upstream = (torch.tensor(0.5), torch.randn(N, generator=torch.Generator().manual_seed(3)))
    fp32, bf16 = buffers(torch.float32), buffers(torch.bfloat16)
    for grads in (fp32, bf16):
        _loss._ext.lce_backward(options, args, lse, upstream, grads)
    for got, want in zip(bf16, fp32):
        if want is not None:
            assert torch.equal(got.float(), want.to(got.dtype).float())


def test_gradient_buffers_of_two_dtypes_are_refused_by_name():
    from flatpeak.torch import _loss
    from flatpeak.torch._lce_common import options as _options

    x, w, t, _, _ = make(22, dtype=torch.bfloat16)
    options = _options((-100, "mean", 0.0, 0.0, None, None, "native"))
    dx, dw = torch.zeros(N, D, dtype=torch.bfloat16), torch.zeros(V, D)
    with pytest.raises(TypeError, match="dw"):
        _loss._ext.lce_forward_backward(options, (x, w, t, None, None), (torch.empty(()), torch.empty(N)),
                                        (dx, dw, None))
    assert not dx.any() and not dw.any()


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_fused_gradients_survive_a_retained_graph(scale):
    """A second backward through a retained graph adds the same gradients again."""
    x, w, t, b, _ = make(13, bias=True)
    params = [p.requires_grad_() for p in (x, w, b)]
    loss = linear_cross_entropy(x, w, t, b) * scale
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in params]
    loss.backward()
    for p, g in zip(params, once):
        assert torch.equal(p.grad, 2 * g)


def test_torch_compile_fullgraph_matches_eager():
    x, w, t, b, tw = make(9, bias=True, weights=True)  # ignored targets present

    def step(x, w, b):
        loss, lse = linear_cross_entropy(x, w, t, b, label_smoothing=0.1, z_loss=1e-3, token_weights=tw,
                                         return_lse=True)
        return loss + 1e-2 * lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_loss, eager_grads = grads_of(step, [x, w, b])
    compiled_loss, compiled_grads = grads_of(compiled, [x, w, b])
    assert torch.equal(eager_loss, compiled_loss)
    for e, c in zip(eager_grads, compiled_grads):
        assert torch.equal(e, c)

    def fused_step(x, w, b):  # a reduced loss without the lse: the fused op
        return 3.0 * linear_cross_entropy(x, w, t, b, label_smoothing=0.1, token_weights=tw)

    compiled = torch.compile(fused_step, fullgraph=True, backend="aot_eager")
    eager_loss, eager_grads = grads_of(fused_step, [x, w, b])
    compiled_loss, compiled_grads = grads_of(compiled, [x, w, b])
    assert torch.equal(eager_loss, compiled_loss)
    for e, c in zip(eager_grads, compiled_grads):
        assert torch.equal(e, c)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the cuda build")
def test_cuda_working_set_is_torchs_and_within_the_plan():
    """The CUDA path allocates its working set through torch's caching allocator: the peak
    above the inputs covers the plan's workspace and stays within workspace + gradients."""
    from flatpeak import _flatpeak
    n, d, v = 4096, 512, 32000
    g = torch.Generator().manual_seed(10)
    x = (torch.randn(n, d, generator=g) * 0.5).cuda().requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.05).cuda().requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).cuda()
    budget = 32 << 20
    workspace = _flatpeak.LossOptions(budget_bytes=budget).cuda_workspace_bytes(n, d, v, False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(x, w, t, budget_bytes=budget)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = (n * d + v * d) * 4
    assert workspace <= budget
    assert peak >= workspace, (peak, workspace)
    assert peak <= workspace + grads + (8 << 20), (peak, workspace, grads)
    ref = torch.nn.functional.cross_entropy(x.detach().double() @ w.detach().double().T, t)
    assert rel(loss.detach(), ref) <= 1e-5


def test_the_plan_and_working_set_are_made_once_per_shape_and_options():
    from flatpeak import _flatpeak as ext

    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (20,), generator=g)
    ext.clear_loss_executors()
    for _ in range(3):  # the fused path
        linear_cross_entropy(x, w, t).backward()
    assert ext.cached_loss_executors() == 1
    loss, lse = linear_cross_entropy(x, w, t, return_lse=True)  # forward, then backward: the same plan
    (loss + lse.sum()).backward()
    assert ext.cached_loss_executors() == 1
    linear_cross_entropy(x[:5], w, t[:5]).backward()  # another shape
    linear_cross_entropy(x, w, t, z_loss=1e-4).backward()  # other options
    assert ext.cached_loss_executors() == 3
    ext.clear_loss_executors()
    assert ext.cached_loss_executors() == 0


def test_the_executor_cache_is_bounded_visible_and_freeable():
    """The public cache API: what the kept executors reserved is visible, a limit bounds it (the
    least recently used go first, one over the limit is held alone), and clearing frees it."""
    import flatpeak.torch as ft

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(64, 16, generator=g), torch.randn(300, 16, generator=g)
    t = torch.randint(0, 300, (64,), generator=g)
    limit = ft.executor_cache_limit()
    try:
        ft.clear_executor_cache()
        assert (ft.cached_executors(), ft.executor_cache_bytes()) == (0, 0)
        linear_cross_entropy(x, w, t, budget_bytes=1 << 20)
        one = ft.executor_cache_bytes()
        assert ft.cached_executors() == 1 and one > 0
        linear_cross_entropy(x, w, t, z_loss=1e-4, budget_bytes=1 << 20)  # another plan
        both = ft.executor_cache_bytes()
        assert ft.cached_executors() == 2 and both > one
        ft.set_executor_cache_limit(both - one)  # the least recently used goes now
        assert (ft.cached_executors(), ft.executor_cache_bytes()) == (1, both - one)
        assert ft.executor_cache_limit() == both - one
        ft.set_executor_cache_limit(0)  # nothing fits: everything goes ...
        assert (ft.cached_executors(), ft.executor_cache_bytes()) == (0, 0)
        linear_cross_entropy(x, w, t, budget_bytes=1 << 20)  # ... but the one last made is kept
        assert (ft.cached_executors(), ft.executor_cache_bytes()) == (1, one)
        with pytest.raises(ValueError, match="limit_bytes"):
            ft.set_executor_cache_limit(-1)
        ft.clear_executor_cache()
        assert (ft.cached_executors(), ft.executor_cache_bytes()) == (0, 0)
    finally:
        ft.set_executor_cache_limit(limit)


def test_threads_sharing_the_cached_executor_neither_deadlock_nor_race():
    from _threads import results_of_threads

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(64, 16, generator=g), torch.randn(100, 16, generator=g)
    t = torch.randint(0, 100, (64,), generator=g)
    want = F.cross_entropy(x @ w.T, t)
    results = results_of_threads(lambda: linear_cross_entropy(x, w, t), threads=4, steps=20)
    assert all(torch.allclose(r, want, rtol=1e-5, atol=1e-6) for r in results)
