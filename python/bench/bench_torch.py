"""flatpeak.torch's loss against torch itself, on the CPU, in one run; prints the README's PyTorch tables.

    python python/bench/bench_torch.py                # the full shapes (takes a while)
    python python/bench/bench_torch.py --markdown docs/torch.md   # ...and write docs/torch.md
    python python/bench/bench_torch.py --quick        # small shapes, to check the script runs

linear_cross_entropy: each variant runs in its own process (peak RSS is a high-water mark), at
N x D x V with f32 and bf16 inputs; its peak is the RSS high-water mark above the RSS once the
inputs exist; its time the fastest of the repetitions of forward + backward. The variants run in
turn, in rounds, so the machine's slow spells fall on all of them alike. "crate" is ring-dtp
called directly from Rust the same way (`ring-dtp/examples/direct_call.rs`), alternating with
the binding's call a few times a round.

The optimizer's comparison is `python/bench/bench_adamw.py`'s (its own section of docs/torch.md).
"""

import argparse
import contextlib
import io
import os
import re
import resource
import subprocess
import sys
import time

from _bench import peak_rss_bytes, reset_peak_rss, rss_bytes

# Rounds of the linear_cross_entropy variants (see bench_lce).
ROUNDS = 2
# Binding and crate calls side by side per round (each in a fresh process): see bench_lce.
BINDING_PAIRS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LCE_VARIANTS = ["flatpeak", "torch_ce", "torch_lce", "torch_lce_chunked", "cce"]
LABELS = {
    "flatpeak": "`flatpeak.torch.linear_cross_entropy`",
    "torch_ce": "`F.cross_entropy(F.linear(x, w), t)`",
    "torch_lce": "`F.linear_cross_entropy(x, w, t)` (reference path)",
    "torch_lce_chunked": "`F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())` (chunked)",
    "cce": "Cut Cross-Entropy `linear_cross_entropy(..., impl=\"torch_compile\")` (its non-Triton path)",
}


def cut_cross_entropy_missing():
    """Why Cut Cross-Entropy is not measured (None when it is): its Triton kernels need a GPU;
    its `torch_compile` implementation runs on a CPU (`pip install --no-deps cut-cross-entropy`:
    its declared dependencies are torch and triton, which torch's wheel brings)."""
    try:
        import cut_cross_entropy  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001 - not installed or not importable: not measured
        return f"{type(e).__name__}: {e}"








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
    elif variant == "cce":
        from cut_cross_entropy import linear_cross_entropy as cce
        fn = lambda: cce(x, w, t, impl="torch_compile")  # noqa: E731
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
    elif variant == "cce":
        # torch.compile specialises on the shape: the warm-up call is the full one, so the
        # compilation (its time and memory) is not counted.
        fn().backward()
        x.grad = w.grad = None
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
    # The crate's default budget on a CPU, as the binding's call takes it.
    cmd = ["cargo", "run", "--quiet", "--release", "--locked", "-p", "ring-dtp", "--example", "direct_call", "--",
           str(n), str(d), str(v), dtype_name, str(reps)]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip())


# A torch call whose GEMMs would take longer than this (at the probed bf16 GEMM rate) is not run.
LONGEST_TORCH_CALL_S = 600


def torch_gemm_gflops(dtype):
    """torch's GEMM rate in GFLOP/s for `dtype` on this CPU, from a 256x1024x1024 product (best
    of 3): CPUs without native bf16 (AVX512-BF16 or AMX) run torch's bf16 GEMM far slower."""
    import torch
    a, b = torch.randn(256, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 256 * 1024 * 1024 / best / 1e9


def bench_lce(n, d, v, reps, rounds):
    print(f"#### `linear_cross_entropy`, N = {n}, D = {d}, V = {v}, CPU, forward + backward\n")
    print("| dtype | call | peak above inputs (MiB) | flatpeak's peak / this one's | time (s) "
          "| flatpeak's time / this one's |")
    print("|---|---|---:|---:|---:|---:|")
    import torch

    cce_missing = cut_cross_entropy_missing()
    skipped = []
    for dtype_name in ["f32", "bf16"]:
        variants = [var for var in LCE_VARIANTS if var != "cce" or cce_missing is None]
        # Three GEMMs of 2·N·D·V each (forward logits, dX, dW) at torch's rate for this dtype.
        gflops = torch_gemm_gflops({"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name])
        estimate = 3 * 2 * n * d * v / gflops / 1e9
        if estimate > LONGEST_TORCH_CALL_S:
            variants = ["flatpeak"]
            skipped.append(f"torch's {dtype_name} calls not run: torch's {dtype_name} GEMM runs at "
                           f"{gflops:.1f} GFLOP/s on this CPU (no native {dtype_name} instructions), "
                           f"so one call would take about {estimate / 60:.0f} minutes")
        # Rounds of every variant in turn, each in a fresh process: a slow spell of the machine
        # then lands on all of them alike, not on whichever happened to run in it. A variant's
        # peak is its largest over the rounds, its time its fastest.
        # The crate called from Rust takes its turn in every round too, alternating with the
        # binding's call BINDING_PAIRS times: the binding's overhead is a ratio of a few percent,
        # which only calls run side by side, several times over, can show through the machine's
        # ±5% from one call to the next.
        results, direct = {}, float("inf")
        for _ in range(rounds):
            for var in variants:
                for _ in range(BINDING_PAIRS if var == "flatpeak" else 1):
                    peak, secs = run_child([var, dtype_name, n, d, v, reps])
                    old_peak, old_secs = results.get(var, (0, float("inf")))
                    results[var] = (max(peak, old_peak), min(secs, old_secs))
                    if var == "flatpeak":
                        direct = min(direct, crate_direct(n, d, v, dtype_name, reps))
        ours_peak, ours_time = results["flatpeak"]
        for var in variants:
            peak, secs = results[var]
            print(f"| {dtype_name} | {LABELS[var]} | {peak / 2**20:.0f} | {ours_peak / max(peak, 1):.3f} | "
                  f"{secs:.2f} | {ours_time / secs:.2f} |")
        print(f"| {dtype_name} | ring-dtp called from Rust (`direct_call`) | | | {direct:.2f} | "
              f"{ours_time / direct:.3f} |")
    if cce_missing is not None:
        print(f"\nCut Cross-Entropy not measured ({cce_missing}).")
    for note in skipped:
        print(f"\n{note}.")
    print()


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
        # Every other bench's section (between its `<!-- NAME: begin -->` and `<!-- NAME: end -->`
        # markers), measured by that bench: kept as it is, in its order.
        old = open(args.markdown).read() if os.path.exists(args.markdown) else ""
        for section in re.finditer(r"<!-- ([^>]*?): begin -->.*?<!-- \1: end -->", old, re.S):
            text = text.rstrip("\n") + "\n\n" + section.group(0) + "\n"
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
            "same way (`ring-dtp/examples/direct_call.rs`), alternating with the binding's call "
            f"{BINDING_PAIRS} times a round (the binding's fastest of those is its time), the binding's own "
            "cost.\n- " + printed)


def run(args):
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs\n")
    if args.quick:
        bench_lce(512, 64, 2003, 1, ROUNDS)
    else:
        bench_lce(8192, 1024, 32768, 2, ROUNDS)


if __name__ == "__main__":
    main()
