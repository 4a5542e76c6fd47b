"""Running one piece of work on several Python threads at once, for the tests of calls that
share a cached executor."""

from __future__ import annotations

import threading
from typing import Callable, List


def results_of_threads(step: Callable[[], object], threads: int, steps: int, timeout: float = 120.0) -> List[object]:
    """Runs ``step`` ``steps`` times on each of ``threads`` daemon threads, all started at once,
    and returns every result. Fails the test when a thread is still running after ``timeout``
    seconds (stuck: a daemon thread does not keep the interpreter alive) or when a step raised."""
    results, errors = [], []

    def work():
        try:
            for _ in range(steps):
                results.append(step())
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    started = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for th in started:
        th.start()
    for th in started:
        th.join(timeout=timeout)
    assert not any(th.is_alive() for th in started), "a thread is stuck"
    assert not errors, errors
    assert len(results) == threads * steps
    return results
