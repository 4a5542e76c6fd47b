"""The README's PyTorch example runs, and trains."""

import math
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def pytorch_example(index: int = 0) -> str:
    text = README.read_text()
    section = text[text.index("\n## PyTorch"):text.index("\n## candle")]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


def _run_rank(code: str, rank: int, world: int, port: int, queue) -> None:
    import os
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        namespace = {}
        exec(compile(code, str(README), "exec"), namespace)
        grads = [namespace["x"].grad, namespace["router"].weight.grad, namespace["experts"].gate_up_proj.grad]
        queue.put((rank, all(g is not None and bool(g.abs().sum() > 0) for g in grads)))
        namespace["dist"].destroy_process_group()
    except BaseException:  # noqa: BLE001 -- reported to the test
        queue.put((rank, traceback.format_exc()))


def test_readme_training_loop_runs_and_the_loss_falls():
    code = pytorch_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    # 20 steps from the uniform loss log(vocab) must have learned something.
    assert namespace["loss"].item() < math.log(namespace["vocab"]) - 0.5


def test_readme_expert_parallel_example_runs_on_four_gloo_processes():
    import multiprocessing
    import socket

    code = pytorch_example(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_run_rank, args=(code, r, 4, port, queue)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {r: True for r in range(4)}, results
