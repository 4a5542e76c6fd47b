"""``StreamAdamW(process_group=, max_norm=1.0)`` against ``clip_grad_norm_`` +
``torch.optim.AdamW(fused=True)`` on FSDP2 shards, over a gloo group of 4 processes on this
machine (one thread each), alternating step by step in one run; writes its section of
docs/torch.md.

    python python/bench/bench_fsdp.py                          # 64M parameters, 25 rounds
    python python/bench/bench_fsdp.py --markdown docs/torch.md # ...and write its section there
    python python/bench/bench_fsdp.py --quick                  # small, to check it runs

Each rank holds two FSDP2 copies of one model (a stack of square ``nn.Linear`` layers sharded with
``fully_shard`` on a CPU mesh), one per optimizer, with the same gradients (fixed values written
into the local shards, large enough that every step clips). A round times one step of each, in
alternating order, between barriers: the step's time is the slowest rank's. The optimizer step is
what is timed: for torch, ``clip_grad_norm_`` (its all-reduce of the norm over the DTensor shards)
plus the fused step; for flatpeak, the step with its one agreed decision (one exchange of a few
words) and the fused clip-and-update pass. Reported: the median and the range of the per-round
ratio torch / flatpeak (above 1: flatpeak is faster) and each optimizer's median time.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import statistics
import subprocess
import tempfile
import time

from _bench import emit, section_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- bench_fsdp.py: optimizer: begin -->", "<!-- bench_fsdp.py: optimizer: end -->"
WORLD = 4


def rank_main(rank: int, init_file: str, width: int, layers: int, rounds: int, queue) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flatpeak.torch import StreamAdamW

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (WORLD,))

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    ours, theirs = model(), model()
    hp = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ours = StreamAdamW(ours.parameters(), **hp, max_norm=1.0, process_group=dist.group.WORLD)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), **hp, fused=True)
    g = torch.Generator().manual_seed(rank)
    for m in (ours, theirs):
        for p in m.parameters():
            local = p.to_local()
            grad = torch.randn(local.shape, generator=g) * 0.1
            from torch.distributed.tensor import DTensor

            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                        run_check=False)
    params = sum(p.numel() for p in ours.parameters())

    def step_ours():
        opt_ours.step()

    def step_theirs():
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        opt_theirs.step()

    # Warm-up: one step each (state made, kernels and pools started).
    step_ours()
    step_theirs()
    times = {"ours": [], "theirs": []}
    for r in range(rounds):
        order = (("ours", step_ours), ("theirs", step_theirs))
        for name, step in order if r % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    clipped = opt_ours.last_grad_norm > 1.0
    dist.destroy_process_group()
    queue.put((rank, params, times, clipped))


def main():
    args = section_arguments(__doc__)
    width, layers = (256, 4) if args.quick else (4096, 4)
    rounds = 3 if args.quick else 25
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=rank_main, args=(r, init_file, width, layers, rounds, queue))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        out = sorted(queue.get(timeout=3600) for _ in range(WORLD))
        for p in procs:
            p.join()
    _, params, times, clipped = out[0]  # rank 0's times: each ends at a barrier (the slowest rank's)
    ratios = [t / o for o, t in zip(times["ours"], times["theirs"])]
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [BEGIN, "",
             f"#### The optimizer step under FSDP2, {params / 1e6:.1f}M fp32 parameters sharded over a 4-process "
             "gloo group, clipping the global gradient norm to 1.0", "",
             "Generated by `python/bench/bench_fsdp.py --markdown docs/torch.md`; do not edit by hand.", "",
             f"- commit: `{commit}`; torch {torch.__version__}; {os.cpu_count()} CPUs, one thread per process; "
             f"{rounds} rounds, the two optimizers alternating step by step (order swapped every round); a step's "
             f"time is the slowest rank's (between barriers); every step clipped: {clipped}",
             "", "| optimizer step | median time (ms) |", "|---|---:|",
             f"| `clip_grad_norm_` + `torch.optim.AdamW(fused=True)` | {theirs * 1e3:.1f} |",
             f"| `StreamAdamW(process_group=, max_norm=1.0)` | {ours * 1e3:.1f} |", "",
             f"Speed-up (torch's time / flatpeak's, per round): median **{statistics.median(ratios):.2f}x**, "
             f"range {min(ratios):.2f}x to {max(ratios):.2f}x."]
    emit(lines, BEGIN, END, args.markdown)


if __name__ == "__main__":
    main()
