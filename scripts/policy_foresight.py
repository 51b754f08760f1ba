#!/usr/bin/env python3
"""How much of Belady's lead is knowing popularity, and how much is knowing the order (docs/POLICY.md)?

    python3 scripts/policy_foresight.py TRACE.npz [--windows 32,128,512] [--fractions 0.1,0.14,0.25]

Replays each MoE layer of a generator trace (scripts/policy_study.py writes them) through a "local A0": on a miss,
evict the cached expert used least often in the window of +-W steps around the current one -- popularity known
for the recent past *and the near future*, but not the order of the uses. A0 (policy_sim, popularity over the whole
trace) is W = infinity. Prints hit rate and the fraction of Belady's. Not a runtime policy: a measuring stick.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from expert_pack_devtools import policy_sim
from expert_pack_devtools.routing.trace import RoutingTrace


def local_a0(steps: list[list[int]], slots: int, n_expert: int, window: int) -> int:
    uses = np.zeros((len(steps) + 1, n_expert))
    for t, step in enumerate(steps):
        uses[t + 1, step] = 1
    cum = uses.cumsum(0)  # cum[t] = uses per expert in steps [0, t)

    def rank(k, t):
        return (cum[min(len(steps), t + window + 1), k] - cum[max(0, t - window), k], k)
    return policy_sim.replay(steps, slots, rank)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--windows", default="32,128,512")
    ap.add_argument("--fractions", default="0.1,0.14,0.25,0.5")
    args = ap.parse_args()
    trace = RoutingTrace.load(args.trace)
    windows = [int(w) for w in args.windows.split(",")]
    print(f"{args.trace.name}: hit rate (fraction of Belady's) by popularity window")
    print("| cache | slots | " + " | ".join(f"local A0 +-{w}" for w in windows) + " | A0 | ours | Belady |")
    print("|---" * (len(windows) + 5) + "|")
    for f in (float(x) for x in args.fractions.split(",")):
        slots = max(policy_sim.top_k(trace), int(round(f * trace.n_expert)))
        total, got = 0, {w: 0 for w in windows}
        for li in range(len(trace.layers)):
            steps = policy_sim.layer_steps(trace, li, slots)
            total += sum(len(s) for s in steps)
            for w in windows:
                got[w] += local_a0(steps, slots, trace.n_expert, w)
        ref = {p: policy_sim.hit_rate(trace, p, slots) for p in ("a0", "hybrid", "belady")}
        cells = [f"{got[w] / total:.3f} ({got[w] / total / ref['belady']:.2f})" for w in windows]
        cells += [f"{ref[p]:.3f} ({ref[p] / ref['belady']:.2f})" for p in ("a0", "hybrid")]
        print(f"| {f:.0%} | {slots} | " + " | ".join(cells) + f" | {ref['belady']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
