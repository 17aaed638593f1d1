"""How fast this machine commits fresh anonymous memory on its first write: 4 KB pages against a mapping
advised for 2 MB pages (the KV pools' two options), each mapping kept so that every one is new memory.

    python benchmarks/first_touch.py --gib 1
"""

from __future__ import annotations

import argparse
import mmap
import time
from pathlib import Path

import numpy as np


def touch(num_bytes: int, huge: bool) -> float:
    """Seconds to write one byte of every 4 KB page of a new mapping; the mapping is returned kept alive."""
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        region.madvise(mmap.MADV_HUGEPAGE)
    pages = np.frombuffer(region, dtype=np.uint8)
    start = time.perf_counter()
    pages[::4096] = 1
    seconds = time.perf_counter() - start
    touch.kept.append((region, pages))
    return seconds


touch.kept = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of each mapping")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = {name: Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
                for name in ("enabled", "defrag") if Path(f"/sys/kernel/mm/transparent_hugepage/{name}").exists()}
    print(f"transparent huge pages: {settings}")
    num_bytes = int(args.gib * 2**30)
    for _ in range(args.rounds):
        for huge in (False, True):
            seconds = touch(num_bytes, huge)
            print(f"{'2 MB (advised)' if huge else '4 KB'}: {num_bytes / seconds / 1e9:.2f} GB/s "
                  f"({seconds * 1e3:.0f} ms for {args.gib:g} GiB)")


if __name__ == "__main__":
    main()
