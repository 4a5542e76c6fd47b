"""Worker processes of the expert-parallel composition tests (``test_fsdp.py``): a tiny MoE model
(router, ``MoEExperts``, head) trained 10 steps on 4 gloo ranks (one thread each) under FSDP2 on a
2 x 2 ``efsdp x ep`` mesh, or under DDP with the experts left out of it, against one process
holding every expert fed all four ranks' batches.

The gradient convention (torchtitan's): no data-parallel division (FSDP's divide factor 1 with
plain sums, a summing DDP comm hook) and each rank's loss is its summed loss divided by the global
number of tokens, so dense and expert gradients are both the global mean's."""

from __future__ import annotations

from _moe_workers import _init
from _spawn import reporting

H, INTER, E, K, C = 16, 8, 4, 2, 5
TOKENS = 6  # per rank
STEPS = 10
MAX_NORM = 0.05
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def model_class(torch):
    class MoENet(torch.nn.Module):
        def __init__(self, experts):
            super().__init__()
            torch.manual_seed(0)
            self.router = torch.nn.Linear(H, E, bias=False)
            self.head = torch.nn.Linear(H, C)
            self.experts = experts

        def forward(self, x):
            weights, ids = self.router(x).softmax(-1).topk(K)
            return self.head(x + self.experts(x, ids, weights))

    return MoENet


def global_experts(torch):
    g = torch.Generator().manual_seed(7)
    return torch.randn(E, 2 * INTER, H, generator=g) * 0.3, torch.randn(E, H, INTER, generator=g) * 0.3


def build(torch, experts, first: int):
    """The model around ``experts``, whose local slice is experts ``first ..`` of the global ones."""
    from flatpeak.torch._sharding import local

    model = model_class(torch)(experts)
    gu, dn = global_experts(torch)
    with torch.no_grad():
        for w, full in ((experts.gate_up_proj, gu), (experts.down_proj, dn)):
            mine = local(w)
            mine.copy_(full[first:first + mine.shape[0]])
    return model


def batch(torch, step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(TOKENS * world, H, generator=g), torch.randint(0, C, (TOKENS * world,), generator=g)


def loss_of(torch, model, step: int, rank: int, world: int, ranks_in_batch: int):
    x, y = batch(torch, step, world)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS) if ranks_in_batch > 1 else slice(None)
    return torch.nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum") / (TOKENS * world)


def reference(torch, world: int):
    """One process, every expert, every rank's tokens; clip_grad_norm_ + torch's AdamW."""
    from flatpeak.torch import MoEExperts

    model = build(torch, MoEExperts(E, H, INTER), 0)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(torch, model, step, 0, world, 1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@reporting
def fsdp2_ep(rank: int, world: int, init_file: str):
    """Test 4: FSDP2 + EP on a 2 x 2 mesh, StreamAdamW(process_group=) with clipping."""
    torch, dist = _init(rank, world, init_file)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flatpeak.torch import MoEExperts, StreamAdamW

    dense = init_device_mesh("cpu", (world,))
    sparse = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    ep = sparse["ep"]
    experts = MoEExperts(E, H, INTER, mesh=ep)
    model = build(torch, experts, ep.get_local_rank() * (E // 2))
    fully_shard(model.experts, mesh=sparse["efsdp"])
    fully_shard(model, mesh=dense)
    for unit in (model.experts, model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    opt = StreamAdamW(model.parameters(), **HP, max_norm=MAX_NORM, process_group=dist.group.WORLD)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(torch, model, step, rank, world, world).backward()
        opt.step()
        norms.append(opt.last_grad_norm)
    expected = reference(torch, world)
    got = {n: p.full_tensor() for n, p in model.named_parameters()}
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    gu, _ = global_experts(torch)
    return dict(errors={n: rel(got[n], expected[n]) for n in expected}, norms=norms, placements=placements,
                trained=rel(got["experts.gate_up_proj"], gu), requires_grad=all(
                    p.requires_grad for p in model.parameters()))


def _sum_hook(state, bucket):
    """DDP's all-reduce without its division by the world size (the gradient convention above)."""
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


@reporting
def ddp_experts(rank: int, world: int, init_file: str):
    """Test 5: DDP over a model whose experts are rank-private (MoEExperts(group=)), left out of
    DDP; StreamAdamW(process_group=) with clipping."""
    torch, dist = _init(rank, world, init_file)
    from torch.nn.parallel import DistributedDataParallel

    from flatpeak.torch import MoEExperts, StreamAdamW, exclude_experts_from_ddp

    group = dist.group.WORLD
    model = build(torch, MoEExperts(E, H, INTER, group=group), rank * (E // world))
    ignored = exclude_experts_from_ddp(model)
    mine = model.experts.gate_up_proj.detach().clone()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, _sum_hook)
    kept = torch.equal(model.experts.gate_up_proj, mine)  # DDP did not broadcast rank 0's slice
    opt = StreamAdamW(ddp.parameters(), **HP, max_norm=MAX_NORM, process_group=group)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(torch, ddp, step, rank, world, world).backward()
        opt.step()
    expected = reference(torch, world)
    e_local = E // world
    errors = {}
    for name, p in model.named_parameters():
        want = expected[name]
        if name.startswith("experts."):
            want = want[rank * e_local:(rank + 1) * e_local]
        errors[name] = rel(p, want)
    # As lists: tensors through the queue would share memory with a process that has exited.
    dense = {n: p.detach().tolist() for n, p in model.named_parameters() if not n.startswith("experts.")}
    return dict(ignored=ignored, kept=kept, errors=errors, dense=dense, norm=opt.last_grad_norm,
                trained=rel(model.experts.gate_up_proj, mine))


@reporting
def refusals(rank: int, world: int, init_file: str):
    """Test 6: plain rank-private experts under fully_shard, apply after wrapping, DTensors where
    they are not taken: each refused with its message."""
    torch, dist = _init(rank, world, init_file)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flatpeak.torch import MoEExperts, linear_cross_entropy, moe_swiglu

    seen = {}
    mesh = init_device_mesh("cpu", (world,))
    model = build(torch, MoEExperts(E, H, INTER, group=dist.group.WORLD), rank * (E // world))
    fully_shard(model, mesh=mesh)
    try:
        model(torch.randn(3, H))
    except RuntimeError as e:
        seen["fully_shard"] = str(e)
    # A model FSDP2 has sharded (no forward ran): its parameters are DTensors.
    model = build(torch, MoEExperts(E, H, INTER), 0)
    fully_shard(model, mesh=mesh)
    try:
        linear_cross_entropy(torch.randn(3, H), model.head.weight, torch.zeros(3, dtype=torch.long))
    except TypeError as e:
        seen["loss"] = str(e)
    try:
        moe_swiglu(torch.randn(3, H), torch.zeros(3, K, dtype=torch.long), torch.ones(3, K),
                   model.experts.gate_up_proj, model.experts.down_proj)
    except TypeError as e:
        seen["moe"] = str(e)
    return seen
