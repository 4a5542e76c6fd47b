"""flatpeak.torch against torch itself, on the CPU, in one run; prints the README's PyTorch tables.

    python python/bench/bench_torch.py                # the full shapes (takes a while)
    python python/bench/bench_torch.py --markdown docs/torch.md   # ...and write docs/torch.md
    python python/bench/bench_torch.py --quick        # small shapes, to check the script runs

linear_cross_entropy: each variant runs in its own process (peak RSS is a high-water mark), at
N x D x V with f32 and bf16 inputs; its peak is the RSS high-water mark above the RSS once the
inputs exist; its time the fastest of the repetitions of forward + backward. The variants run in
turn, in rounds, so the machine's slow spells fall on all of them alike. "crate" is
ring-dtp called directly from Rust the same way (`ring-dtp/examples/direct_call.rs`).

StreamAdamW: GB/s of `step()` at 28 B/param against torch.optim.AdamW(fused=True) and
(foreach=True), and how far it ends from AdamW(foreach=False) after 20 steps.
"""

import argparse
import contextlib
import io
import os
import resource
import subprocess
import sys
import time

# Rounds of the linear_cross_entropy variants (see bench_lce).
ROUNDS = 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LCE_VARIANTS = ["flatpeak", "torch_ce", "torch_lce", "torch_lce_chunked"]
LABELS = {
    "flatpeak": "`flatpeak.torch.linear_cross_entropy`",
    "torch_ce": "`F.cross_entropy(F.linear(x, w), t)`",
    "torch_lce": "`F.linear_cross_entropy(x, w, t)` (reference path)",
    "torch_lce_chunked": "`F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())` (chunked)",
}


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss():
    """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS: what making the inputs
    allocated and freed (a float32 copy of a bfloat16 weight, a scaled temporary) must not stand
    in for the call's own peak. Returns False where the kernel refuses it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes():
    """VmHWM: the peak RSS since the last reset_peak_rss()."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def max_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lce_child(variant, dtype_name, n, d, v, reps):
    import torch
    import torch.nn.functional as F
    from flatpeak.torch import linear_cross_entropy

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, d, generator=g)).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.05).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    if variant == "flatpeak":
        fn = lambda: linear_cross_entropy(x, w, t)  # noqa: E731
    elif variant == "torch_ce":
        fn = lambda: F.cross_entropy(F.linear(x, w), t)  # noqa: E731
    elif variant == "torch_lce":
        fn = lambda: F.linear_cross_entropy(x, w, t)  # noqa: E731
    else:
        opts = torch.nn.LinearCrossEntropyOptions()
        fn = lambda: F.linear_cross_entropy(x, w, t, options=opts)  # noqa: E731
    # One tiny call first: the first call of each path imports and registers what it needs
    # (torch.library, the dispatcher's caches), which is not the call's own memory.
    xs, ws = x[:8].detach().clone().requires_grad_(), w[:64].detach().clone().requires_grad_()
    ts = t[:8] % 64
    if variant == "flatpeak":
        linear_cross_entropy(xs, ws, ts).backward()
    elif variant == "torch_ce":
        F.cross_entropy(F.linear(xs, ws), ts).backward()
    elif variant == "torch_lce":
        F.linear_cross_entropy(xs, ws, ts).backward()
    else:
        F.linear_cross_entropy(xs, ws, ts, options=opts).backward()
    # The peak counts from the RSS once the inputs exist: the kernel's peak mark is reset there
    # (without the reset, the peak of making the inputs hides any smaller one of the call).
    if reset_peak_rss():
        base, peak_of = rss_bytes(), peak_rss_bytes
    else:
        base, peak_of = max(rss_bytes(), max_rss_bytes()), max_rss_bytes
    best = float("inf")
    for _ in range(reps):
        x.grad = w.grad = None
        start = time.perf_counter()
        fn().backward()
        best = min(best, time.perf_counter() - start)
    peak = peak_of() - base
    print(f"{peak} {best}")


def run_child(args):
    out = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], check=True, capture_output=True,
                         text=True).stdout.split()
    return int(out[0]), float(out[1])


def crate_direct(n, d, v, dtype_name, reps):
    from flatpeak import _flatpeak
    cmd = ["cargo", "run", "--quiet", "--release", "--locked", "-p", "ring-dtp", "--example", "direct_call", "--",
           str(n), str(d), str(v), dtype_name, str(reps), str(_flatpeak.DEFAULT_BUDGET_BYTES)]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip())


