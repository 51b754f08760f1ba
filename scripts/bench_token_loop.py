#!/usr/bin/env python3
"""The cost of serve's token loop per token, outside llama.cpp: a generation through `server.engine.Engine` (the
code `expert-pack serve` runs per request) with the decode and the sampler timed apart, so that what is left is the
loop's own work (text, stop strings, bookkeeping), largely independent of the model and of the machine's load.

    python scripts/bench_token_loop.py --pack PACK [--tokens 150] [--reps 4] [--rev REV] [--json OUT.json]

`--rev REV` runs server/engine.py as it was at git revision REV instead (its sibling modules from the same
revision), for a before/after on one machine. Prints one line per repetition and the median.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def engine_module(rev: str | None):
    if rev is None:
        return importlib.import_module("ggml_expert_pack.server.engine")
    pkg = Path(tempfile.mkdtemp()) / "server_at_rev"
    pkg.mkdir()
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:server"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith(".py"):
            src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:server/{name}"], check=True,
                                 capture_output=True).stdout
            (pkg / name).write_bytes(src)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("server_at_rev.engine")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", type=Path, required=True, help="an expert pack (its trunk.gguf is loaded with it)")
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rev", help="time server/engine.py of this git revision instead")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    from llama_cpp import Llama, _internals
    eng_mod = engine_module(a.rev)
    llm = Llama(str(a.pack / "trunk.gguf"), expert_pack={"pack_dir": str(a.pack)}, n_ctx=1024,
                n_threads=a.threads, verbose=False)
    acc = {"decode": 0.0, "sample": 0.0}

    def timed(cls, name, key):
        f = getattr(cls, name)

        def g(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                acc[key] += time.perf_counter() - t
        setattr(cls, name, g)
    timed(_internals.LlamaContext, "decode", "decode")
    sampling = sys.modules.get(eng_mod.__name__.rsplit(".", 1)[0] + ".sampling")
    timed(sampling.Sampler if sampling is not None else _internals.LlamaSampler, "sample", "sample")
    eng = eng_mod.Engine(llm, "bench")
    prompt = llm.tokenize(b"The expert pack streams the routed experts of a model", add_bos=True)
    rows = []
    for rep in range(a.reps):
        acc.update(decode=0.0, sample=0.0)
        r = eng_mod.Result()
        t = time.perf_counter()
        for _ in eng.generate(prompt, a.tokens, r, temperature=0.8, seed=1, ignore_eos=True):
            pass
        total = time.perf_counter() - t
        n = r.timings.predicted_n
        row = {"loop_ms": 1e3 * (total - acc["decode"] - acc["sample"]) / n, "sample_ms": 1e3 * acc["sample"] / n,
               "decode_ms": 1e3 * acc["decode"] / n, "tokens": n}
        rows.append(row)
        print(f"rep {rep}: loop {row['loop_ms']:.3f}  sampler {row['sample_ms']:.3f}  decode {row['decode_ms']:.3f} "
              f"ms per token ({n} tokens)", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("loop_ms", "sample_ms", "decode_ms")}
    print(f"median: loop {med['loop_ms']:.3f}  sampler {med['sample_ms']:.3f}  decode {med['decode_ms']:.3f} ms/token")
    if a.json:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        a.json.write_text(json.dumps({"engine_rev": a.rev or commit, "commit": commit, "machine": platform.node(),
                                      "cpu": platform.processor() or platform.machine(), "date": time.strftime(
                                          "%Y-%m-%d %H:%M UTC", time.gmtime()),
                                      "config": {"pack": str(a.pack), "tokens": a.tokens, "threads": a.threads,
                                                 "temperature": 0.8, "seed": 1, "ignore_eos": True},
                                      "reps": rows, "median": med}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
