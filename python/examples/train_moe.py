"""Train a small Qwen3-MoE with flatpeak: the loss, the experts and checkpoint offload patched in
by one call, the optimizer StreamAdamW. No download: the model is built from a config and trained
on a synthetic corpus (a fixed random Markov chain over the vocabulary, so the loss has somewhere
to fall to).

    python python/examples/train_moe.py                                   # one process, all experts
    torchrun --nproc-per-node 4 python/examples/train_moe.py              # gloo, expert-parallel + DDP
    python python/examples/train_moe.py --expert-activations save         # experts keep activations

Under torchrun the experts are expert-parallel (each rank keeps E/P of them) and everything else is
data-parallel under DDP, with the experts left out of it (``apply(group=)`` registers them as
ignored). The gradient convention makes the two consistent: DDP sums instead of averaging (a comm
hook), each rank's loss is its summed loss divided by the global number of labels
(``num_items_in_batch``) and the router's auxiliary loss is divided by the number of ranks, so
every gradient is the global batch's mean. ``StreamAdamW(process_group=)`` takes one decision per
step (the clip coefficient over every rank's gradients). At the end the script checks that the
dense parameters are bitwise equal on every rank.

Prints the loss every few steps and, at the end, each component's peak as measured on this run:
the dispatch's receive high water and working set (llep), the loss's reserved working set
(ring-dtp), the checkpoint ring's high water against its bound (sco), the optimizer state
(stream-adamw), and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import transformers

import flatpeak.transformers
from flatpeak import _flatpeak
from flatpeak.torch import StreamAdamW
from flatpeak.torch._offload import ring_of


def corpus(vocab: int, batch: int, seq: int, seed: int):
    """An endless stream of batches from one random Markov chain (every rank the same chain,
    its own samples)."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)  # each token has 4 likely successors
    g.manual_seed(seed)
    while True:
        tokens = torch.empty(batch, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            choice = torch.randint(0, 4, (batch,), generator=g)
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        yield tokens


def sum_gradients(state, bucket):
    """DDP's all-reduce without its division by the world size (the convention above)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def dense_replicas_equal(model: torch.nn.Module) -> bool:
    """Whether every rank holds rank 0's values of every parameter DDP synchronizes."""
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    equal = torch.ones((), dtype=torch.int64)
    for name, p in model.named_parameters():
        if name in ignored:
            continue
        theirs = p.detach().clone()
        dist.broadcast(theirs, src=0)
        equal &= torch.equal(theirs, p.detach())
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    return bool(equal)


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--expert-activations", choices=("recompute", "save"), default="recompute",
                        help="what the experts' forward keeps for backward (moe_swiglu's activations=)")
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    group = dist.group.WORLD if distributed else None

    torch.manual_seed(0)  # the same initial model on every rank
    config = transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, router_aux_loss_coef=0.01 / world)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    # The three lines a training script adds:
    model = flatpeak.transformers.apply(model, offload_checkpoints=True, group=group,
                                        expert_activations=args.expert_activations)
    optimizer = StreamAdamW(model.parameters(), lr=args.lr, weight_decay=0.01, max_norm=1.0, process_group=group)
    model.train()
    # Then wrap for data parallelism, as usual (apply first).
    train = model
    if distributed:
        train = torch.nn.parallel.DistributedDataParallel(model)
        train.register_comm_hook(None, sum_gradients)

    batches = corpus(config.vocab_size, args.batch, args.seq, seed=100 + rank)
    labels_per_batch = args.batch * (args.seq - 1) * world  # every rank's labels (the shift drops one each)
    start, first, last = time.monotonic(), None, None
    for step in range(args.steps):
        tokens = next(batches)
        loss = train(input_ids=tokens, labels=tokens, use_cache=False, output_router_logits=True,
                     num_items_in_batch=labels_per_batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)  # the global batch's mean loss (plus the router's)
        first = total.item() if first is None else first
        last = total.item()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.4f}", flush=True)

    experts = [m for m in model.modules() if hasattr(m, "flatpeak_stats")]
    recv = max(m.flatpeak_stats.recv_high_water_bytes for m in experts)
    dispatch_ws = max(m.flatpeak_stats.workspace_bytes for m in experts)
    kept = max(m.flatpeak_stats.saved_bytes for m in experts)
    loss_ws = _flatpeak.LossOptions().workspace_bytes(args.batch * args.seq, config.hidden_size, config.vocab_size,
                                                     False)
    ring = ring_of(model.model.layers)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        print(f"\n{world} process(es), {args.steps} steps in {time.monotonic() - start:.1f} s: "
              f"loss {first:.4f} -> {last:.4f}")
        print("component peaks on rank 0 (measured on this run):")
        print(f"  dispatch (llep)        receive high water {mib(recv)}, working set {mib(dispatch_ws)}"
              + (f", kept for backward {mib(kept)} per layer" if kept else ""))
        print(f"  loss (ring-dtp)        reserved working set {mib(loss_ws)} "
              f"(the logits would be {mib(4 * args.batch * args.seq * config.vocab_size)})")
        print(f"  checkpoints (sco)      ring high water {ring.ring.high_water_slots()} of {ring.ring.slots()} slots, "
              f"{mib(ring.high_water_bytes)} (plain checkpointing: {config.num_hidden_layers} boundaries)")
        print(f"  optimizer state        {mib(state)} (host)")
        print(f"  process peak RSS       {mib(rss)}")
    replicas_equal = dense_replicas_equal(model) if distributed else True
    if rank == 0 and distributed:
        print(f"  dense parameters       {'bitwise equal' if replicas_equal else 'DIFFERENT'} on all {world} ranks")
    if distributed:
        # DDP's reducer and its gloo work go while the group still exists, on every rank at once
        # (left to interpreter exit, their teardown raced the group's and aborted a rank).
        del train
        dist.barrier()
        dist.destroy_process_group()
    if not last < first:
        raise SystemExit(f"the loss did not fall: {first:.4f} -> {last:.4f}")
    if not replicas_equal:
        raise SystemExit("the dense parameters differ between ranks")


if __name__ == "__main__":
    main()
