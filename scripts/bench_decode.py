#!/usr/bin/env python3
"""First speed figures: decode and prefill with an expert pack against stock llama.cpp on the same GPU.

    python scripts/bench_decode.py --model M.gguf --pack DIR --out RESULTS [--cache-fraction 0.14]

Runs, on the 30B-A3B-shaped synthetic qwen3moe (generated and packed first if missing):
  stock    all weights on the GPU (n_gpu_layers=-1), no pack: the all-hit ceiling
  pack     expert cache of --cache-fraction of the experts, O_DIRECT reads (the product)
  all-hit  the pack with every expert cached and warm: what the hook itself costs
Prefill is a prompt of natural text in one llama_decode; decode is teacher-forced natural text, one token
per llama_decode (a random model's own greedy output repeats itself, which would make the cache look better
than it is). Also measured in the same run: O_DIRECT read bandwidth at expert granularity (random blocks).
Writes decode.json into --out and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from expert_pack_devtools.bench.machine import drop_caches, odirect_bandwidth
from expert_pack_devtools.proc import expert_pack_argv


def tokenize(model: Path, text: str) -> list[int]:
    import llama_cpp as lc
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    m = lc.llama_model_load_from_file(str(model).encode(), mp)
    try:
        b = text.encode()
        buf = (lc.llama_token * (len(b) + 16))()
        n = lc.llama_tokenize(lc.llama_model_get_vocab(m), b, len(b), buf, len(buf), True, False)
        return list(buf[:n])
    finally:
        lc.llama_model_free(m)


def timed(s, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    rc = s.decode(tokens)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    return time.perf_counter() - t0


def measure(model: Path, tokens: list[int], n_prefill: int, n_decode: int, provider=None, warm: bool = False) -> dict:
    from expert_pack_devtools.lossless import Session
    s = Session(model, provider)
    try:
        out = {"load_s": s.load_s, "n_ubatch": s.n_ubatch}
        prompt, follow = tokens[:n_prefill], tokens[n_prefill:n_prefill + n_decode]
        if warm:  # a first pass fills the cache; the measured pass starts from it
            timed(s, prompt)
            for t in follow:
                timed(s, [t])
            s.reset()
        if provider:
            provider.reset_stats()
        out["prefill_s"] = timed(s, prompt)
        out["prefill_tok_s"] = len(prompt) / out["prefill_s"]
        if provider:
            out["prefill_stats"] = provider.stats()
            provider.reset_stats()
        steps = [timed(s, [t]) for t in follow]
        out["decode_step_ms"] = 1e3 * float(np.median(steps))
        out["decode_tok_s"] = len(steps) / sum(steps)
        if provider:
            st = provider.stats()
            out["decode_stats"] = st
            n = len(steps)
            # resident layers (everything preloaded) do no per-step work and count no hits: all hits by construction
            out["hit_rate"] = 1.0 if st["resident_layers"] == st["n_layers"] else st["hit_rate"]
            out["pack_bytes_per_token"] = st["pack_read_bytes"] / n
            out["read_bw_bytes_per_s"] = st["pack_read_bytes"] / (st["read_ms"] / 1e3) if st["read_ms"] else None
            out["per_step_ms"] = {k: st[k] / n for k in ("acquire_ms", "read_ms", "copy_wait_ms")}
        return out
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--pack", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--cache-fraction", type=float, default=0.14)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--pack-prefill", type=int, default=64, help="prefill tokens for the capped-ubatch pack run")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--shape", default="30b-a3b")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from expert_pack_devtools.lossless import cache_mib_for_slots
    from ggml_expert_pack.packer import build
    from ggml_expert_pack.packer.format import load_manifest
    from ggml_expert_pack.pybind.provider import Provider
    from expert_pack_devtools.routing import PROMPTS

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    if not args.model.exists():
        t0 = time.time()
        subprocess.run([*expert_pack_argv(), "synth", str(args.model), "--shape", args.shape,
                        "--quiet"], check=True)
        res["synth_s"] = time.time() - t0
    if not (args.pack / "manifest.json").exists():
        res["pack_build_s"] = build(args.model, args.pack, force=True).seconds
    m = load_manifest(args.pack)
    n_exp = m["n_experts"]
    slots = max(8, round(args.cache_fraction * n_exp))
    res["model_bytes"] = args.model.stat().st_size
    res["cache_slots_per_layer"] = slots
    res["cache_fraction"] = slots / n_exp

    tokens = tokenize(args.model, " ".join(PROMPTS))
    need = args.prefill + args.decode
    tokens = (tokens * (need // len(tokens) + 1))[:need]

    res["stock"] = measure(args.model, tokens, args.prefill, args.decode)
    res["drop_caches"] = drop_caches()
    res["odirect"] = odirect_bandwidth(args.pack)

    p = Provider.open(args.pack, cache_vram_mib=cache_mib_for_slots(args.pack, slots), cache_vram_reserve_mib=0)
    try:
        drop_caches()
        res["pack"] = measure(args.model, tokens[:args.pack_prefill] + tokens[args.prefill:],
                              args.pack_prefill, args.decode, p)
    finally:
        p.close()
    p = Provider.open(args.pack, cache_vram_reserve_mib=0)
    try:
        res["all_hit"] = measure(args.model, tokens, args.prefill, args.decode, p, warm=True)
    finally:
        p.close()

    st, pk, ah = res["stock"], res["pack"], res["all_hit"]
    res["all_hit_over_stock_decode"] = ah["decode_tok_s"] / st["decode_tok_s"]
    if pk.get("read_bw_bytes_per_s"):
        res["read_bw_over_odirect"] = pk["read_bw_bytes_per_s"] / res["odirect"]["bytes_per_s"]
    (args.out / "decode.json").write_text(json.dumps(res, indent=2) + "\n")

    gb = 1e9
    print(f"model {res['model_bytes'] / gb:.1f} GB, cache {slots}/{n_exp} experts per layer "
          f"({100 * res['cache_fraction']:.0f}%), O_DIRECT random-block read {res['odirect']['bytes_per_s'] / gb:.2f} GB/s")
    print(f"{'run':<9} {'prefill tok/s':>13} {'decode tok/s':>12} {'step ms':>8} {'hit rate':>8} {'MB/token':>9} {'read GB/s':>9}")
    for name, r in (("stock", st), ("pack", pk), ("all-hit", ah)):
        hr = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
        mb = f"{r['pack_bytes_per_token'] / 1e6:.1f}" if "pack_bytes_per_token" in r else "-"
        bw = f"{r['read_bw_bytes_per_s'] / gb:.2f}" if r.get("read_bw_bytes_per_s") else "-"
        print(f"{name:<9} {r['prefill_tok_s']:13.1f} {r['decode_tok_s']:12.2f} {r['decode_step_ms']:8.2f} {hr:>8} {mb:>9} {bw:>9}")
    print(f"all-hit decode / stock: {res['all_hit_over_stock_decode']:.2f}; pack read bandwidth / O_DIRECT: "
          f"{res.get('read_bw_over_odirect', float('nan')):.2f}; pack prefill ran at n_ubatch {pk['n_ubatch']}")
    print("pack per decode step (ms):", {k: round(v, 3) for k, v in pk.get("per_step_ms", {}).items()},
          "all-hit:", {k: round(v, 3) for k, v in ah.get("per_step_ms", {}).items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
