"""What the benchmarks in this folder share: the process's resident-set size and its peak mark
(Linux ``/proc``), and writing one benchmark's section of a markdown document between its
markers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS, so what was allocated and
    freed before (making the inputs) does not stand in for the measured call's peak. Returns
    False where the kernel refuses it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM: the peak RSS since the last :func:`reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def section_arguments(doc: str, devices: bool = False, rounds: int = 2) -> argparse.Namespace:
    """The command line of a benchmark that writes one section of docs/torch.md: ``--quick``
    (small shapes, to check it runs), ``--markdown PATH``, ``--rounds N`` (default ``rounds``)
    and, for a bench with a GPU variant (``devices``), ``--device cpu|cuda``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, to check the script runs")
    parser.add_argument("--markdown", metavar="PATH", help="write this bench's section of PATH (docs/torch.md)")
    parser.add_argument("--rounds", type=int, default=rounds)
    if devices:
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser.parse_args()


def write_section(path: str, begin: str, end: str, text: str) -> None:
    """Writes ``text`` (starting with ``begin``, ending with ``end``) into the markdown file
    ``path``: in place of the section between those markers, or appended when it has none."""
    old = open(path).read() if os.path.exists(path) else ""
    if begin in old and end in old:
        new = old[:old.index(begin)] + text.rstrip("\n") + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def emit(lines: List[str], begin: str, end: str, path: Optional[str]) -> None:
    """Prints a benchmark's section (``lines``, which start with ``begin``; ``end`` is added)
    and, given a ``path``, writes it there with :func:`write_section`."""
    text = "\n".join(lines + ["", end]) + "\n"
    print(text)
    if path:
        write_section(path, begin, end, text)
        print(f"wrote {path}", file=sys.stderr)
