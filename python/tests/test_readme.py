"""The README's PyTorch example runs, and trains."""

import math
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def pytorch_example() -> str:
    text = README.read_text()
    section = text[text.index("\n## PyTorch"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_training_loop_runs_and_the_loss_falls():
    code = pytorch_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    # 20 steps from the uniform loss log(vocab) must have learned something.
    assert namespace["loss"].item() < math.log(namespace["vocab"]) - 0.5
