"""A one-line progress bar on stderr for the CLI (no dependency, quiet when not a terminal)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

Item = TypeVar("Item")


def progress(items: Iterable[Item], total: int, label=str, width: int = 24, stream=None) -> Iterator[Item]:
    """Yields `items`, drawing `[#####-----] i/total label(item) elapsed` before each one."""
    stream = stream or sys.stderr
    interactive = stream.isatty()
    start = time.perf_counter()
    for index, item in enumerate(items):
        done = int(width * index / max(total, 1))
        line = (
            f"[{'#' * done}{'-' * (width - done)}] {index}/{total} {label(item)} ({time.perf_counter() - start:.0f}s)"
        )
        if interactive:
            stream.write("\r\033[K" + line)
        else:
            stream.write(line + "\n")
        stream.flush()
        yield item
    line = f"[{'#' * width}] {total}/{total} done in {time.perf_counter() - start:.0f}s"
    stream.write(("\r\033[K" if interactive else "") + line + "\n")
    stream.flush()
