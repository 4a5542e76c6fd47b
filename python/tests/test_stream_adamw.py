"""flatpeak.torch.StreamAdamW against torch.optim.AdamW(foreach=False) itself."""

import copy

import pytest
import torch

from flatpeak.torch import StreamAdamW

STEPS = 20


def rel(a, b):
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 29, generator=g), torch.randn(1003, generator=g), torch.randn(5, 3, 7, generator=g)]


def groups_of(params, amsgrad, maximize):
    return [
        {"params": params[:2], "weight_decay": 0.05, "amsgrad": amsgrad, "maximize": maximize},
        {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0,
         "amsgrad": amsgrad, "maximize": maximize},
    ]


def set_grads(params, step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * (0.1 + step * 0.05)).to(p.device, p.dtype)


def compare_state(ours, theirs, params_ours, params_theirs):
    """Max relative error over parameters and every state tensor; also whether all are bitwise equal."""
    worst, bitwise = 0.0, True
    for po, pt in zip(params_ours, params_theirs):
        worst = max(worst, rel(po, pt))
        bitwise &= torch.equal(po, pt)
        so, st = ours.state[po], theirs.state[pt]
        assert so["step"].item() == st["step"].item()
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert (key in so) == (key in st), key
            if key in so:
                worst = max(worst, rel(so[key], st[key]))
                bitwise &= torch.equal(so[key], st[key])
    return worst, bitwise


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_torch_adamw_over_20_steps_with_a_schedule(amsgrad, maximize):
    ours_p, theirs_p = make_params(0), make_params(0)
    ours = StreamAdamW(groups_of(ours_p, amsgrad, maximize), lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(groups_of(theirs_p, amsgrad, maximize), lr=1e-2, weight_decay=0.1, foreach=False)
    schedule = lambda step: 1.0 / (1 + 0.3 * step)  # noqa: E731
    sched_ours = torch.optim.lr_scheduler.LambdaLR(ours, schedule)
    sched_theirs = torch.optim.lr_scheduler.LambdaLR(theirs, schedule)
    for step in range(STEPS):
        set_grads(ours_p, step)
        set_grads(theirs_p, step)
        assert ours.step() is None  # torch's convention: the closure's loss, None without one
        theirs.step()
        sched_ours.step()
        sched_theirs.step()
        assert not ours.last_step_skipped
        # Not bitwise: torch's CPU kernels fuse some multiply-adds (see stream-adamw's cpu.rs);
        # python/bench/bench_torch.py measures how far apart the two end up.
        worst, _ = compare_state(ours, theirs, ours_p, theirs_p)
        assert worst <= 1e-6, f"step {step}: {worst}"
    assert ours.param_groups[1]["lr"] == theirs.param_groups[1]["lr"]


def test_one_cycle_lr_drives_it():
    params = make_params(1)
    opt = StreamAdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    lrs = []
    for step in range(10):
        set_grads(params, step)
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert len(set(lrs)) > 5


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_round_trips_both_ways(amsgrad):
    # torch -> flatpeak: load torch's state after 5 steps, continue both 5 more.
    ours_p, theirs_p = make_params(2), make_params(2)
    theirs = torch.optim.AdamW(groups_of(theirs_p, amsgrad, False), lr=1e-2, foreach=False)
    for step in range(5):
        set_grads(theirs_p, step)
        theirs.step()
    with torch.no_grad():
        for po, pt in zip(ours_p, theirs_p):
            po.copy_(pt)
    ours = StreamAdamW(groups_of(ours_p, amsgrad, False), lr=1e-2)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for step in range(5, 10):
        set_grads(ours_p, step)
        set_grads(theirs_p, step)
        ours.step()
        theirs.step()
    worst, _ = compare_state(ours, theirs, ours_p, theirs_p)
    assert worst <= 1e-6

    # flatpeak -> torch: a fresh torch AdamW loads ours and continues identically.
    again_p = [p.detach().clone() for p in ours_p]
    again = torch.optim.AdamW(groups_of(again_p, amsgrad, False), lr=1e-2, foreach=False)
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    for step in range(10, 13):
        set_grads(ours_p, step)
        set_grads(again_p, step)
        ours.step()
        again.step()
    worst, _ = compare_state(ours, again, ours_p, again_p)
    assert worst <= 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_gradient_skips_the_step_and_touches_nothing(bad):
    params = make_params(3)
    opt = StreamAdamW(groups_of(params, True, False), lr=1e-2)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    before_params = [p.detach().clone() for p in params]
    before_state = copy.deepcopy(opt.state_dict())
    set_grads(params, 3)
    params[2].grad[1, 2, 3] = bad  # in the second group: the first must not have moved either
    assert opt.step() is None
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(params, before_params))
    after = opt.state_dict()
    for key, state in before_state["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after["state"][key][name]), name
    set_grads(params, 4)
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1


def test_closure_loss_is_returned():
    w = torch.nn.Parameter(torch.ones(4))
    opt = StreamAdamW([w])

    def closure():
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    theirs_w = torch.nn.Parameter(torch.ones(4))
    theirs = torch.optim.AdamW([theirs_w])

    def theirs_closure():
        theirs.zero_grad()
        loss = (theirs_w * theirs_w).sum()
        loss.backward()
        return loss

    # The closure's loss itself, as torch.optim.AdamW returns it.
    ours_loss, theirs_loss = opt.step(closure), theirs.step(theirs_closure)
    assert isinstance(ours_loss, torch.Tensor) and type(ours_loss) is type(theirs_loss)
    assert ours_loss.item() == theirs_loss.item() == 4.0 and not opt.last_step_skipped


def test_an_integer_step_in_a_state_dict_loads_as_torch_adamw_loads_it():
    """Older torch checkpoints keep ``step`` as a Python number; torch.optim.AdamW loads them."""
    ours_p, theirs_p = make_params(2), make_params(2)
    ours = StreamAdamW(groups_of(ours_p, False, False), lr=1e-2)
    theirs = torch.optim.AdamW(groups_of(theirs_p, False, False), lr=1e-2, foreach=False)
    for opt, params in ((ours, ours_p), (theirs, theirs_p)):
        set_grads(params, 0)
        opt.step()
        sd = copy.deepcopy(opt.state_dict())
        for state in sd["state"].values():
            state["step"] = int(state["step"].item())
        opt.load_state_dict(sd)
    for step in (1, 2):
        set_grads(ours_p, step)
        set_grads(theirs_p, step)
        ours.step()
        theirs.step()
    worst, _ = compare_state(ours, theirs, ours_p, theirs_p)
    assert worst <= 1e-6
    assert all(ours.state[p]["step"].item() == 3.0 for p in ours_p)


def test_step_counters_advance_in_place_in_either_scalar_dtype():
    """The step counter is torch's ``state["step"]`` tensor, advanced by the step itself: float32,
    or float64 when torch's default dtype is (as torch.optim makes it)."""
    for dtype in (torch.float32, torch.float64):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            p = torch.nn.Parameter(torch.ones(4, dtype=torch.float32))
            opt = StreamAdamW([p], lr=1e-2)
            for _ in range(3):
                p.grad = torch.full((4,), 0.5, dtype=torch.float32)
                opt.step()
            counter = opt.state[p]["step"]
            assert counter.dtype == dtype and counter.item() == 3.0
        finally:
            torch.set_default_dtype(previous)


@pytest.mark.parametrize("value", [1.5, -1.0, float("nan")])
def test_a_step_counter_that_is_not_a_whole_count_is_a_value_error(value):
    p = torch.nn.Parameter(torch.ones(4))
    opt = StreamAdamW([p], lr=1e-2)
    p.grad = torch.ones(4)
    opt.step()
    before = p.detach().clone()
    opt.state[p]["step"].fill_(value)
    with pytest.raises(ValueError, match="step"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_one_step_counter_shared_by_two_parameters_is_refused_untouched():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = StreamAdamW([a, b], lr=1e-2)
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    opt.step()
    opt.state[b]["step"] = opt.state[a]["step"]
    before = (a.detach().clone(), b.detach().clone(), opt.state[a]["step"].item())
    with pytest.raises(ValueError, match="step"):
        opt.step()
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
    assert opt.state[a]["step"].item() == before[2]


def test_many_parameters_in_one_step_equal_torch():
    """Many small parameters take one parallel pass: each must still match torch's update."""
    g = torch.Generator().manual_seed(3)
    ours_p = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1, 7, 64, 1000, 40000) * 20]
    theirs_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = StreamAdamW(ours_p, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(theirs_p, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for a, b in zip(ours_p, theirs_p):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    worst = max(rel(a.detach(), b.detach()) for a, b in zip(ours_p, theirs_p))
    assert worst <= 1e-6
    assert all(ours.state[p]["step"].item() == 3.0 for p in ours_p)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_bf16_parameters_step_an_fp32_master_copy(amsgrad):
    """bfloat16 parameters keep a float32 master copy and float32 moments: the master follows
    torch's AdamW on float32 parameters fed the same (widened) gradients, each parameter is its
    master rounded to bfloat16, a non-finite gradient skips the step touching neither, and the
    state (the master included) round-trips through state_dict in float32."""
    ours_p = [p.to(torch.bfloat16) for p in make_params(5)]
    theirs_p = [p.float() for p in ours_p]
    ours = StreamAdamW(groups_of(ours_p, amsgrad, False), lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(groups_of(theirs_p, amsgrad, False), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(STEPS):
        set_grads(ours_p, step)
        for po, pt in zip(ours_p, theirs_p):
            pt.grad = po.grad.float()
        ours.step()
        theirs.step()
        assert not ours.last_step_skipped
        for po, pt in zip(ours_p, theirs_p):
            state = ours.state[po]
            assert state["master_param"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
            assert rel(state["master_param"], pt) <= 1e-6, step
            assert torch.equal(po, state["master_param"].to(torch.bfloat16))
    # A NaN gradient skips the step: parameters, masters and moments untouched.
    keys = ("master_param", "exp_avg", "exp_avg_sq")
    before = [(p.clone(), {k: ours.state[p][k].clone() for k in keys}) for p in ours_p]
    set_grads(ours_p, 99)
    ours_p[1].grad[3] = float("nan")
    ours.step()
    assert ours.last_step_skipped
    for p, (param_before, state_before) in zip(ours_p, before):
        assert torch.equal(p, param_before)
        assert all(torch.equal(ours.state[p][k], v) for k, v in state_before.items())
    # The state round-trips in float32 (torch's loading would cast it to bfloat16).
    again_p = [p.detach().clone() for p in ours_p]
    again = StreamAdamW(groups_of(again_p, amsgrad, False), lr=1e-2, weight_decay=0.1)
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    for p, q in zip(ours_p, again_p):
        for key in keys:
            assert again.state[q][key].dtype == torch.float32
            assert torch.equal(again.state[q][key], ours.state[p][key]), key
    set_grads(ours_p, 100)
    for p, q in zip(ours_p, again_p):
        q.grad = p.grad.clone()
    ours.step()
    again.step()
    assert all(torch.equal(p, q) for p, q in zip(ours_p, again_p))


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_max_norm_clips_as_clip_grad_norm_then_adamw(max_norm):
    """``max_norm`` (the global norm over both groups) equals ``clip_grad_norm_`` followed by
    torch's AdamW, leaves the gradients as they were, and reports the norm it returns; a bound
    above the norm clips nothing."""
    ours_p, theirs_p = make_params(7), make_params(7)
    ours = StreamAdamW(groups_of(ours_p, False, False), lr=1e-2, max_norm=max_norm)
    theirs = torch.optim.AdamW(groups_of(theirs_p, False, False), lr=1e-2, foreach=False)
    for step in range(STEPS):
        set_grads(ours_p, step)
        set_grads(theirs_p, step)
        grads_before = [p.grad.clone() for p in ours_p]
        ours.step()
        norm = torch.nn.utils.clip_grad_norm_(theirs_p, max_norm, foreach=False)
        theirs.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours_p, grads_before))
        assert ours.last_grad_norm == pytest.approx(norm.item(), rel=1e-6)
        worst, _ = compare_state(ours, theirs, ours_p, theirs_p)
        assert worst <= 1e-6, f"step {step}: {worst}"
    clipped = max_norm < norm.item()
    assert clipped == (max_norm == 0.5)
    # The clipping is this run's setting, not state: a state dict has torch's AdamW's keys and no
    # max_norm (so torch.distributed.checkpoint loads either optimizer's into the other), and
    # loading one keeps the live setting.
    sd = ours.state_dict()
    torch_keys = set(torch.optim.AdamW(make_params(7)).state_dict()["param_groups"][0])
    assert all(set(g) == torch_keys for g in sd["param_groups"]), sd["param_groups"]
    for kept in (None, 3.0):
        again = StreamAdamW(groups_of([p.detach().clone() for p in ours_p], False, False), lr=1e-2, max_norm=kept)
        again.load_state_dict(copy.deepcopy(sd))
        assert [g["max_norm"] for g in again.param_groups] == [kept, kept]
    torch.optim.AdamW(groups_of(make_params(7), False, False)).load_state_dict(copy.deepcopy(sd))


def test_max_norm_that_differs_between_groups_or_is_not_positive_is_refused_untouched():
    params = make_params(8)
    groups = groups_of(params, False, False)
    groups[1]["max_norm"] = 2.0
    opt = StreamAdamW(groups, lr=1e-2, max_norm=1.0)
    set_grads(params, 0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="clip"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    # The state made for the first step is a fresh one: no step was taken.
    assert all(s["step"].item() == 0 and not s["exp_avg"].any() for s in opt.state.values())
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_norm"):
            StreamAdamW([torch.nn.Parameter(torch.ones(3))], max_norm=bad)


def test_a_non_finite_gradient_skips_a_clipped_step_too():
    params = make_params(9)
    opt = StreamAdamW(params, lr=1e-2, max_norm=1.0)
    set_grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    set_grads(params, 1)
    params[0].grad[3, 4] = float("nan")
    opt.step()
    assert opt.last_step_skipped and not torch.isfinite(torch.tensor(opt.last_grad_norm))
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.999)}, "beta1"), ({"eps": 0.0}, "eps"),
    ({"weight_decay": float("nan")}, "weight_decay"),
])
def test_bad_hyperparameters_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamAdamW([torch.nn.Parameter(torch.ones(3))], **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"on_nonfinite": "check"}, "on_nonfinite"), ({"threads": 0}, "threads"), ({"threads": 1.5}, "threads"),
    ({"threads": True}, "threads"),
])
def test_bad_step_options_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamAdamW([torch.nn.Parameter(torch.ones(3))], **kwargs)


