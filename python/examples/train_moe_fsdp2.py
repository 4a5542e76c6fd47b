"""Train a small Qwen3-MoE with flatpeak under FSDP2 on a 2-D expert-parallel mesh, as torchtitan
lays a MoE model out: the experts expert-parallel on ``ep`` and FSDP-sharded on ``efsdp``, every
other parameter FSDP-sharded over all ranks; the loss, the experts and checkpoint offload patched
in by ``flatpeak.transformers.apply``; ``StreamAdamW`` over the local shards with one clipping and
skip decision per step on every rank. No download: a tiny model from a config, a synthetic corpus.

    torchrun --nproc-per-node 4 python/examples/train_moe_fsdp2.py      # gloo on CPUs: efsdp 2 x ep 2

The gradient convention (torchtitan's): FSDP's division off (``set_gradient_divide_factor(1.0)``,
plain sums: gloo's averaging would sum anyway, pytorch issue 162338), each rank's loss its summed
loss divided by the global number of labels (``num_items_in_batch``), the router's auxiliary loss
divided by the number of ranks: expert and dense gradients are both the global batch's mean.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import flatpeak.transformers
from flatpeak.torch import StreamAdamW


def corpus(vocab: int, batch: int, seq: int, seed: int):
    """Endless batches from one random Markov chain (every rank the same chain, its own samples)."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    g.manual_seed(seed)
    while True:
        tokens = torch.empty(batch, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            tokens[:, t] = successors[tokens[:, t - 1], torch.randint(0, 4, (batch,), generator=g)]
        yield tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ep", type=int, default=2, help="the expert-parallel degree (divides the world size)")
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run it under torchrun, e.g. torchrun --nproc-per-node 4 " + __file__)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.ep:
        raise SystemExit(f"--ep {args.ep} does not divide the world size {world}")
    dense = init_device_mesh("cpu", (world,))
    sparse = init_device_mesh("cpu", (world // args.ep, args.ep), mesh_dim_names=("efsdp", "ep"))

    torch.manual_seed(0)  # the same initial model on every rank
    config = transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, router_aux_loss_coef=0.01 / world)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    # flatpeak first: DTensor experts on the ep mesh, each decoder layer checkpointed with offload.
    flatpeak.transformers.apply(model, offload_checkpoints=True, ep_mesh=sparse["ep"])
    # Then FSDP2: the experts over efsdp, each (offloaded) decoder layer, lm_head, the root.
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=sparse["efsdp"])
        fully_shard(layer, mesh=dense)
    fully_shard(model.lm_head, mesh=dense)
    fully_shard(model, mesh=dense)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    optimizer = StreamAdamW(model.parameters(), lr=args.lr, weight_decay=0.01, max_norm=1.0,
                            process_group=dist.group.WORLD)
    model.train()

    batches = corpus(config.vocab_size, args.batch, args.seq, seed=100 + rank)
    labels_per_batch = args.batch * (args.seq - 1) * world
    first = last = None
    for step in range(args.steps):
        tokens = next(batches)
        loss = model(input_ids=tokens, labels=tokens, use_cache=False, output_router_logits=True,
                     num_items_in_batch=labels_per_batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        first = total.item() if first is None else first
        last = total.item()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.4f}  grad norm {optimizer.last_grad_norm:.4f}", flush=True)
    # One decision per step: every rank saw the same norm and skipped the same steps.
    mine = torch.tensor([optimizer.last_grad_norm, float(optimizer.skipped_steps)], dtype=torch.float64)
    seen = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(seen, mine)
    agreed = all(torch.equal(s, seen[0]) for s in seen)
    if rank == 0:
        print(f"\n{world} ranks (efsdp {world // args.ep} x ep {args.ep}), {args.steps} steps: loss {first:.4f} -> "
              f"{last:.4f}; the last step's norm and the skipped steps {'equal' if agreed else 'DIFFER'} on every "
              f"rank")
    dist.destroy_process_group()
    if not last < first:
        raise SystemExit(f"the loss did not fall: {first:.4f} -> {last:.4f}")
    if not agreed:
        raise SystemExit("the ranks took different decisions")


if __name__ == "__main__":
    main()
