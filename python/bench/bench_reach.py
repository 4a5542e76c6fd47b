"""Reach, measured: the longest sequence a Qwen3-MoE-shaped model trains at under one memory
limit, FSDP2 with activation checkpointing and a fused AdamW against the same plus flatpeak (the
loss, the experts on an expert-parallel mesh, checkpoint offload, ``StreamAdamW``), over a gloo
group of 4 processes on this machine (one thread each); writes its section of docs/torch.md.

    python python/bench/bench_reach.py                          # sequences 512 .. 16384 tokens
    python python/bench/bench_reach.py --markdown docs/torch.md # ...and write its section there
    python python/bench/bench_reach.py --quick                  # small, to check it runs

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


def config_dict(quick: bool) -> dict:
    """A Qwen3-MoE in miniature: every layer sparse, 8 experts top-2, a 32K vocabulary."""
    return dict(model_type="qwen3_moe", vocab_size=4096 if quick else 32768, hidden_size=128 if quick else 256,
                intermediate_size=256, moe_intermediate_size=64 if quick else 128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32 if quick else 64, num_experts=8,
                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                max_position_embeddings=1 << 20)


def rank_main(rank: int, init_file: str, variant: str, seq: int, quick: bool, queue) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=3600))
    dense = init_device_mesh("cpu", (WORLD,))
    sparse = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    settings = config_dict(quick)
    settings.pop("model_type")
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**settings)).float()
    if variant == "flatpeak":
        import flatpeak.transformers
        from flatpeak.torch import StreamAdamW

        flatpeak.transformers.apply(model, offload_checkpoints=True, ep_mesh=sparse["ep"])
        for layer in model.model.layers:
            fully_shard(layer.block.mlp.experts, mesh=sparse["efsdp"])
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
        ids = torch.randint(0, settings["vocab_size"], (1, tokens), generator=g)
        loss = model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=WORLD * (tokens - 1)).loss
        loss.backward()
        if variant != "flatpeak":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step(64)
    dist.barrier()
    reset_peak_rss()
    before = rss_bytes()
    start = time.perf_counter()
    step(seq)
    secs = time.perf_counter() - start
    peak = peak_rss_bytes() - before
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, peak, secs))


def measure(variant: str, seq: int, quick: bool):
    """The largest rank's peak (bytes) and the slowest rank's time of one step at ``seq`` tokens."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=rank_main, args=(r, init_file, variant, seq, quick, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        out = [queue.get(timeout=7200) for _ in range(WORLD)]
        for p in procs:
            p.join()
    return max(o[1] for o in out), max(o[2] for o in out)


def plan(quick: bool, seq: int, limit: int) -> dict:
    """``flatpeak plan --json`` on the same configuration, 4 devices of ``limit`` bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(config_dict(quick), f)
        cmd = ["cargo", "run", "-q", "--release", "-p", "flatpeak-bench", "--", "plan", "--model", path, "--context",
               str(seq), "--gpus", str(WORLD), "--gpu-mem", str(limit), "--json"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip()}
    return json.loads(out.stdout)


def main():
    args = section_arguments(__doc__)
    lengths = [128, 256] if args.quick else [512 * 2**k for k in range(6)]
    limit = (64 if args.quick else 768) << 20
    rows, reach = [], {}
    for variant in ("baseline", "flatpeak"):
        for seq in lengths:
            peak, secs = measure(variant, seq, args.quick)
            rows.append((variant, seq, peak, secs))
            print(f"{variant:9s} {seq:6d} tokens: peak {peak / 2**20:8.1f} MiB, {secs:6.1f} s", flush=True)
            if peak > limit:
                break
            reach[variant] = seq
    longest = lengths[-1]
    modelled = plan(args.quick, WORLD * longest, limit)  # the model's context is the sequence over all 4
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cfg = config_dict(args.quick)
    lines = [BEGIN, "",
             f"#### Reach: the longest sequence under {limit >> 20} MiB per rank, a Qwen3-MoE in miniature "
             f"(hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_experts']} experts top-"
             f"{cfg['num_experts_per_tok']}, vocabulary {cfg['vocab_size']}), FSDP2 over 4 gloo processes", "",
             "Generated by `python/bench/bench_reach.py --markdown docs/torch.md`; do not edit by hand.", "",
             f"- commit: `{commit}`; torch {torch.__version__}; {os.cpu_count()} CPUs, one thread per process",
             "- baseline: FSDP2 (each decoder layer, `lm_head`, the root), transformers' activation checkpointing, "
             "`clip_grad_norm_` + `AdamW(fused=True)`; flatpeak: the same FSDP2 plus `apply(offload_checkpoints=True, "
             "ep_mesh=)` (the loss, the experts on a 2 x 2 `efsdp x ep` mesh, checkpoint offload) and "
             "`StreamAdamW(process_group=, max_norm=1.0)`",
             "- peak: the largest rank's RSS high-water mark over one training step above its RSS before it; on a "
             "CPU, host and device are one memory, so this shows the peaks that grow with the sequence on any "
             "device (the logits, the dispatch), not what offloading checkpoints and optimizer state saves on a GPU",
             "", "| configuration | tokens per rank | peak (MiB) | step time (s) |", "|---|---:|---:|---:|"]
    for variant, seq, peak, secs in rows:
        mark = "" if peak <= limit else " (over the limit)"
        lines.append(f"| {variant} | {seq} | {peak / 2**20:.1f}{mark} | {secs:.1f} |")
    base, ours = reach.get("baseline"), reach.get("flatpeak")
    fmt = lambda r, v: ("none" if r is None else  # noqa: E731
                        f"{'>= ' if r == longest and rows[-1][0] == v and rows[-1][2] <= limit else ''}{r}")
    lines += ["", f"Longest sequence within the limit: baseline {fmt(base, 'baseline')}, flatpeak "
              f"{fmt(ours, 'flatpeak')} tokens per rank"
              + (f": **{ours / base:.0f}x**" + (" or more" if ours == longest else "") if base and ours else "") + "."]
    if "error" in modelled:
        lines += ["", f"`flatpeak plan` could not model it: {modelled['error']}"]
    else:
        b, f = modelled["baseline"], modelled["flattened"]
        per_rank = lambda m: "none" if m.get("max_context") is None else m["max_context"] // WORLD  # noqa: E731
        lines += ["", f"`flatpeak plan --model <this config> --context {WORLD * longest} --gpus 4 --gpu-mem "
                  f"{limit >> 20}MiB` (a sequence spread over 4 GPUs) models the longest that fits at "
                  f"{per_rank(b)} tokens per GPU for the baseline (binding peak: {b.get('binding')}) and "
                  f"{per_rank(f)} flattened (binding: {f.get('binding')}); its model counts GPU memory, where "
                  f"the checkpoints and the optimizer state leave the device."]
    emit(lines, BEGIN, END, args.markdown)


if __name__ == "__main__":
    main()
