"""The CPU AdamW step side by side: flatpeak's StreamAdamW, torch.optim.AdamW(fused=True) and
DeepSpeed's DeepSpeedCPUAdam (when installed: `pip install deepspeed ninja`; its op builds on
first use), alternating step by step in one process so the machine's state falls on all three.

    python python/bench/bench_adamw.py                          # 64M and 1000 x 64K, 25 rounds
    python python/bench/bench_adamw.py --quick                  # small, to check the script runs
    python python/bench/bench_adamw.py --markdown docs/torch.md # ...and write its section there

Each optimizer steps its own copy of the parameters with the same gradients (1e-2 normal), one
step each per round in turn. The first table gives each optimizer's median step time and the GB/s
it moved at 28 B/param (read g, θ, m, v; write θ, m, v), and StreamAdamW's update pass alone (its
step without the gradient statistics pass: the part that bounds the offloaded pipeline). The
second compares step times round by round, each pair's ratio (above 1: flatpeak is faster) as its
median and spread (10th-90th percentile over rounds), contenders paired by what they guarantee:
without clipping, `StreamAdamW(on_nonfinite="ignore")` (no check, no statistics pass) against
torch's fused AdamW and DeepSpeed (neither checks), and `StreamAdamW` (a non-finite gradient skips
the step, touching nothing) against torch's fused step through a `GradScaler` (torch's way to skip
such a step) and, for the price of the check, against the unchecked two. With clipping, the
others run `clip_grad_norm_` before their step, as a torch user does, and StreamAdamW clips from
its own statistics pass (`max_norm=`). Then how far StreamAdamW ends from
`AdamW(foreach=False)` after 20 steps.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from typing import List

from _bench import emit, section_arguments

BYTES_PER_PARAM = 28
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- bench_adamw.py: begin -->", "<!-- bench_adamw.py: end -->"


def deepspeed_cpu_adam():
    """DeepSpeed's ``DeepSpeedCPUAdam`` when it is installed and its op builds; else None and why."""
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed logs to stdout
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            from deepspeed.ops.op_builder import CPUAdamBuilder
            CPUAdamBuilder().load(verbose=False)
        return DeepSpeedCPUAdam, None
    except Exception as e:  # noqa: BLE001 - any failure to import or build means "not measured"
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class ScaledFused:
    """torch's fused AdamW stepped through a ``GradScaler`` at scale 1: what a torch user runs to
    skip a step with a non-finite gradient, the guarantee StreamAdamW gives."""

    def __init__(self, params, **kw):
        import torch
        self.opt = torch.optim.AdamW(params, fused=True, **kw)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)
        self.scaler.scale(torch.ones(()))  # the scaler's state is made by its first scale()

    def step(self):
        self.scaler.step(self.opt)
        self.scaler.update()


class Clipped:
    """``clip_grad_norm_(params, max_norm)`` then ``opt.step()``."""

    def __init__(self, opt, params, max_norm):
        self.opt, self.params, self.max_norm = opt, params, max_norm

    def step(self):
        import torch
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.opt.step()


def size(elements):
    """``64M``, ``64K`` or the count."""
    for unit, shift in (("M", 20), ("K", 10)):
        if elements >= 1 << shift and elements % (1 << shift) == 0:
            return f"{elements >> shift}{unit}"
    return str(elements)


