"""flatpeak.torch.moe_swiglu against the expert parallelism a torchtitan user runs today, over a
gloo group of 4 processes on this machine, in one run; writes its section of docs/torch.md.

    python python/bench/bench_moe.py                          # the full shape (a few minutes)
    python python/bench/bench_moe.py --markdown docs/torch.md # ...and write its section there
    python python/bench/bench_moe.py --quick                  # small shapes, to check it runs

The baseline: every routed row sent to its expert's rank with
``torch.distributed.nn.functional.all_to_all_single`` (autograd through the exchange), the rank's
experts as a loop of ``F.linear`` over the rows sorted by expert, the reverse exchange, and the
rows weighted and summed per token; flatpeak: ``moe_swiglu(..., scheme="pipelined")`` with its
working-set budget of 64 MiB (the largest pair cap whose buffers fit) and of 16 MiB, recomputing
in backward, and at 64 MiB with ``activations="save"`` (the rows and pre-activations kept for
backward, as the baseline's autograd keeps its own). Each variant runs in its own group of
processes (peak RSS is a high-water mark): per rank,
the peak is the RSS high-water mark of one forward + backward above the RSS once the inputs exist
(after a tiny warm-up call), the time the fastest of the repetitions. The variants run in turn,
in rounds, so the machine's slow spells fall on all of them alike.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import subprocess
import tempfile
import time

from _bench import emit, peak_rss_bytes, reset_peak_rss, rss_bytes, section_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- bench_moe.py: begin -->", "<!-- bench_moe.py: end -->"








def problem(torch, rank, world, shape, profile, seed=0):
    """This rank's tokens, routing and experts (``hot``: 95% of the routes on expert 0)."""
    t, h, i, e, k = shape
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(t, h, generator=g)
    if profile == "balanced":
        ids = (torch.arange(t).unsqueeze(1) * k + torch.arange(k) + rank * t * k) % e
    else:
        ids = torch.randint(0, e, (t, k), generator=g)
        ids[torch.rand(t, k, generator=g) < 0.95] = 0
    w = torch.rand(t, k, generator=g)
    local = e // world
    gate_up = torch.randn(local, 2 * i, h, generator=g) / h ** 0.5
    down = torch.randn(local, h, i, generator=g) / i ** 0.5
    return x, ids, w, gate_up, down


