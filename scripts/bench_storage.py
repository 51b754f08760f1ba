#!/usr/bin/env python3
"""Decode speed against storage bandwidth: the pack on RAM-backed storage, read as is or through the storage
emulator (EXPERT_PACK_TEST_STORAGE: a drive of the given bandwidth, per-request latency and queue depth), for
named provider configurations, with the per-layer timeline of one decode step.

    python scripts/bench_storage.py --model M.gguf --pack DIR --out OUT [--copy-to /dev/shm]
        [--storage disk,ram,7,12,14] [--configs default,no-checksum] [--decode 64]

`disk` reads the pack where --pack is; `ram` reads the copy under --copy-to (tmpfs accepts O_DIRECT); a number N
reads that copy through the emulator as an N GB/s drive (--latency-us, --queue-depth). Decode is teacher-forced
natural text, one token per llama_decode, after a prompt of --prefill tokens, with an evicting device cache of
--cache-fraction of each layer's experts. Also measured: stock llama.cpp with every weight on the GPU, and the
pack with every expert cached (resident layers), whose step time is the compute per token. Writes storage.json
and prints a table, the drive-bound limit 1 / max(bytes per token / bandwidth, compute per token), and the
timeline summary (per layer: ids on the host -> plan -> reads landed and checked -> copies complete -> slot ids
back, and the device's time until the next layer's ids).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import drop_caches, measure, tokenize  # noqa: E402
from expert_pack_devtools.proc import expert_pack_argv  # noqa: E402

CONFIGS = {  # provider keys on top of the evicting cache; every key not named at its default
    "default": {},
    "whole-blocks-4": {"read_threads": 4, "read_splits": 1},  # one read and one hash per miss, 4 at a time
    "no-checksum": {"verify_pack_sha256": False},
    "threads-8": {"read_threads": 8},
    "splits-4": {"read_splits": 4},
    "threads-1": {"read_threads": 1},
    # the chunked miss path (read_splits > 1): chunks of every miss in flight, hashed and copied as they land
    "chunked-8x4": {"read_threads": 8, "read_splits": 4},
    "chunked-16x4": {"read_threads": 16, "read_splits": 4},
    "chunked-16x8": {"read_threads": 16, "read_splits": 8},
    "chunked-32x8": {"read_threads": 32, "read_splits": 8},
    "chunked-16x8-no-checksum": {"read_threads": 16, "read_splits": 8, "verify_pack_sha256": False},
}


def timeline_summary(tl: dict) -> dict:
    """Mean per-layer figures (ms) of one step's timeline."""
    layers = tl.get("layers", [])
    if not layers:
        return {}
    rows = []
    for i, l in enumerate(layers):
        reads = l["reads"]
        row = {"acquire": (l["end_us"] - l["start_us"]) / 1e3,
               "plan": (l["plan_us"] - l["start_us"]) / 1e3 if l["plan_us"] >= 0 else 0.0,
               "misses": len(reads)}
        if reads:
            row["reads_landed"] = (max(r["hash_us"] for r in reads) - l["plan_us"]) / 1e3
            row["io"] = float(np.mean([r["io_us"] - r["start_us"] for r in reads])) / 1e3
            row["hash"] = float(np.mean([r["hash_us"] - r["io_us"] for r in reads])) / 1e3
            row["queued"] = float(np.mean([r["start_us"] - r["issue_us"] for r in reads])) / 1e3
            row["copy_wait"] = (l["end_us"] - max(r["copy_us"] for r in reads)) / 1e3
        if i + 1 < len(layers):
            row["device_gap"] = (layers[i + 1]["start_us"] - l["end_us"]) / 1e3
        rows.append(row)
    keys = sorted({k for r in rows for k in r})
    out = {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}
    out["n_layers"] = len(rows)
    out["step_span"] = (layers[-1]["end_us"] - layers[0]["start_us"]) / 1e3
    # outside the layers (ms, per step): from the step before's end of compute to the first acquire (the host
    # between decodes, the device before the first MoE layer), and from the last acquire to the end of compute
    if tl.get("prev_done_us", -1.0) != -1.0:
        out["before_first"] = -tl["prev_done_us"] / 1e3
    if tl.get("done_us", -1.0) > 0:
        out["after_last"] = (tl["done_us"] - layers[-1]["end_us"]) / 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--pack", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--copy-to", type=Path, default=Path("/dev/shm"), help="RAM-backed folder for the pack's copy")
    ap.add_argument("--disk-dir", type=Path, help="for `disk`: copy the pack into this folder (a real disk) first")
    ap.add_argument("--disk-configs", help="configurations for `disk` (default: --configs)")
    ap.add_argument("--configs-for", action="append", default=[], metavar="STORAGE=LIST",
                    help="configurations for one storage (e.g. 7=default,chunked-16x8); may be repeated")
    ap.add_argument("--storage", default="ram,12", help="comma-separated: disk, ram, or N (GB/s emulated)")
    ap.add_argument("--configs", default="default,no-checksum", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--latency-us", type=float, default=80.0)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--cache-fraction", type=float, default=0.14)
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--shape", default="30b-a3b")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock and all-cached baselines")
    ap.add_argument("--prefill-sweep", help="prompt lengths (e.g. 64,512,2892,8192): prefill of each from `ram` with "
                    "--prefill-config at ubatch 512 and at ubatch = the prompt, against stock with every weight on the "
                    "GPU at ubatch = the prompt; bytes read per prompt token and passes over the pack")
    ap.add_argument("--prefill-config", default="default")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from expert_pack_devtools.lossless import cache_mib_for_slots
    from ggml_expert_pack.packer import build
    from ggml_expert_pack.packer.format import load_manifest
    from ggml_expert_pack.pybind.provider import Provider
    from expert_pack_devtools.routing import PROMPTS

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "args": {
        k: str(v) for k, v in vars(args).items()}, "runs": []}
    try:
        res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        pass
    if not args.model.exists():
        subprocess.run([*expert_pack_argv(), "synth", str(args.model), "--shape", args.shape,
                        "--quiet"], check=True)
    if not (args.pack / "manifest.json").exists():
        build(args.model, args.pack, force=True, progress=False)
    m = load_manifest(args.pack)
    slots = max(8, round(args.cache_fraction * m["n_experts"]))
    res["cache_slots_per_layer"] = slots
    tokens = tokenize(args.model, " ".join(PROMPTS))
    need = args.prefill + args.decode
    tokens = (tokens * (need // len(tokens) + 1))[:need]

    storages = args.storage.split(",")
    ram_pack = None
    if any(s != "disk" for s in storages):
        ram_pack = args.copy_to / f"bench-storage-{args.pack.name}"
        if args.pack.resolve().is_relative_to(args.copy_to.resolve()):
            ram_pack = args.pack  # already in RAM-backed storage
        elif not (ram_pack / "manifest.json").exists():
            shutil.rmtree(ram_pack, ignore_errors=True)
            shutil.copytree(args.pack, ram_pack)

    disk_pack = args.pack
    if "disk" in storages and args.disk_dir:
        disk_pack = args.disk_dir / args.pack.name
        if not (disk_pack / "manifest.json").exists():
            shutil.rmtree(disk_pack, ignore_errors=True)
            shutil.copytree(args.pack, disk_pack)

    if not args.no_stock:
        res["stock"] = measure(args.model, tokens, args.prefill, args.decode)
        p = Provider.open(ram_pack or args.pack, cache_vram_reserve_mib=0)
        try:
            res["all_cached"] = measure(args.model, tokens, args.prefill, args.decode, p, warm=True)
        finally:
            p.close()
    compute_s = res["all_cached"]["decode_step_ms"] / 1e3 if "all_cached" in res else None

    for storage in storages:
        per = dict(x.split("=", 1) for x in args.configs_for)
        names = per.get(storage) or ((args.disk_configs or args.configs) if storage == "disk" else args.configs)
        for name in names.split(","):
            cfg = dict(CONFIGS[name])
            env = os.environ.pop("EXPERT_PACK_TEST_STORAGE", None)
            pack = disk_pack if storage == "disk" else ram_pack
            gbps = None
            if storage not in ("disk", "ram"):
                gbps = float(storage)
                os.environ["EXPERT_PACK_TEST_STORAGE"] = f"{gbps}GB/s,{args.latency_us}us,{args.queue_depth}"
            if storage == "disk":
                drop_caches()
            p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, slots), cache_vram_reserve_mib=0, **cfg)
            try:
                r = measure(args.model, tokens, args.prefill, args.decode, p)
                r["timeline"] = p.timeline()
            finally:
                p.close()
                os.environ.pop("EXPERT_PACK_TEST_STORAGE", None)
                if env is not None:
                    os.environ["EXPERT_PACK_TEST_STORAGE"] = env
            r.update(storage=storage, config=name, provider_config=cfg, emulated_gbps=gbps,
                     timeline_summary=timeline_summary(r["timeline"]))
            if gbps and compute_s:
                limit = 1.0 / max(r["pack_bytes_per_token"] / (gbps * 1e9), compute_s)
                r["drive_bound_tok_s"] = limit
                r["of_drive_bound"] = r["decode_tok_s"] / limit
            res["runs"].append(r)
            print(f"{storage:>5} {name:<22} decode {r['decode_tok_s']:7.2f} tok/s, {r['decode_step_ms']:7.2f} ms/token, "
                  f"{r['pack_bytes_per_token'] / 1e6:6.1f} MB/token, hit rate {r['hit_rate']:.3f}"
                  + (f", {100 * r['of_drive_bound']:.0f}% of the drive-bound {r['drive_bound_tok_s']:.1f}"
                     if "of_drive_bound" in r else ""), flush=True)
            print("      timeline per layer (ms):", {k: round(v, 3) for k, v in r["timeline_summary"].items()},
                  flush=True)
            (args.out / "storage.json").write_text(json.dumps(res, indent=1) + "\n")
    if args.prefill_sweep:
        from expert_pack_devtools.lossless import Session
        data_bytes = m["pack"]["data_size"]
        res["prefill"] = []
        for n in (int(x) for x in args.prefill_sweep.split(",")):
            prompt = (tokens * (n // len(tokens) + 1))[:n]
            ubs = sorted({min(512, n), n}) if n <= 4096 else [n]  # ubatch 512 of a long prompt: many slow passes
            rows = [("stock", None, n)] + [(args.prefill_config, args.prefill_config, ub) for ub in ubs]
            for label, cfg_name, ub in rows:
                p = None
                if cfg_name is not None:
                    p = Provider.open(ram_pack or args.pack, cache_vram_mib=cache_mib_for_slots(ram_pack or args.pack,
                                      slots), cache_vram_reserve_mib=0, **CONFIGS[cfg_name])
                try:
                    sess = Session(args.model, p, n_ctx=n + 16, n_ubatch=ub)
                    try:
                        t0 = time.perf_counter()
                        rc = sess.decode(prompt)
                        dt = time.perf_counter() - t0
                        st = p.stats() if p else {}
                    finally:
                        sess.close()
                except Exception as e:  # noqa: BLE001 -- a size that does not fit is a result, not the end
                    r = {"prompt_tokens": n, "system": label, "n_ubatch": ub, "error": str(e)}
                    print(f"prefill {n:>5} {label:<18} ub {ub:>5}: {e}", flush=True)
                    res["prefill"].append(r)
                    continue
                finally:
                    if p:
                        p.close()
                r = {"prompt_tokens": n, "system": label, "n_ubatch": ub, "rc": rc, "seconds": dt,
                     "prefill_tok_s": n / dt}
                if st:
                    r.update(pack_read_bytes=st["pack_read_bytes"], bytes_per_prompt_token=st["pack_read_bytes"] / n,
                             passes_over_pack=st["pack_read_bytes"] / data_bytes, steps=st["steps"],
                             cache_misses=st["cache_misses"])
                res["prefill"].append(r)
                print(f"prefill {n:>5} {label:<18} ub {ub:>5}: {r['prefill_tok_s']:8.1f} tok/s"
                      + (f", {r['bytes_per_prompt_token'] / 1e6:.1f} MB/prompt token, "
                         f"{r['passes_over_pack']:.2f} passes over the pack" if st else ""), flush=True)
                (args.out / "storage.json").write_text(json.dumps(res, indent=1) + "\n")
    if "stock" in res:
        print(f"stock all-GPU: {res['stock']['decode_tok_s']:.1f} tok/s; every expert cached: "
              f"{res['all_cached']['decode_tok_s']:.1f} tok/s ({res['all_cached']['decode_step_ms']:.2f} ms/token)")
    (args.out / "storage.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
