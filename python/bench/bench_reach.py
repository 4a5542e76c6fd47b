"""Reach, measured: the longest sequence a Qwen3-MoE-shaped model trains at under one memory
limit, FSDP2 with activation checkpointing and a fused AdamW against the same plus flatpeak (the
loss, the experts on an expert-parallel mesh, checkpoint offload, ``StreamAdamW``), over a gloo
group of 4 processes on this machine (one thread each); writes its section of docs/torch.md.

    python python/bench/bench_reach.py                          # sequences 512 .. 16384 tokens
    python python/bench/bench_reach.py --markdown docs/torch.md # ...and write its section there
    python python/bench/bench_reach.py --quick                  # small, to check it runs
    python python/bench/bench_reach.py --device cuda            # one GPU (the `cuda` build), bf16

On a GPU (``--device cuda``, one process, bf16 parameters): the same two configurations on one
device (no expert parallelism), the peak both ``torch.cuda.max_memory_allocated`` over the step and
the device's used memory sampled every millisecond (llep's buffers are allocated outside torch's
allocator), the limit 8 GiB, sequences 8192 .. 524288 tokens (4x apart).

Each (configuration, sequence length) runs one training step (forward, backward, clipping and the
optimizer step, each rank its own sequence) in a fresh group of processes, after a warm-up step
of 64 tokens (the optimizer state made); a rank's peak is the RSS high-water mark of the step
above the RSS before it; the step's peak is the largest rank's. The lengths double until a
configuration's peak exceeds the limit (or the longest length is reached). ``flatpeak plan``
models the same configuration beside the measurement.

On a CPU host and device are one memory: moving checkpoints or optimizer state to the host saves
nothing here, so the figure shows the peaks that grow with the sequence on any device -- the
vocabulary projection's logits and the experts' dispatch -- not the checkpoint and optimizer
peaks, which need a GPU's device memory (``torch.cuda.max_memory_allocated``) to show.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import subprocess
import tempfile
import time

from _bench import emit, peak_rss_bytes, reset_peak_rss, rss_bytes, section_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- bench_reach.py: begin -->", "<!-- bench_reach.py: end -->"
WORLD, EP = 4, 2
#: One GPU: one process, no expert parallelism.
CUDA_LIMIT = 8 << 30


def config_dict(quick: bool) -> dict:
    """A Qwen3-MoE in miniature: every layer sparse, 8 experts top-2, a 32K vocabulary."""
    return dict(model_type="qwen3_moe", vocab_size=4096 if quick else 32768, hidden_size=128 if quick else 256,
                intermediate_size=256, moe_intermediate_size=64 if quick else 128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32 if quick else 64, num_experts=8,
                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                max_position_embeddings=1 << 20)


def rank_main(rank: int, init_file: str, variant: str, seq: int, quick: bool, device: str, queue) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    cuda = device == "cuda"
    world = 1 if cuda else WORLD
    if not cuda:
        torch.set_num_threads(1)
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=3600))
    dense = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    settings = config_dict(quick)
    settings.pop("model_type")
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**settings))
    model = model.to("cuda", torch.bfloat16) if cuda else model.float()
    if variant == "flatpeak":
        import flatpeak.transformers
        from flatpeak.torch import StreamAdamW

        if cuda:
            flatpeak.transformers.apply(model, offload_checkpoints=True)
        else:
            sparse = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("efsdp", "ep"))
            flatpeak.transformers.apply(model, offload_checkpoints=True, ep_mesh=sparse["ep"])
            for layer in model.model.layers:
                fully_shard(layer.mlp.experts, mesh=sparse["efsdp"])
    else:
        model.activation_checkpointing_enable()
    for layer in model.model.layers:
        fully_shard(layer, mesh=dense)
    fully_shard(model.lm_head, mesh=dense)
    fully_shard(model, mesh=dense)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    if variant == "flatpeak":
        opt = StreamAdamW(model.parameters(), lr=1e-4, max_norm=1.0, process_group=dist.group.WORLD)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model.train()
    g = torch.Generator().manual_seed(rank)

    def step(tokens: int) -> None:
        ids = torch.randint(0, settings["vocab_size"], (1, tokens), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=world * (tokens - 1)).loss
        loss.backward()
        if variant != "flatpeak":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step(64)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before, allocated_before = _device_used(torch), torch.cuda.memory_allocated()
        sampler = _Sampler(torch)
    else:
        reset_peak_rss()
        before = rss_bytes()
    start = time.perf_counter()
    step(seq)
    if cuda:
        torch.cuda.synchronize()
    secs = time.perf_counter() - start
    if cuda:
        # The larger of torch's allocator peak and the device's sampled used memory, each above
        # where it stood before the step.
        peak = max(torch.cuda.max_memory_allocated() - allocated_before, sampler.stop() - before)
    else:
        peak = peak_rss_bytes() - before
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, peak, secs))


def _device_used(torch) -> int:
    """The device's used memory now (all processes: the bench runs alone on it)."""
    free, total = torch.cuda.mem_get_info()
    return total - free


class _Sampler:
    """The device's used memory, sampled every millisecond on a thread until :meth:`stop`."""

    def __init__(self, torch):
        import threading

        self.torch, self.high, self.running = torch, _device_used(torch), True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            self.high = max(self.high, _device_used(self.torch))
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.high, _device_used(self.torch))