def bench_lce(n, d, v, reps, rounds):
    print(f"#### `linear_cross_entropy`, N = {n}, D = {d}, V = {v}, CPU, forward + backward\n")
    print("| dtype | call | peak above inputs (MiB) | flatpeak's peak / this one's | time (s) | flatpeak's time / this one's |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype_name in ["f32", "bf16"]:
        # Rounds of every variant in turn, each in a fresh process: a slow spell of the machine
        # then lands on all of them alike, not on whichever happened to run in it. A variant's
        # peak is its largest over the rounds, its time its fastest.
        results = {}
        for _ in range(rounds):
            for var in LCE_VARIANTS:
                peak, secs = run_child([var, dtype_name, n, d, v, reps])
                old_peak, old_secs = results.get(var, (0, float("inf")))
                results[var] = (max(peak, old_peak), min(secs, old_secs))
        ours_peak, ours_time = results["flatpeak"]
        for var in LCE_VARIANTS:
            peak, secs = results[var]
            print(f"| {dtype_name} | {LABELS[var]} | {peak / 2**20:.0f} | {ours_peak / max(peak, 1):.3f} | "
                  f"{secs:.2f} | {ours_time / secs:.2f} |")
        direct = crate_direct(n, d, v, dtype_name, reps * rounds)
        print(f"| {dtype_name} | ring-dtp called from Rust (`direct_call`) | | | {direct:.2f} | "
              f"{ours_time / direct:.3f} |")
    print()


def bench_adamw(n, steps):
    import torch
    from flatpeak.torch import StreamAdamW

    print(f"#### `StreamAdamW.step()`, {n / 2**20:.0f}M fp32 CPU parameters, 28 B/param\n")
    print("| optimizer | step (ms) | GB/s |")
    print("|---|---:|---:|")
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g) * 1e-2
    makers = [
        ("`flatpeak.torch.StreamAdamW`", lambda p: StreamAdamW([p], lr=1e-3)),
        ("`torch.optim.AdamW(fused=True)`", lambda p: torch.optim.AdamW([p], lr=1e-3, fused=True)),
        ("`torch.optim.AdamW(foreach=True)`", lambda p: torch.optim.AdamW([p], lr=1e-3, foreach=True)),
    ]
    for name, make in makers:
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.grad = grad
        opt = make(p)
        best = float("inf")
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
        print(f"| {name} | {best * 1e3:.1f} | {28 * n / best / 1e9:.2f} |")
        del opt, p
    print()

    # Against AdamW(foreach=False), 20 steps with weight decay and amsgrad.
    m = 1 << 20
    a, b = torch.randn(m, generator=g), None
    b = a.clone()
    ours = StreamAdamW([a], lr=1e-2, weight_decay=0.1, amsgrad=True)
    theirs = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False)
    for step in range(20):
        a.grad = torch.randn(m, generator=g) * 0.1
        b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    equal = (a == b).double().mean().item()
    worst = ((a - b).abs().max() / b.abs().max()).item()
    print(f"After 20 steps (AMSGrad, weight decay 0.1, 1M parameters) against "
          f"`torch.optim.AdamW(foreach=False)`: {equal * 100:.1f}% of parameters bitwise equal, "
          f"max difference {worst:.1e} of max |θ|.\n")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        var, dtype_name, n, d, v, reps = sys.argv[2:]
        lce_child(var, dtype_name, int(n), int(d), int(v), int(reps))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes: check the script runs")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write what is printed, with the command and commit, to PATH")
    args = parser.parse_args()
    if args.markdown:
        out = io.StringIO()
        with contextlib.redirect_stdout(Tee(sys.stdout, out)):
            run(args)
        # The document (and the commit it names) before the file is opened: opening it for
        # writing truncates it, which `git describe --dirty` would see.
        text = document(out.getvalue())
        # The MoE section is bench_moe.py's, measured by it: kept as it is.
        begin, end = "<!-- bench_moe.py: begin -->", "<!-- bench_moe.py: end -->"
        old = open(args.markdown).read() if os.path.exists(args.markdown) else ""
        if begin in old and end in old:
            text = text.rstrip("\n") + "\n\n" + old[old.index(begin):old.index(end) + len(end)] + "\n"
        with open(args.markdown, "w") as f:
            f.write(text)
        print(f"wrote {args.markdown}", file=sys.stderr)
    else:
        run(args)


class Tee:
    """Writes to several streams at once."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def commit():
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not run from a git checkout)"


def document(printed):
    command = "python python/bench/bench_torch.py " + " ".join(sys.argv[1:])
    return ("# flatpeak.torch against torch: measured\n\n"
            "Generated by `python/bench/bench_torch.py`; do not edit by hand. To reproduce it, "
            "in a venv with torch and `pip install ./python`:\n\n"
            f"```sh\n{command}\n```\n\n- commit: `{commit()}`\n"
            "- peak: the RSS high-water mark above the RSS once the inputs exist (the kernel's peak mark "
            "reset there), each call in its "
            "own process; time: the fastest of the repetitions of forward + backward over "
            f"{ROUNDS} rounds of every variant in turn; a ratio below "
            "1 means flatpeak is smaller or faster; `direct_call` is ring-dtp called from Rust the "
            "same way (`ring-dtp/examples/direct_call.rs`), the binding's own cost.\n- " + printed)


def run(args):
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs\n")
    if args.quick:
        bench_lce(512, 64, 2003, 1, ROUNDS)
        bench_adamw(1 << 20, 2)
    else:
        bench_lce(8192, 1024, 32768, 2, ROUNDS)
        bench_adamw(64 << 20, 5)


if __name__ == "__main__":
    main()
