#!/usr/bin/env python3
"""How long the cache policy takes to place a step's experts, by cache size (the provider's own policy code through
the C API, src/cache_policy.cpp). The host-RAM tier is one policy over all of its blocks, so its size is the slot
count here: a 64 GiB tier of 2.6 MB experts (the 30B-A3B shape) has ~25,000 blocks.

    python3 scripts/policy_speed.py [--slots 18,614,5000,25000] [--steps 2000]

Each slot count is filled first, then timed over steps of 8 distinct experts drawn from 4x as many experts as
slots (most of them misses). The times include the Python call (~4 us per step on the CPU dev machine).
"""
from __future__ import annotations

import argparse
import random
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", default="18,614,5000,25000")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    from ggml_expert_pack.pybind.provider import Policy
    print("| slots | us per step of 8 experts | misses per step | us per miss |")
    print("|---|---|---|---|")
    for slots in (int(x) for x in args.slots.split(",")):
        n = 4 * slots
        p = Policy(slots, n)
        for i in range(0, slots, 8):
            p.step(list(range(i, min(i + 8, slots))))
        rng = random.Random(0)
        steps = [rng.sample(range(n), 8) for _ in range(args.steps)]
        m0 = p.misses
        t0 = time.perf_counter()
        for s in steps:
            p.step(s)
        dt = time.perf_counter() - t0
        misses = (p.misses - m0) / len(steps)
        print(f"| {slots} | {dt / len(steps) * 1e6:.1f} | {misses:.1f} | {dt / len(steps) / misses * 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