def measure(variant: str, seq: int, quick: bool, device: str):
    """The largest rank's peak (bytes) and the slowest rank's time of one step at ``seq`` tokens."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    world = 1 if device == "cuda" else WORLD
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=rank_main, args=(r, init_file, variant, seq, quick, device, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = [queue.get(timeout=7200) for _ in range(world)]
        for p in procs:
            p.join()
    return max(o[1] for o in out), max(o[2] for o in out)


def plan(quick: bool, seq: int, limit: int, gpus: int) -> dict:
    """``flatpeak plan --json`` on the same configuration, ``gpus`` devices of ``limit`` bytes (the
    ``flatpeak`` of ``$FLATPEAK_BIN``, else ``cargo run``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(config_dict(quick), f)
        binary = os.environ.get("FLATPEAK_BIN")
        cmd = [binary] if binary else ["cargo", "run", "-q", "--release", "-p", "flatpeak-bench", "--"]
        cmd += ["plan", "--model", path, "--context", str(seq), "--gpus", str(gpus), "--gpu-mem", str(limit), "--json"]
        try:
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        except OSError as e:
            return {"error": f"{cmd[0]}: {e}"}
    if out.returncode != 0:
        return {"error": out.stderr.strip()}
    return json.loads(out.stdout)


def main():
    args = section_arguments(__doc__, devices=True)
    cuda = args.device == "cuda"
    world = 1 if cuda else WORLD
    if cuda:
        lengths = [1024, 2048] if args.quick else [8192 * 4**k for k in range(4)]
        limit = CUDA_LIMIT
    else:
        lengths = [128, 256] if args.quick else [512 * 2**k for k in range(6)]
        limit = (64 if args.quick else 768) << 20
    rows, reach = [], {}
    for variant in ("baseline", "flatpeak"):
        for seq in lengths:
            peak, secs = measure(variant, seq, args.quick, args.device)
            rows.append((variant, seq, peak, secs))
            print(f"{variant:9s} {seq:6d} tokens: peak {peak / 2**20:8.1f} MiB, {secs:6.1f} s", flush=True)
            if peak > limit:
                break
            reach[variant] = seq
    longest = lengths[-1]
    modelled = plan(args.quick, world * longest, limit, world)  # the model's context: the sequence over all GPUs
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cfg = config_dict(args.quick)
    where = (f"one GPU ({torch.cuda.get_device_name()}), bf16" if cuda else
             "FSDP2 over 4 gloo processes")
    lines = [BEGIN + (" cuda" if cuda else ""), "",
             f"#### Reach: the longest sequence under {limit >> 20} MiB per rank, a Qwen3-MoE in miniature "
             f"(hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_experts']} experts top-"
             f"{cfg['num_experts_per_tok']}, vocabulary {cfg['vocab_size']}), {where}", "",
             f"Generated by `python/bench/bench_reach.py{' --device cuda' if cuda else ''} --markdown "
             f"docs/{'gpu' if cuda else 'torch'}.md`; do not edit by hand.", "",
             f"- commit: `{commit}`; torch {torch.__version__}; "
             + ("the device alone" if cuda else f"{os.cpu_count()} CPUs, one thread per process"),
             "- baseline: FSDP2 (each decoder layer, `lm_head`, the root), transformers' activation checkpointing, "
             "`clip_grad_norm_` + `AdamW(fused=True)`; flatpeak: the same FSDP2 plus `apply(offload_checkpoints=True"
             + (")" if cuda else ", ep_mesh=)` (the loss, the experts on a 2 x 2 `efsdp x ep` mesh, checkpoint "
                "offload)") + " and `StreamAdamW(process_group=, max_norm=1.0)`" + (" (offloaded)" if cuda else ""),
             ("- peak: over one training step, the larger of `torch.cuda.max_memory_allocated` and the device's "
              "used memory sampled every millisecond, each above where it stood before the step" if cuda else
              "- peak: the largest rank's RSS high-water mark over one training step above its RSS before it; on a "
              "CPU, host and device are one memory, so this shows the peaks that grow with the sequence on any "
              "device (the logits, the dispatch), not what offloading checkpoints and optimizer state saves on a GPU"),
             "", "| configuration | tokens per rank | peak (MiB) | step time (s) |", "|---|---:|---:|---:|"]
    for variant, seq, peak, secs in rows:
        mark = "" if peak <= limit else " (over the limit)"
        lines.append(f"| {variant} | {seq} | {peak / 2**20:.1f}{mark} | {secs:.1f} |")
    base, ours = reach.get("baseline"), reach.get("flatpeak")
    last = {v: (seq, peak) for v, seq, peak, _ in rows}
    fmt = lambda r, v: ("none" if r is None else  # noqa: E731
                        f"{'>= ' if r == longest and last[v][1] <= limit else ''}{r}")
    ratio = ""
    if base and ours:
        more = " or more" if ours == longest and last["flatpeak"][1] <= limit else ""
        ratio = f": **{ours / base:.0f}x**{more}"
    lines += ["", f"Longest sequence within the limit: baseline {fmt(base, 'baseline')}, flatpeak "
              f"{fmt(ours, 'flatpeak')} tokens per rank{ratio}."]
    if "error" in modelled:
        lines += ["", f"`flatpeak plan` could not model it: {modelled['error']}"]
    else:
        b, f = modelled["baseline"], modelled["flattened"]
        per_rank = lambda m: "none" if m.get("max_context") is None else m["max_context"] // world  # noqa: E731
        lines += ["", f"`flatpeak plan --model <this config> --context {world * longest} --gpus {world} --gpu-mem "
                  f"{limit >> 20}MiB`" + ("" if cuda else " (a sequence spread over 4 GPUs)") + " models the longest "
                  f"that fits at {per_rank(b)} tokens per GPU for the baseline (binding peak: {b.get('binding')}) and "
                  f"{per_rank(f)} flattened (binding: {f.get('binding')}); its model counts GPU memory, where "
                  f"the checkpoints and the optimizer state leave the device."]
    emit(lines, BEGIN + (" cuda" if cuda else ""), END + (" cuda" if cuda else ""), args.markdown)


if __name__ == "__main__":
    main()