def test_any_thread_count_steps_bitwise_alike():
    runs = []
    for threads in (None, 1, 2, 3):
        params = make_params(5)
        opt = StreamAdamW(groups_of(params, False, False), lr=1e-2, max_norm=1.0, threads=threads)
        for step in range(3):
            set_grads(params, step)
            opt.step()
        runs.append(params)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


def test_on_nonfinite_raise_raises_and_touches_nothing():
    params = make_params(4)
    opt = StreamAdamW(groups_of(params, False, False), lr=1e-2, on_nonfinite="raise")
    set_grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    set_grads(params, 1)
    params[1].grad[7] = float("nan")
    with pytest.raises(RuntimeError, match="not finite on rank 0"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)
    assert not opt.last_step_skipped and opt.skipped_steps == 0


def test_on_nonfinite_ignore_updates_as_torch_adamw_does():
    """No statistics pass without clipping: a NaN reaches the elements whose gradients hold it,
    as in torch's AdamW; with clipping the norm is read and a non-finite one skips."""
    ours_p, theirs_p = make_params(6), make_params(6)
    ours = StreamAdamW(groups_of(ours_p, False, False), lr=1e-2, on_nonfinite="ignore")
    theirs = torch.optim.AdamW(groups_of(theirs_p, False, False), lr=1e-2, foreach=False)
    for step in range(3):
        set_grads(ours_p, step)
        set_grads(theirs_p, step)
        if step == 1:
            ours_p[1].grad[7] = theirs_p[1].grad[7] = float("nan")
        ours.step()
        theirs.step()
        assert not ours.last_step_skipped and ours.last_grad_norm != ours.last_grad_norm  # NaN: not read
    assert ours.skipped_steps == 0
    for a, b in zip(ours_p, theirs_p):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert ours_p[1][7].isnan() and int(ours_p[1].isnan().sum()) == 1
    clipped = make_params(6)
    opt = StreamAdamW(clipped, lr=1e-2, max_norm=1.0, on_nonfinite="ignore")
    set_grads(clipped, 0)
    clipped[0].grad[3, 4] = float("inf")
    before = [p.detach().clone() for p in clipped]
    opt.step()
    assert opt.last_step_skipped and all(torch.equal(p, b) for p, b in zip(clipped, before))


