#!/usr/bin/env python3
"""Speed of the block checksum (XXH3-128) on this CPU, on the path the runtime picks and on the forced baseline.

    python scripts/bench_checksum.py            # both paths (the baseline in a child with EXPERT_PACK_XXH3_BASELINE=1)

Two shapes: a 2 MiB block hashed over and over (cache-resident, the compute-bound rate) and a 256 MiB buffer
(DRAM-bound, like a block that has just been DMA'd by an O_DIRECT read and not yet touched).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np


def rate(nbytes: int, reps: int) -> float:
    from ggml_expert_pack.pybind import xxh3_128
    buf = np.random.default_rng(0).integers(0, 256, size=nbytes, dtype=np.uint8)
    xxh3_128(buf)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            xxh3_128(buf)
        best = max(best, reps * nbytes / (time.perf_counter() - t))
    return best


def main() -> int:
    label = "baseline (forced)" if os.environ.get("EXPERT_PACK_XXH3_BASELINE") else "default (run-time choice)"
    print(f"{label}: 2 MiB in cache {rate(2 << 20, 200) / 1e9:.1f} GB/s, "
          f"256 MiB from DRAM {rate(256 << 20, 4) / 1e9:.1f} GB/s", flush=True)
    if not os.environ.get("EXPERT_PACK_XXH3_BASELINE"):
        subprocess.run([sys.executable, __file__], env={**os.environ, "EXPERT_PACK_XXH3_BASELINE": "1"}, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
