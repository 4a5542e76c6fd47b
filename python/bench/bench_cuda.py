"""flatpeak.torch against torch itself on one CUDA GPU, in one run; writes its section of docs/gpu.md.

    python python/bench/bench_cuda.py                            # the shapes below, printed
    python python/bench/bench_cuda.py --markdown docs/gpu.md     # ...and its section written there
    python python/bench/bench_cuda.py --device cpu --quick       # small shapes: check it runs

    python python/bench/bench_cuda.py --profile                  # flatpeak's calls once each (for ncu)

linear_cross_entropy (forward + backward, mean loss): flatpeak's CUDA path against
``F.cross_entropy(F.linear(x, w).float(), t)`` eager and ``torch.compile``'d and, where this
torch has it, ``F.linear_cross_entropy``. moe_swiglu on one GPU (``group=None``: every expert
local) against the loop a single-GPU user writes (rows sorted by expert, ``F.linear`` per expert,
weighted and summed per token) and a grouped-GEMM layer written as torchtitan's
``GroupedExperts`` (``torch._grouped_mm`` over the rows sorted by expert, each expert's group
padded to 16 rows), forward + backward of ``y.square().mean()``. A variant this torch or device
cannot run is listed with why. Times: CUDA events around each
call, the median of the repetitions after warm-ups; the variants alternate, repetition by
repetition. Peak: ``torch.cuda.max_memory_allocated()`` during one call above what was allocated
before it, the inputs with no gradients (each call starts without the previous one's): the
call's working set and the gradients it makes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

BEGIN, END = "<!-- bench_cuda.py: begin -->", "<!-- bench_cuda.py: end -->"


def timed(device: str, fn: Callable[[], None]) -> float:
    """Seconds of one call of ``fn`` (CUDA events on a GPU)."""
    if device == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3
    import time

    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_bytes(device: str, fn: Callable[[], None], clear: Callable[[], None]) -> int:
    """The device memory one call of ``fn`` takes above what is allocated before it, its inputs'
    gradients cleared first (0 on a CPU)."""
    clear()
    if device != "cuda":
        fn()
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def compare(device: str, case, reps: int, warmups: int = 2):
    """{name: (median seconds, peak bytes)} of ``case`` (its variants and the function that
    clears its inputs' gradients), the variants alternating repetition by repetition, each call
    starting without gradients."""
    variants, clear = case
    failed: Dict[str, str] = {}
    for name, fn in list(variants.items()):
        try:
            for _ in range(warmups):
                clear()
                fn()
        except Exception as e:  # noqa: BLE001 - a baseline this torch or device cannot run
            if name == "flatpeak":
                raise
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            del variants[name]
    peaks = {name: peak_bytes(device, fn, clear) for name, fn in variants.items()}
    times: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            clear()
            times[name].append(timed(device, fn))
    results = {name: (statistics.median(times[name]), peaks[name]) for name in variants}
    return results, failed


def lce_variants(device: str, dtype: torch.dtype, n: int, d: int, v: int):
    from flatpeak.torch import linear_cross_entropy

    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(n, d, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(device)

    def run(loss_fn):
        return lambda: loss_fn().backward()

    def clear():
        x.grad, w.grad = None, None

    def eager():
        return F.cross_entropy(F.linear(x, w).float(), t)

    variants = {
        "flatpeak": run(lambda: linear_cross_entropy(x, w, t)),
        "torch_ce": run(eager),
        "torch_ce_compiled": run(torch.compile(eager)),
    }
    if hasattr(F, "linear_cross_entropy"):
        variants["torch_lce"] = run(lambda: F.linear_cross_entropy(x, w, t))
    return variants, clear


def moe_problem(device: str, dtype: torch.dtype, shape: Tuple[int, int, int, int, int]):
    t, h, i, e, k = shape
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    # A router's choice: the top k of random scores, k distinct experts a token.
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(device)
    w = torch.rand(t, k, generator=g).to(device, dtype)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(device, dtype)
    down = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(device, dtype)
    return [p.requires_grad_() if p.is_floating_point() else p for p in (x, ids, w, gate_up, down)]


def moe_loop(x, ids, w, gate_up, down):
    """The single-GPU experts as users write them: rows sorted by expert, one F.linear pair each."""
    e, inter, k = gate_up.shape[0], gate_up.shape[1] // 2, ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=e).tolist()
    rows = x[token]
    outs, start = [], 0
    for expert, count in enumerate(counts):
        pre = F.linear(rows[start:start + count], gate_up[expert])
        outs.append(F.linear(F.silu(pre[:, :inter]) * pre[:, inter:], down[expert]))
        start += count
    weighted = torch.cat(outs) * w.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, token, weighted)


def moe_grouped(x, ids, w, gate_up, down, align: int = 16):
    """torchtitan's ``GroupedExperts`` on our layout: the routes sorted by expert into groups
    padded to ``align`` rows, one ``torch._grouped_mm`` per projection, weighted and summed per
    token."""
    e, inter, k = gate_up.shape[0], gate_up.shape[1] // 2, ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token, expert = order // k, flat[order]
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    rank = torch.arange(order.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
    pos = (ends - padded)[expert] + rank
    rows = x.new_zeros(int(ends[-1]), x.shape[1])
    rows[pos] = x[token]
    offs = ends.to(torch.int32)
    pre = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs)
    act = F.silu(pre[:, :inter]) * pre[:, inter:]
    out = torch._grouped_mm(act, down.transpose(-2, -1), offs=offs)
    weighted = out[pos] * w.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, token, weighted)


def moe_variants(device: str, dtype: torch.dtype, shape):
    from flatpeak.torch import moe_swiglu

    x, ids, w, gate_up, down = moe_problem(device, dtype, shape)

    def run(layer):
        return lambda: layer().square().mean().backward()

    def clear():
        for p in (x, w, gate_up, down):
            p.grad = None

    # llep's device buffers are carved from a tensor of torch's caching allocator: the peak torch
    # reports is the layer's whole working set.
    return {
        "flatpeak": run(lambda: moe_swiglu(x, ids, w, gate_up, down)),
        "torch_loop": run(lambda: moe_loop(x, ids, w, gate_up, down)),
        "torch_grouped_mm": run(lambda: moe_grouped(x, ids, w, gate_up, down)),
    }, clear


def mib(b: int) -> str:
    return f"{b / 2**20:.0f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small shapes: check the script runs")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--markdown", metavar="PATH", help="write the section into PATH (between its markers)")
    parser.add_argument("--profile", action="store_true",
                        help="run flatpeak's variant of each case once and nothing else (under a profiler)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py: no CUDA device here (--device cpu --quick checks the script)")
    lce_shapes = [(256, 64, 1000)] if args.quick else [(8192, 1024, 32768), (16384, 4096, 131072)]
    moe_shape = (64, 32, 16, 8, 2) if args.quick else (8192, 2048, 1024, 64, 8)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [BEGIN, "", f"`python python/bench/bench_cuda.py --markdown docs/gpu.md` on one {machine}, "
             f"torch {torch.__version__}; median of {args.reps} after warm-ups, the variants alternating; "
             "peak: above the inputs, the call's gradients included.", ""]
    lines += ["| call | dtype | shape | variant | time | peak above inputs | flatpeak's speed-up |",
              "|---|---|---|---|---|---|---|"]
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, d, v in lce_shapes:
            if dtype == torch.float32 and n * v > 8192 * 32768:
                continue  # f32 without TF32 at the large shape: minutes of device time for one row
            cases.append(("linear_cross_entropy", dtype, f"N={n} D={d} V={v}",
                          lambda dtype=dtype, n=n, d=d, v=v: lce_variants(args.device, dtype, n, d, v)))
        t, h, i, e, k = moe_shape
        cases.append(("moe_swiglu", dtype, f"T={t} H={h} I={i} E={e} k={k}",
                      lambda dtype=dtype: moe_variants(args.device, dtype, moe_shape)))
    if args.profile:
        for call, dtype, shape, make in cases:
            variants, clear = make()
            variants["flatpeak"]()
            if args.device == "cuda":
                torch.cuda.synchronize()
            print(f"profiled {call} {dtype} {shape}", flush=True)
        return 0
    for call, dtype, shape, make in cases:
        case = make()
        results, failed = compare(args.device, case, args.reps)
        ours = results["flatpeak"][0]
        label = f"| `{call}` | {str(dtype).removeprefix('torch.')} | {shape} |"
        for name, (seconds, peak) in results.items():
            speedup = "" if name == "flatpeak" else f"{seconds / ours:.2f}×"
            lines.append(f"{label} {name} | {seconds * 1e3:.2f} ms | {mib(peak)} | {speedup} |")
            print(lines[-1], flush=True)
        for name, why in failed.items():
            lines.append(f"{label} {name} | not run: {why} | | |")
            print(lines[-1], flush=True)
        del case
        if args.device == "cuda":
            torch.cuda.empty_cache()
    lines += ["", END]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.markdown:
        try:
            with open(args.markdown) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            text = head + section.rstrip("\n") + rest.split(END, 1)[1]
        else:
            text = text + ("\n" if text else "") + section
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