def percentile(values, q):
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def bench(n_params: int, numel: int, rounds: int, max_norm, out: List[str]) -> None:
    import torch

    from flatpeak.torch import StreamAdamW

    n = n_params * numel
    what = (f"one fp32 parameter of {size(n)}" if n_params == 1
            else f"{n_params} fp32 parameters of {size(numel)}")
    clipping = "no clipping" if max_norm is None else f"clipping the gradient norm to {max_norm}"
    ds_class, ds_missing = deepspeed_cpu_adam()
    kw = dict(lr=1e-3, weight_decay=0.01)
    clip = "" if max_norm is None else "`clip_grad_norm_` + "
    checked = "`StreamAdamW`" if max_norm is None else f"`StreamAdamW(max_norm={max_norm})`"
    unchecked = '`StreamAdamW(on_nonfinite="ignore")`'
    fused, ds = f"{clip}`AdamW(fused=True)`", f"{clip}DeepSpeed `DeepSpeedCPUAdam`"
    scaled = "`AdamW(fused=True)` + `GradScaler`"
    makers = [(checked, lambda ps: StreamAdamW(ps, max_norm=max_norm, **kw))]
    if max_norm is None:
        makers.append((unchecked, lambda ps: StreamAdamW(ps, on_nonfinite="ignore", **kw)))
    makers.append((fused, lambda ps: torch.optim.AdamW(ps, fused=True, **kw)))
    if ds_class is not None:
        makers.append((ds, lambda ps: ds_class(ps, adamw_mode=True, **kw)))
    if max_norm is None:
        makers.append((scaled, lambda ps: ScaledFused(ps, **kw)))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(n_params)]
    optimizers = []
    for name, make in makers:
        params = [torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(n_params)]
        for p, grad in zip(params, grads):
            p.grad = grad if max_norm is None else grad.clone()  # clip_grad_norm_ scales in place
        with contextlib.redirect_stdout(io.StringIO()):
            opt = make(params)
            opt.step()  # the state is made by the first step
        if max_norm is not None and name != checked:
            opt = Clipped(opt, params, max_norm)
        optimizers.append((name, opt))
    times = {name: [] for name, _ in optimizers}
    times["update"] = []
    for _ in range(rounds):
        for name, opt in optimizers:
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
            if name == checked:
                times["update"].append(opt.last_step_times["update"])
    out += [f"#### {what}, {clipping}", "", "| optimizer step | median (ms) | GB/s |", "|---|---:|---:|"]
    labels = {checked: checked + (" (skips a non-finite step)" if max_norm is None else ""),
              unchecked: unchecked + " (no check, as torch's and DeepSpeed's)",
              scaled: scaled + " (skips a non-finite step)",
              "update": f"{checked}'s update pass alone (its step without the statistics pass)"}
    for name in [name for name, _ in optimizers] + ["update"]:
        t = statistics.median(times[name])
        out.append(f"| {labels.get(name, name)} | {t * 1e3:.1f} | {BYTES_PER_PARAM * n / t / 1e9:.1f} |")
    out += ["", "| flatpeak | over | speed-up per round: median (p10-p90) |", "|---|---|---:|"]
    if max_norm is None:
        pairs = [(unchecked, fused, "the same guarantee: none"), (unchecked, ds, "the same guarantee: none"),
                 (checked, scaled, "the same guarantee: a non-finite step skipped"),
                 (checked, fused, "the exact skip's price"), (checked, ds, "the exact skip's price")]
        pairs.append(("update", ds, "the kernels alone"))
    else:
        pairs = [(checked, fused, ""), (checked, ds, "")]
    for ours, theirs, why in pairs:
        if theirs not in times:
            continue
        ratios = [t / o for o, t in zip(times[ours], times[theirs])]
        note = f" ({why})" if why else ""
        name = f"{checked}'s update pass" if ours == "update" else ours
        out.append(f"| {name} | {theirs}{note} | {statistics.median(ratios):.2f}× "
                   f"({percentile(ratios, 0.1):.2f}-{percentile(ratios, 0.9):.2f}) |")
    if ds_missing is not None:
        out += ["", f"DeepSpeed's `DeepSpeedCPUAdam` not measured: {ds_missing}."]
    out.append("")
    del optimizers


def agreement(out: List[str]) -> None:
    """How far StreamAdamW ends from ``torch.optim.AdamW(foreach=False)`` after 20 steps."""
    import torch

    from flatpeak.torch import StreamAdamW

    g = torch.Generator().manual_seed(1)
    m = 1 << 20
    a = torch.randn(m, generator=g)
    b = a.clone()
    ours = StreamAdamW([a], lr=1e-2, weight_decay=0.1, amsgrad=True)
    theirs = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False)
    for _ in range(20):
        a.grad = torch.randn(m, generator=g) * 0.1
        b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    equal = (a == b).double().mean().item()
    worst = ((a - b).abs().max() / b.abs().max()).item()
    out.append(f"After 20 steps (AMSGrad, weight decay 0.1, 1M parameters) against "
               f"`torch.optim.AdamW(foreach=False)`: {equal * 100:.1f}% of parameters bitwise equal, "
               f"max difference {worst:.1e} of max |θ|.")


def main():
    args = section_arguments(__doc__, rounds=25)
    import torch

    rounds = 3 if args.quick else args.rounds
    shapes = [(1, 1 << 16), (16, 1 << 12)] if args.quick else [(1, 64 << 20), (1000, 64 << 10)]
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [BEGIN, "", "#### The CPU AdamW step side by side: StreamAdamW, torch's fused AdamW, DeepSpeed's CPU Adam",
             "", f"Generated by `python/bench/bench_adamw.py{' --quick' if args.quick else ''} --markdown "
             "docs/torch.md`; do not edit by hand.", "",
             f"- commit: `{commit}`; torch {torch.__version__}; {os.cpu_count()} CPUs, {torch.get_num_threads()} "
             f"threads; {rounds} rounds, one step of each optimizer in turn per round (each on its own copy of "
             f"the parameters, the same gradients); GB/s at {BYTES_PER_PARAM} B/param; a ratio above 1: "
             "StreamAdamW is faster", ""]
    for n_params, numel in shapes:
        for max_norm in (None, 1.0):
            bench(n_params, numel, rounds, max_norm, lines)
    agreement(lines)
    emit(lines, BEGIN, END, args.markdown)


if __name__ == "__main__":
    main()
