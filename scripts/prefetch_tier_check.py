#!/usr/bin/env python3
"""What next-layer prefetch costs the host-RAM tier, on the CPU: decode the routing-shaped synthetic model
(qwen3moe, 128 experts, top-8, 12 MoE layers, realistic routing) one token per step with the spill tier and

    off      no prefetch
    held     prefetch on, but no prefetch read ever starts (the test seam): every guess is dropped at the next
             layer's acquire, so this is the bookkeeping of prefetch alone
    on       prefetch on

and print per token: pack reads, RAM hits, tier evictions, prefetch counters, and decode tok/s.

    python3 scripts/prefetch_tier_check.py [--tokens 256] [--dir DIR] [--read-threads 4] [--modes off,held,on]

The counts, not the speed, are the point: this machine's compute is far slower than a GPU's, so far more prefetches
finish in time here. Device cache: 18 of 128 experts per layer (14%); RAM tier: 10% of the experts.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="decode steps (one token each)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/prefetch-tier-check"), help="model and pack (reused)")
    ap.add_argument("--read-threads", type=int, default=4)
    ap.add_argument("--modes", default="off,held,on", help="which of off, held, on to run")
    args = ap.parse_args()

    from expert_pack_devtools.lossless import Session, cache_mib_for_slots, ram_mib_for_blocks
    from ggml_expert_pack.packer import build
    from ggml_expert_pack.packer.format import TRUNK_FILE
    from ggml_expert_pack.pybind.provider import Provider
    from expert_pack_devtools.synth import SHAPES, RoutingConfig, SynthConfig, generate

    args.dir.mkdir(parents=True, exist_ok=True)
    model, pack = args.dir / "routing-realistic.gguf", args.dir / "pack"
    if not model.exists():
        generate(SynthConfig.from_dict({**SHAPES["routing"], "routing": RoutingConfig.from_preset("realistic")}),
                 model, progress=False)
    if not pack.exists():
        build(model, pack)
    n_layers, n_expert = SHAPES["routing"]["n_layer"], SHAPES["routing"]["n_expert"]
    blocks = round(0.10 * n_layers * n_expert)
    tokens = [(i * 7919) % 1000 + 100 for i in range(args.tokens + 1)]
    keys = ("ram_misses", "ram_hits", "ram_evictions", "ram_spills", "prefetch_issued", "prefetch_used",
            "prefetch_wasted", "prefetch_cancelled")
    print(f"routing-shaped qwen3moe, realistic routing; device 18/{n_expert} per layer, tier {blocks} blocks, "
          f"{args.read_threads} read threads, {args.tokens} decode steps")
    print("| prefetch | " + " | ".join(k + " / token" for k in keys) + " | accuracy | acquire ms / token | "
          "prefetch wait ms / token | decode tok/s |")
    print("|---" * (len(keys) + 5) + "|")
    for mode in args.modes.split(","):
        p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 18), cache_vram_reserve_mib=0,
                          ram_cache_mib=ram_mib_for_blocks(pack, blocks), read_threads=args.read_threads,
                          prefetch=mode != "off")
        if mode == "held":
            p.hold_prefetch()
        s = Session(pack / TRUNK_FILE, p, n_gpu_layers=0)
        try:
            assert s.decode(tokens[:1]) == 0
            p.reset_stats()
            t0 = time.perf_counter()
            for t in tokens[1:]:
                assert s.decode([t]) == 0
            dt = time.perf_counter() - t0
            c = p.counters()
            st = p.stats()
        finally:
            s.close()
            p.close()
        acc = c["predicted_correct"] / c["predicted"] if c["predicted"] else float("nan")
        print(f"| {mode} | " + " | ".join(f"{c[k] / args.tokens:.2f}" for k in keys) +
              f" | {acc:.1%} | {st['acquire_ms'] / args.tokens:.2f} | {st['prefetch_wait_ms'] / args.tokens:.2f} | "
              f"{args.tokens / dt:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