def baseline(torch, x, ids, w, gate_up, down, group):
    """Expert parallelism as torchtitan runs it, in autograd."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnf
    import torch.nn.functional as F

    world = dist.get_world_size(group)
    local, inter = gate_up.shape[0], gate_up.shape[1] // 2
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    send_counts = torch.bincount(flat[order] // local, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
    expert_recv = torch.empty(sum(recv_sizes), dtype=torch.int64)
    dist.all_to_all_single(expert_recv, flat[order] % local, recv_sizes, send_sizes, group=group)
    rows = dnf.all_to_all_single(torch.empty(sum(recv_sizes), x.shape[1]), x[token], recv_sizes, send_sizes,
                                 group=group)
    by_expert = torch.argsort(expert_recv, stable=True)
    counts = torch.bincount(expert_recv, minlength=local).tolist()
    outs, start = [], 0
    sorted_rows = rows[by_expert]
    for e, n in enumerate(counts):
        pre = F.linear(sorted_rows[start:start + n], gate_up[e])
        outs.append(F.linear(F.silu(pre[:, :inter]) * pre[:, inter:], down[e]))
        start += n
    out = torch.empty_like(sorted_rows).index_copy(0, by_expert, torch.cat(outs))
    back = dnf.all_to_all_single(torch.empty(flat.shape[0], x.shape[1]), out, send_sizes, recv_sizes, group=group)
    weighted = back * w.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, token, weighted)


def worker(rank, world, init_file, variant, shape, profile, reps, queue):
    import warnings

    # torch 2.15 deprecates torch.distributed.nn.functional in favour of a private module.
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ["RAYON_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from flatpeak.torch import moe_swiglu

    group = dist.group.WORLD

    def call(x, ids, w, gate_up, down):
        leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
        if variant == "baseline":
            y = baseline(torch, leaves[0], ids, leaves[1], leaves[2], leaves[3], group)
        else:
            budget = (16 if variant == "flatpeak_q" else 64) << 20
            activations = "save" if variant == "flatpeak_save" else "recompute"
            y = moe_swiglu(leaves[0], ids, leaves[1], leaves[2], leaves[3], group=group, budget_bytes=budget,
                           activations=activations)
        y.square().mean().backward()

    # Warm-up at a tiny shape (libraries, the dispatcher's caches), then the inputs, then the peak.
    t, h, i, e, k = shape
    call(*problem(torch, rank, world, (8, h, i, e, k), profile))
    inputs = problem(torch, rank, world, shape, profile)
    dist.barrier()
    reset_peak_rss()
    base = rss_bytes()
    call(*[x.detach().clone() if x.is_floating_point() else x for x in inputs])
    peak = peak_rss_bytes() - base
    times = []
    for _ in range(reps):
        args = [x.detach().clone() if x.is_floating_point() else x for x in inputs]
        dist.barrier()
        start = time.perf_counter()
        call(*args)
        dist.barrier()
        times.append(time.perf_counter() - start)
    queue.put((rank, peak, min(times)))
    dist.destroy_process_group()


def run_variant(variant, shape, profile, reps, world=4):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=worker, args=(r, world, init, variant, shape, profile, reps, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = sorted(queue.get(timeout=3600) for _ in range(world))
        for p in procs:
            p.join()
    return out


LABELS = {
    "baseline": "all_to_all_single + `F.linear` per expert (torchtitan-style EP)",
    "flatpeak": "`moe_swiglu`, pipelined, 64 MiB budget",
    "flatpeak_q": "`moe_swiglu`, pipelined, `budget_bytes` = 16 MiB",
    "flatpeak_save": "`moe_swiglu`, pipelined, 64 MiB budget, `activations=\"save\"` (no recompute)",
}


def main():
    args = section_arguments(__doc__)
    shape = (256, 64, 32, 8, 2) if args.quick else (4096, 512, 256, 32, 4)
    reps = 1 if args.quick else 2
    rounds = 1 if args.quick else args.rounds
    variants = ["baseline", "flatpeak", "flatpeak_q", "flatpeak_save"]
    results = {}
    for _ in range(rounds):
        for profile in ("balanced", "hot"):
            for v in variants:
                for rank, peak, secs in run_variant(v, shape, profile, reps):
                    key = (profile, v, rank)
                    old = results.get(key)
                    results[key] = (max(peak, old[0]) if old else peak, min(secs, old[1]) if old else secs)
    t, h, i, e, k = shape
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [BEGIN, "",
             f"#### `moe_swiglu` over a 4-process gloo group, T = {t} per rank, H = {h}, I = {i}, E = {e}, k = {k}, "
             "f32, forward + backward", "",
             "Generated by `python/bench/bench_moe.py --markdown docs/torch.md`; do not edit by hand.", "",
             f"- commit: `{commit}`; torch {torch.__version__}; {os.cpu_count()} CPUs, one thread per process",
             "- peak: per rank, the RSS high-water mark of one forward + backward above the RSS once the inputs "
             "exist; time: the fastest repetition, over " f"{rounds} rounds of every variant in turn (the slowest "
             "rank's time is the step's)",
             "- `hot`: 95% of the routes on expert 0, which lives on rank 0", "",
             "| routing | call | peak, hot rank 0 (MiB) | peak, max over ranks (MiB) "
             "| flatpeak's max peak / this one's | time (s) | flatpeak's time / this one's |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for profile in ("balanced", "hot"):
        ours_peak = max(results[(profile, "flatpeak", r)][0] for r in range(4))
        ours_time = max(results[(profile, "flatpeak", r)][1] for r in range(4))
        for v in variants:
            peaks = [results[(profile, v, r)][0] for r in range(4)]
            secs = max(results[(profile, v, r)][1] for r in range(4))
            lines.append(f"| {profile} | {LABELS[v]} | {peaks[0] / 2**20:.1f} | {max(peaks) / 2**20:.1f} | "
                         f"{ours_peak / max(max(peaks), 1):.3f} | {secs:.2f} | {ours_time / secs:.2f} |")
    emit(lines, BEGIN, END, args.markdown)


if __name__ == "__main__":
    main()
