#!/usr/bin/env python3
"""Packing speed against a plain copy of the same bytes on the same disk, measured in one run.

    python scripts/bench_pack.py --model MODEL.gguf --work DIR [--out RESULTS_DIR] [--synth-shape 30b-a3b]

If MODEL does not exist it is generated first (`expert-pack synth --shape SHAPE`). Page caches are dropped
before the copy and before the build when the process may (root); otherwise the result says so.
Writes pack_speed.json into --out and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from expert_pack_devtools.proc import expert_pack_argv


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def copy_file(src: Path, dst: Path, chunk: int = 64 << 20) -> float:
    """A plain sequential copy with the same fsync discipline as the packer; returns seconds."""
    t0 = time.time()
    with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = fi.readinto(buf)
            if not n:
                break
            fo.write(view[:n])
        os.fsync(fo.fileno())
    return time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory on the disk under test")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--synth-shape", default="30b-a3b")
    ap.add_argument("--repeat", type=int, default=2, help="copy/pack alternations")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cpus": os.cpu_count()}

    if not args.model.exists():
        t0 = time.time()
        subprocess.run([*expert_pack_argv(), "synth", str(args.model),
                        "--shape", args.synth_shape, "--quiet"], check=True)
        res["synth_seconds"] = time.time() - t0
        res["synth_bytes_per_s"] = args.model.stat().st_size / res["synth_seconds"]
    size = args.model.stat().st_size
    res["model_bytes"] = size

    # copy and pack alternate, `--repeat` times each, caches dropped before every run: the VM disk has a
    # host-side cache behind it, so whichever runs second on a file would otherwise be flattered
    from ggml_expert_pack.packer import build, verify
    copies, cps, packs = [], [], []
    pack_dir = args.work / "pack"
    copy_dst = args.work / "copy.gguf"
    for _ in range(args.repeat):
        res["caches_dropped"] = drop_caches()
        copies.append(size / copy_file(args.model, copy_dst))
        copy_dst.unlink()
        drop_caches()
        t0 = time.time()
        subprocess.run(["cp", str(args.model), str(copy_dst)], check=True)
        subprocess.run(["sync", str(copy_dst)], check=True)
        cps.append(size / (time.time() - t0))
        copy_dst.unlink()
        drop_caches()
        shutil.rmtree(pack_dir, ignore_errors=True)
        r = build(args.model, pack_dir, progress=False)
        packs.append(r.source_bytes / r.seconds)
    res["copy_bytes_per_s_runs"], res["cp_bytes_per_s_runs"], res["pack_bytes_per_s_runs"] = copies, cps, packs
    res["cp_bytes_per_s"] = sum(cps) / len(cps)
    # the faster of the two copies is the baseline
    res["copy_bytes_per_s"] = max(sum(copies) / len(copies), res["cp_bytes_per_s"])
    res["pack_bytes_per_s"] = sum(packs) / len(packs)
    res["pack_source_bytes"], res["pack_written_bytes"] = r.source_bytes, r.pack_bytes + r.trunk_bytes
    res["pack_over_copy"] = res["pack_bytes_per_s"] / res["copy_bytes_per_s"]
    drop_caches()
    t0 = time.time()
    verify(pack_dir, progress=False)
    res["verify_seconds"] = time.time() - t0
    shutil.rmtree(pack_dir, ignore_errors=True)

    (args.out / "pack_speed.json").write_text(json.dumps(res, indent=2) + "\n")
    gb = 1e9
    print(f"model {size / gb:.2f} GB; caches dropped: {res['caches_dropped']}")
    runs = lambda xs: ", ".join(f"{x / gb:.2f}" for x in xs)
    print(f"copy   {sum(copies) / len(copies) / gb:6.2f} GB/s  (runs: {runs(copies)}; 64 MiB read/write + fsync)")
    print(f"cp     {res['cp_bytes_per_s'] / gb:6.2f} GB/s  (runs: {runs(cps)}; coreutils cp + sync)")
    print(f"pack   {res['pack_bytes_per_s'] / gb:6.2f} GB/s  (runs: {runs(packs)}) = {100 * res['pack_over_copy']:.0f}% of the faster copy")
    print(f"verify {res['verify_seconds']:7.1f} s (every checksum)")
    if "synth_seconds" in res:
        print(f"synth  {res['synth_seconds']:7.1f} s  {res['synth_bytes_per_s'] / gb:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
