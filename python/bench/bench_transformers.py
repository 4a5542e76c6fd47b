"""A Hugging Face MoE causal LM's training step, as transformers runs it and patched by
``flatpeak.transformers.apply``, in one run; writes its section of docs/torch.md.

    python python/bench/bench_transformers.py                          # the full shape (a few minutes)
    python python/bench/bench_transformers.py --markdown docs/torch.md # ...and write its section there
    python python/bench/bench_transformers.py --quick                  # small shapes, to check it runs

The model is a ``Qwen3MoeForCausalLM`` built from its config (random weights, never a download):
every decoder layer sparse, SwiGLU experts in transformers' fused layout. One step is
``model(input_ids=ids, labels=ids).loss.backward()``. The variants: transformers as it comes (its
default experts implementation, named in the table, and ``CrossEntropyLoss`` on the
``[batch, seq, vocab]`` logits), and the model after ``apply(model)`` (loss and experts; the
experts recompute in backward), ``apply(model, expert_activations="save")`` (the experts keep their
rows and pre-activations for backward instead), after
``apply(model, experts=False)`` (the loss alone), ``apply(model, loss=False)`` (the experts
alone) and ``apply(model, offload_checkpoints=True)``. Each variant runs in its own process (peak
RSS is a high-water mark), at one thread per CPU: the peak is the RSS high-water mark of the first
full-size step above the RSS once the model and the batch exist (after a warm-up step on a short
batch, so one-time library set-up is not counted, while flatpeak's working sets for the full shape
are); the time is the fastest of the later steps. The variants run in turn, in rounds, so the
machine's slow spells fall on all of them alike. Every variant's loss is compared with
transformers' own.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time

from _bench import emit, peak_rss_bytes, reset_peak_rss, rss_bytes, section_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- bench_transformers.py: begin -->", "<!-- bench_transformers.py: end -->"

#: The variants, in the table's order: the ``apply`` keyword arguments (``None``: unpatched).
VARIANTS = {
    "transformers": None,
    "flatpeak": {},
    "flatpeak_save": {"expert_activations": "save"},
    "loss": {"experts": False},
    "experts": {"loss": False},
    "offload": {"offload_checkpoints": True},
}








def config(quick: bool):
    """The model's config: ``Qwen3MoeConfig`` with every layer sparse."""
    import transformers as tf

    dims = (dict(vocab_size=1000, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
            if quick else
            dict(vocab_size=32768, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                 intermediate_size=1024, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4))
    return tf.Qwen3MoeConfig(num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=[],
                             tie_word_embeddings=False, **dims)


def batch_shape(quick: bool):
    return (2, 64) if quick else (2, 2048)


def worker(variant: str, dtype_name: str, quick: bool, reps: int, queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import transformers as tf

    import flatpeak.transformers as fpt

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, dtype_name)
    cfg = config(quick)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(dtype)
    experts_impl = model.config._experts_implementation
    if VARIANTS[variant] is not None:
        fpt.apply(model, **VARIANTS[variant])
    g = torch.Generator().manual_seed(1)
    batch, seq = batch_shape(quick)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)

    def step(input_ids) -> float:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach().float().item()

    step(ids[:, :16])  # warm-up: libraries, the dispatcher's caches
    reset_peak_rss()
    base = rss_bytes()
    loss = step(ids)
    peak = peak_rss_bytes() - base
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - start)
    queue.put((peak, min(times), loss, experts_impl))


def run_variant(variant: str, dtype_name: str, quick: bool, reps: int):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=worker, args=(variant, dtype_name, quick, reps, queue))
    proc.start()
    out = queue.get(timeout=3600)
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"variant {variant} ({dtype_name}) exited with {proc.exitcode}")
    return out


def label(variant: str, experts_impl: str) -> str:
    return {
        "transformers": f"transformers as it comes (experts: `{experts_impl}`; loss: `CrossEntropyLoss` on the logits)",
        "flatpeak": "`flatpeak.transformers.apply(model)` (loss and experts)",
        "flatpeak_save": "`apply(model, expert_activations=\"save\")` (experts keep their activations)",
        "loss": "`apply(model, experts=False)` (the loss alone)",
        "experts": "`apply(model, loss=False)` (the experts alone)",
        "offload": "`apply(model, offload_checkpoints=True)`",
    }[variant]


def main():
    args = section_arguments(__doc__)
    reps = 1 if args.quick else 2
    rounds = 1 if args.quick else args.rounds
    dtypes = ("float32", "bfloat16")
    results = {}
    for _ in range(rounds):
        for dtype_name in dtypes:
            for v in VARIANTS:
                peak, secs, loss, impl = run_variant(v, dtype_name, args.quick, reps)
                old = results.get((dtype_name, v))
                results[(dtype_name, v)] = (max(peak, old[0]) if old else peak, min(secs, old[1]) if old else secs,
                                            loss, impl)
    import torch
    import transformers as tf

    cfg = config(args.quick)
    batch, seq = batch_shape(args.quick)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [BEGIN, "",
             f"#### A transformers MoE model's training step: `Qwen3MoeForCausalLM`, {cfg.num_hidden_layers} layers, "
             f"hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok} "
             f"(I = {cfg.moe_intermediate_size}), vocabulary {cfg.vocab_size}, batch {batch} × {seq} tokens, "
             "forward + backward", "",
             "Generated by `python/bench/bench_transformers.py --markdown docs/torch.md`; do not edit by hand.", "",
             f"- commit: `{commit}`; torch {torch.__version__}, transformers {tf.__version__}; "
             f"{os.cpu_count()} CPUs, {os.cpu_count()} threads",
             "- one step: `model(input_ids=ids, labels=ids).loss.backward()`; peak: the RSS high-water mark of the "
             "first full-size step above the RSS once the model and the batch exist (flatpeak's working sets "
             f"included); time: the fastest later step, over {rounds} rounds of every variant in turn, each in its "
             "own process; loss: relative difference from transformers' loss", "",
             "| dtype | model | peak (MiB) | flatpeak's peak / this one's | time (s) | speed-up of `apply(model)` "
             "over it | loss vs transformers' |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for dtype_name in dtypes:
        ours_peak, ours_time = results[(dtype_name, "flatpeak")][:2]
        ref_loss = results[(dtype_name, "transformers")][2]
        short = {"float32": "f32", "bfloat16": "bf16"}[dtype_name]
        for v in VARIANTS:
            peak, secs, loss, impl = results[(dtype_name, v)]
            diff = abs(loss - ref_loss) / abs(ref_loss)
            lines.append(f"| {short} | {label(v, impl)} | {peak / 2**20:.0f} | {ours_peak / max(peak, 1):.3f} | "
                         f"{secs:.2f} | {secs / ours_time:.2f}× | {diff:.1e} |")
    emit(lines, BEGIN, END, args.markdown)


if __name__ == "__main__":
    main()
