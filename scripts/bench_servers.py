#!/usr/bin/env python3
"""The reference workload through the servers, with the same provider configuration: `expert-pack serve`, the
fork's `llama-server --expert-pack`, and stock `llama-server` with every weight on the GPU.

    python scripts/bench_servers.py --model M.gguf --pack DIR --out OUT [--cache-fraction 0.14]
        [--read-threads 16 --read-splits 8] [--n-predict 64] [--budget-s 60] [--systems serve,fork,stock]

Each server is started on 127.0.0.1, waited for (/health), sent `expert-pack bench-client`'s reference workload
(temperature 0, EOS ignored, a seconds budget) and stopped; its report goes to OUT/NAME.json and the table over all
of them to OUT/table.md. Put the pack on RAM-backed storage (/dev/shm) to see the servers' own cost.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from expert_pack_devtools import bench_client
from expert_pack_devtools.lossless import cache_mib_for_slots
from ggml_expert_pack.packer.format import load_manifest
from expert_pack_devtools.proc import expert_pack_argv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the original GGUF (stock runs it)")
    ap.add_argument("--pack", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache-fraction", type=float, default=0.14)
    ap.add_argument("--read-threads", type=int)
    ap.add_argument("--read-splits", type=int)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--systems", default="serve,fork,stock")
    args = ap.parse_args()
    m = load_manifest(args.pack)
    slots = max(8, round(args.cache_fraction * m["n_experts"]))
    cache = f"{cache_mib_for_slots(args.pack, slots):.3f}"
    knobs = []
    for flag, v in (("read-threads", args.read_threads), ("read-splits", args.read_splits)):
        if v is not None:
            knobs.append((flag, str(v)))
    trunk = str(args.pack / "trunk.gguf")
    ep = expert_pack_argv()
    systems = {
        "serve": ep + ["serve", "-m", trunk, "--expert-pack", str(args.pack), "--cache-mib", cache,
                       "--cache-reserve-mib", "0", "-c", str(args.ctx)] + [x for f, v in knobs for x in (f"--{f}", v)],
        "fork": ep + ["llama-server", "-m", trunk, "--expert-pack", str(args.pack), "--expert-cache-mib", cache,
                      "--expert-cache-reserve-mib", "0", "-ngl", "99", "-c", str(args.ctx), "--metrics"]
                + [x for f, v in knobs for x in (f"--expert-{f}", v)],
        "stock": ep + ["llama-server", "-m", str(args.model), "-ngl", "99", "-c", str(args.ctx), "--metrics"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.systems.split(","):
        port = bench_client.free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = systems[name] + ["--host", "127.0.0.1", "--port", str(port)]
        log = open(args.out / f"{name}.log", "w")
        print(f"{name}: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if not bench_client.wait_healthy(base, proc, 600):
                print(f"{name}: did not come up (see {name}.log)", flush=True)
                continue
            label = "stock-all-weights-on-gpu" if name == "stock" else f"{name}-{slots}-slots"
            rep = bench_client.run(base, label, n_predict=args.n_predict, budget_s=args.budget_s)
            bench_client.write_json(rep, args.out / f"{name}.json")
            print(bench_client.markdown_table([asdict(rep)]), flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
            time.sleep(1)
    reports = bench_client.load_reports(sorted(args.out.glob("*.json")))
    (args.out / "table.md").write_text(bench_client.markdown_table(reports, None))
    print((args.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
