#!/usr/bin/env python3
"""What a host-RAM tier saves, replayed on a routing trace (issue 9): device cache per layer + one RAM pool.

    python3 scripts/ram_tier_sim.py TRACE.npz [--vram-frac 0.14] [--ram-frac 0.10] [--out OUT.json]

TRACE.npz is a generator trace (scripts/policy_study.py writes them). The decode regime: one step per token, the
experts of a step pinned in the device cache. Both tiers use LRU here (a relative comparison of tier designs, not
of policies; docs/POLICY.md compares policies). Designs, all without writing anything back to the disk:
  none        no RAM tier: every device-cache miss is a pack read
  inclusive   every block read goes into the tier (what the runtime does today)
  demote      the same blocks, but a block whose expert is on the device is the first to go, and moves to the
              front when the device evicts its expert: the tier keeps the device's victims, no extra copies
  exclusive   the device's victims are copied back into the tier (device-to-host), a RAM hit moves the block out
Reports pack reads per token and the saving against `none`.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def steps_of(trace) -> list[list[list[int]]]:
    """Per token, per layer: the distinct experts."""
    out = []
    for e in trace.experts:  # per prompt: [tokens, layers, k]
        for tok in e:
            out.append([list(dict.fromkeys(int(x) for x in row)) for row in tok])
    return out


def simulate(steps, n_layers: int, vram_slots: int, ram_blocks: int, design: str) -> dict:
    vram = [OrderedDict() for _ in range(n_layers)]
    ram: OrderedDict = OrderedDict()   # key -> None, LRU order (first = next victim)
    reads = ram_hits = d2h = 0
    for tok in steps:
        for li, experts in enumerate(tok):
            cache = vram[li]
            pinned = set(experts)
            for x in experts:
                key = (li, x)
                if x in cache:
                    cache.move_to_end(x)
                    continue
                # device miss: make room first (never evicting this step's experts)
                if len(cache) >= vram_slots:
                    victim = next(v for v in cache if v not in pinned)
                    del cache[victim]
                    vkey = (li, victim)
                    if design == "demote" and vkey in ram:
                        ram.move_to_end(vkey)          # the tier now holds something the device does not
                    elif design == "exclusive" and ram_blocks:
                        d2h += 1
                        ram[vkey] = None
                        ram.move_to_end(vkey)
                        while len(ram) > ram_blocks:
                            ram.popitem(last=False)
                cache[x] = None
                if design != "none" and key in ram:
                    ram_hits += 1
                    if design == "exclusive":
                        del ram[key]
                    elif design == "demote":
                        ram.move_to_end(key, last=False)  # on the device now: first to go
                    else:
                        ram.move_to_end(key)
                    continue
                reads += 1
                if design in ("inclusive", "demote") and ram_blocks:
                    ram[key] = None
                    if design == "demote":
                        ram.move_to_end(key, last=False)
                    while len(ram) > ram_blocks:
                        ram.popitem(last=False)
    n_tok = len(steps)
    return {"design": design, "reads_per_token": reads / n_tok, "ram_hits_per_token": ram_hits / n_tok,
            "d2h_per_token": d2h / n_tok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--vram-frac", type=float, default=0.14, help="device cache, fraction of each layer's experts")
    ap.add_argument("--ram-frac", type=float, default=0.10, help="RAM tier, fraction of all experts")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from ggml_expert_pack.routing.trace import RoutingTrace
    trace = RoutingTrace.load(args.trace)
    steps = steps_of(trace)
    n_layers = len(trace.layers)
    vram_slots = max(trace.experts[0].shape[2], round(args.vram_frac * trace.n_expert))
    ram_blocks = round(args.ram_frac * trace.n_expert * n_layers)
    rows = [simulate(steps, n_layers, vram_slots, ram_blocks, d) for d in ("none", "inclusive", "demote", "exclusive")]
    base = rows[0]["reads_per_token"]
    print(f"{args.trace.name}: {len(steps)} tokens x {n_layers} layers, {trace.n_expert} experts; device "
          f"{vram_slots} slots/layer ({args.vram_frac:.0%}), RAM tier {ram_blocks} blocks ({args.ram_frac:.0%})")
    print("| design | pack reads / token | saved | RAM hits / token | device-to-host copies / token |")
    print("|---|---|---|---|---|")
    for r in rows:
        r["saved"] = 1 - r["reads_per_token"] / base if base else 0.0
        print(f"| {r['design']} | {r['reads_per_token']:.2f} | {r['saved']:.1%} | {r['ram_hits_per_token']:.2f} | "
              f"{r['d2h_per_token']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"trace": str(args.trace), "vram_slots": vram_slots, "ram_blocks": ram_blocks,
                                        "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
