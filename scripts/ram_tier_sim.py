#!/usr/bin/env python3
"""What a host-RAM tier saves, replayed on a routing trace: device cache per layer + one RAM pool.

    python3 scripts/ram_tier_sim.py TRACE.npz [--vram-frac 0.14] [--ram-frac 0.10] [--out OUT.json]

TRACE.npz is a generator trace (scripts/policy_study.py writes them). The decode regime: one step per token, the
experts of a step pinned in the device cache. Both tiers use LRU here (a relative comparison of tier designs, not
of policies; docs/POLICY.md compares policies). Designs, all without writing anything back to the disk:
  none        no RAM tier: every device-cache miss is a pack read
  inclusive   every block read goes into the tier (the runtime's first design)
  demote      the same blocks, but a block whose expert is on the device is the first to go, and moves to the
              front when the device evicts its expert: the tier keeps the device's victims, no extra copies
  exclusive   the device's victims are copied back into the tier (device-to-host), a RAM hit moves the block out
Reports pack reads per token and the saving against `none`.

A third table gives references for the whole hierarchy: one cache of as many experts as the device caches and the
tier hold together, all layers in one pool, a token's experts (every layer's) pinned together, under LFU (evicts
the expert used least so far), A0 (evicts the expert used least over the whole trace: popularity known in
advance) and Belady (evicts the expert used furthest in the future). Belady's is close to the least any design of
that much memory can read without prefetching (with or without copies between the tiers); A0 is what a ranking by
popularity could reach with the future's popularity known.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path


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


class _DeviceCache:
    """One layer's device cache under the runtime's own policy (the C API, as policy_sim's hybrid), reporting per
    expert whether it hit and whom its slot held before."""

    def __init__(self, n_slots: int, n_expert: int):
        from ggml_expert_pack.pybind.provider import Policy
        self.policy = Policy(n_slots, n_expert)
        self.expert_in: dict[int, int] = {}  # slot -> expert

    def step(self, unique):
        """-> [(expert, hit, evicted)]"""
        out = []
        for e, slot in zip(unique, self.policy.step(unique)):
            old = self.expert_in.get(slot, -1)
            out.append((e, old == e, -1 if old == e else old))
            self.expert_in[slot] = e
        return out


def simulate_runtime(steps, n_layers: int, n_expert: int, vram_slots: int, ram_blocks: int, mode: str,
                     half_life: float = 256.0) -> dict:
    """The runtime's tier modes over the runtime's device policy; one step per token."""
    dev = [_DeviceCache(vram_slots, n_expert) for _ in range(n_layers)]
    tier: dict[int, tuple] = {}          # key -> eviction priority (lowest goes first)
    on_device: set[int] = set()
    count: dict[int, float] = {}
    last: dict[int, int] = {}
    reads = ram_hits = d2h = t = 0

    def pop(k):
        return count.get(k, 0.0) * 2 ** (-(t - last.get(k, 0)) / half_life)

    def prio(k):
        if mode == "spill":
            return (0.0 if k in on_device else pop(k), last.get(k, 0))
        return tier[k]

    def take_block(pinned):
        if len(tier) < ram_blocks:
            return
        del tier[min((k for k in tier if k not in pinned), key=prio)]

    for tok in steps:
        t += 1
        for li, experts in enumerate(tok):
            keys = [li * n_expert + x for x in experts]
            for k in keys:
                count[k], last[k] = pop(k) + 1, t
            pinned = set(keys)
            for x, hit, ev in dev[li].step(experts):
                if hit:
                    continue
                k, evk = li * n_expert + x, li * n_expert + ev
                if ev >= 0:
                    on_device.discard(evk)
                    if mode == "victim" and evk in tier:
                        tier[evk] = (1, t)                     # victims: most recent eviction last to go
                    elif mode == "spill" and evk not in tier and ram_blocks:
                        cand = [b for b in tier if b not in pinned]
                        if len(tier) < ram_blocks or (cand and prio(min(cand, key=prio)) < (pop(evk), t)):
                            take_block(pinned)
                            tier[evk] = ()
                            pinned.add(evk)
                            d2h += 1
                on_device.add(k)
                if mode != "none" and k in tier:
                    ram_hits += 1
                else:
                    reads += 1
                    if mode != "none" and ram_blocks:
                        take_block(pinned)
                if mode != "none" and ram_blocks:
                    tier[k] = (0, t)                           # on the device: first to go (victim mode)
    n_tok = len(steps)
    return {"design": mode, "reads_per_token": reads / n_tok, "ram_hits_per_token": ram_hits / n_tok,
            "d2h_per_token": d2h / n_tok}


def simulate_pool(steps, n_expert: int, capacity: int, policy: str) -> dict:
    """One cache of `capacity` experts over all layers (keys layer * n_expert + expert), one step per token with
    all of its layers' experts pinned; policy "lfu", "a0" or "belady" (expert_pack_devtools.policy_sim.step_hits)."""
    from expert_pack_devtools import policy_sim
    tokens = [[li * n_expert + x for li, experts in enumerate(tok) for x in experts] for tok in steps]
    hits = policy_sim.step_hits(tokens, policy, capacity)
    n_tok = len(steps)
    return {"design": f"one pool, {policy}", "reads_per_token": (sum(len(s) for s in tokens) - hits) / n_tok,
            "ram_hits_per_token": 0.0, "d2h_per_token": 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--vram-frac", type=float, default=0.14, help="device cache, fraction of each layer's experts")
    ap.add_argument("--ram-frac", type=float, default=0.10, help="RAM tier, fraction of all experts")
    ap.add_argument("--spill-half-life", type=float, default=256.0,
                    help="popularity half-life of the spill mode, in steps (the runtime's SPILL_HALF_LIFE)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from expert_pack_devtools.routing.trace import RoutingTrace
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
    rt = [simulate_runtime(steps, n_layers, trace.n_expert, vram_slots, ram_blocks, m, args.spill_half_life)
          for m in ("none", "victim", "spill")]
    print("\nThe runtime's modes (device cache: the runtime's hybrid policy)")
    print("| ram_tier_mode | pack reads / token | saved | RAM hits / token | device-to-host copies / token |")
    print("|---|---|---|---|---|")
    for r in rt:
        r["saved"] = 1 - r["reads_per_token"] / rt[0]["reads_per_token"] if rt[0]["reads_per_token"] else 0.0
        print(f"| {r['design']} | {r['reads_per_token']:.2f} | {r['saved']:.1%} | {r['ram_hits_per_token']:.2f} | "
              f"{r['d2h_per_token']:.2f} |")
    capacity = vram_slots * n_layers + ram_blocks
    refs = [simulate_pool(steps, trace.n_expert, capacity, pol) for pol in ("lfu", "a0", "belady")]
    print(f"\nReferences: one pool of {capacity} experts (the device caches and the tier together)")
    print("| reference | pack reads / token | saved against the runtime's none |")
    print("|---|---|---|")
    for r in refs:
        r["saved"] = 1 - r["reads_per_token"] / rt[0]["reads_per_token"] if rt[0]["reads_per_token"] else 0.0
        print(f"| {r['design']} | {r['reads_per_token']:.2f} | {r['saved']:.1%} |")
    if args.out:
        args.out.write_text(json.dumps({"trace": str(args.trace), "vram_slots": vram_slots, "ram_blocks": ram_blocks,
                                        "rows": rows, "runtime_modes": rt, "references": refs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