CUDA = torch.cuda.is_available() and __import__("flatpeak").cuda_built()


@pytest.mark.skipif(not CUDA, reason="needs a GPU and the cuda build")
@pytest.mark.parametrize("amsgrad", [False, True])
def test_offloaded_cuda_step_matches_torch_adamw_on_the_gpu(amsgrad):
    ours_p = [p.cuda() for p in make_params(4)]
    theirs_p = [p.cuda() for p in make_params(4)]
    ours = StreamAdamW(groups_of(ours_p, amsgrad, False), lr=1e-2, weight_decay=0.1)
    ours.bucket_elems = 256  # several buckets per parameter
    theirs = torch.optim.AdamW(groups_of(theirs_p, amsgrad, False), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(STEPS):
        set_grads(ours_p, step)
        set_grads(theirs_p, step)
        ours.step()
        assert not ours.last_step_skipped
        theirs.step()
        for po, pt in zip(ours_p, theirs_p):
            assert rel(po, pt) <= 1e-6, step
    # state_dict round-trips into torch's AdamW.
    again_p = [p.detach().clone() for p in ours_p]
    again = torch.optim.AdamW(groups_of(again_p, amsgrad, False), lr=1e-2, foreach=False)
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    for q, t in zip(again_p, theirs_p):
        assert rel(again.state[q]["exp_avg"], theirs.state[t]["exp_avg"]) <= 1e-6
    # The live state names every offloaded key (placeholders), as loaders that read them expect.
    keys = {"step", "exp_avg", "exp_avg_sq", "master_param"} | ({"max_exp_avg_sq"} if amsgrad else set())
    assert all(set(ours.state[p]) == keys for p in ours_p), [set(ours.state[p]) for p in ours_p]
    # A non-finite gradient skips the step on the device too.
    before = [p.detach().clone() for p in ours_p]
    set_grads(ours_p, 99)
    ours_p[0].grad[0, 0] = float("nan")
    ours.step()
    assert ours.last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(ours_p, before))


@pytest.mark.skipif(not CUDA, reason="needs a GPU and the cuda build")
def test_offloaded_cuda_step_clips_as_clip_grad_norm_on_the_gpu():
    """max_norm on offloaded CUDA parameters and a CPU one in the same step: the norm over all of
    them clips every one, as ``clip_grad_norm_`` + torch's AdamW does."""
    def params():
        p = make_params(10)
        return [p[0].cuda(), p[1], p[2].cuda()]
    ours_p, theirs_p = params(), params()
    ours = StreamAdamW(ours_p, lr=1e-2, max_norm=0.5)
    ours.bucket_elems = 256
    theirs = torch.optim.AdamW(theirs_p, lr=1e-2, foreach=False)
    for step in range(5):
        set_grads(ours_p, step)
        set_grads(theirs_p, step)
        ours.step()
        norm = torch.nn.utils.clip_grad_norm_(theirs_p, 0.5, foreach=False)
        theirs.step()
        assert ours.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)
        for po, pt in zip(ours_p, theirs_p):
            assert rel(po.cpu(), pt.cpu()) <= 1e-6, step
