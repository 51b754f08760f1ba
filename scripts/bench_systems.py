#!/usr/bin/env python3
"""The reference workload on several systems side by side, under a host-RAM cap (docs/BENCHMARKS.md, "Method: the reference workload under a RAM cap").

    python scripts/bench_systems.py --out RESULTS [--systems b,c,e,d,c-tiny,a] [--budget-s 150] ...

For each system: drop the page cache, start the server inside a cgroup v2 whose memory.max is --ram-cap of the
model (page cache included), wait for /health, send the reference workload with `expert-pack bench-client`'s code
(10 fixed requests, temperature 0, EOS ignored, a seconds budget), read the server's CPU time and the cgroup's
memory figures, stop it. Systems:
  a       stock llama-server, experts in host RAM (--cpu-moe), the rest on the GPU
  b       stock llama-server, all weights on the GPU (the all-hit ceiling; the RAM cap only slows its load)
  c       expert-pack serve (our Python server), O_DIRECT reads, cache --cache-frac of the experts
  d       the same with buffered reads (direct_io off)
  e       the fork's own llama-server --expert-pack, cache as (c)
  c-tiny  (c) with a cache of --tiny-cache-frac of the experts (the reference's Kimi-K3 ratio)
  f       (c) plus a host-RAM tier of --ram-tier-frac of the model (pinned, inside the same RAM cap; victim mode,
          the default until 2026-12-01, pinned here like f-incl, h and h4)
  f-incl  (f) with the inclusive RAM tier (every expert read goes into it)
  h       (f) plus next-layer prefetch into the RAM tier (--prefetch on)
  h4      (h) with 4 read threads for the demand misses (until 2026-12-01 also 4 prefetch threads; now one)
  g       (c) with a step's misses read by 4 threads (read_threads), each copy started as its read lands: the
          provider's default since 2026-12-01; every other system of ours pins --read-threads 1 (or
          --expert-read-threads 1) so that its configuration stays the one measured before
  s       (f) in spill mode (the default since 2026-12-01: popularity-ranked tier, the device's popular victims
          copied back into it); sp: (s) plus prefetch
  s4, sp4 (s) and (sp) with the default 4 read threads: compare with (g)
"stock" is the fork's llama-server binary without --expert-pack: the patches are inert without a pack (the
lossless tests show stock-identical logits on that path), so it is the same source and build as (e).

Also measured in the same run: O_DIRECT read bandwidth at expert granularity and pinned/pageable host-to-device
bandwidth. Each system's result goes to OUT/SYSTEM.json (bench-client's report plus the run's extras), then
OUT/table.md and OUT/rates.png from every JSON in OUT (results of several runs can be assembled).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import drop_caches, odirect_bandwidth  # noqa: E402

from expert_pack_devtools import bench_client  # noqa: E402
from expert_pack_devtools.proc import expert_pack_argv  # noqa: E402

CGROUP = Path("/sys/fs/cgroup")


# ---- machine figures ---------------------------------------------------------------------------------------
def h2d_bandwidth(mib: int = 256, reps: int = 8) -> dict | None:
    """Pinned and pageable host-to-device copy bandwidth through the CUDA runtime (ctypes), or None."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    n = mib << 20
    dev, pinned = ctypes.c_void_p(), ctypes.c_void_p()
    if rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(n)) or rt.cudaMallocHost(ctypes.byref(pinned), ctypes.c_size_t(n)):
        return None
    pageable = ctypes.create_string_buffer(n)
    out = {}
    for label, src in (("pinned", pinned), ("pageable", ctypes.cast(pageable, ctypes.c_void_p))):
        rt.cudaMemcpy(dev, src, ctypes.c_size_t(n), 1)  # warm-up; 1 = cudaMemcpyHostToDevice
        rt.cudaDeviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            rt.cudaMemcpy(dev, src, ctypes.c_size_t(n), 1)
        rt.cudaDeviceSynchronize()
        out[f"{label}_bytes_per_s"] = reps * n / (time.perf_counter() - t0)
    rt.cudaFree(dev)
    rt.cudaFreeHost(pinned)
    return out


# ---- cgroup (host-RAM cap) -----------------------------------------------------------------------------------
def make_cgroup(name: str, max_bytes: int) -> Path | None:
    """A cgroup v2 with memory.max (page cache counts against it, swap off); None where cgroups are unavailable."""
    try:
        ctl = (CGROUP / "cgroup.subtree_control")
        if "memory" not in ctl.read_text().split():
            ctl.write_text("+memory")
        cg = CGROUP / name
        cg.mkdir(exist_ok=True)
        (cg / "memory.max").write_text(str(max_bytes))
        try:
            (cg / "memory.swap.max").write_text("0")
        except OSError:
            pass
        return cg
    except OSError as e:
        print(f"no cgroup v2 memory controller ({e}): running without the RAM cap", file=sys.stderr)
        return None


def cgroup_figures(cg: Path | None) -> dict:
    if cg is None:
        return {}
    out = {}
    for f in ("memory.peak", "memory.current", "memory.max"):
        try:
            out[f.replace(".", "_")] = (cg / f).read_text().strip()
        except OSError:
            pass
    try:
        stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines())
        out.update({f"stat_{k}": int(stat[k]) for k in ("anon", "file", "pgmajfault") if k in stat})
    except OSError:
        pass
    return out


# ---- servers -------------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class Server:
    def __init__(self, cmd: list[str], log: Path, cg: Path | None, timeout_s: float = 600):
        self.port = bench_client.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.log = open(log, "w")
        print("$", " ".join(cmd), flush=True)

        def enter_cgroup():
            os.setsid()
            if cg is not None:
                (cg / "cgroup.procs").write_text(str(os.getpid()))
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=enter_cgroup)
        if not bench_client.wait_healthy(self.base, self.proc, timeout_s):
            self.stop()
            raise RuntimeError(f"server did not start (exit {self.proc.returncode}); log: {log}")
        self.load_s = time.time() - t0

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- the report: ratios, bounds, projection -------------------------------------------------------------------
def _all(rep: dict, key: str) -> float | None:
    return rep.get("summary", {}).get("all", {}).get(key)


def report(out: Path) -> str:
    """Markdown from OUT/*.json: the table with ratios to (a), the ratios the issue asks for, read bandwidth against
    the O_DIRECT bandwidth and the physical bound, O_DIRECT's CPU savings, and a projection to a PCIe 5 SSD."""
    machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
    reps = {r["system"]: r for r in bench_client.load_reports(
        sorted(p for p in out.glob("*.json") if not p.name.startswith("machine")))}
    lines = [f"Machine: {machine.get('cpus')} CPUs; model {machine.get('model_bytes', 0) / 1e9:.2f} GB; RAM cap "
             f"{machine.get('ram_cap_bytes', 0) / 1e9:.2f} GB (cgroup v2 memory.max, page cache included); cache "
             f"{machine.get('cache_slots')} of {machine.get('n_experts')} experts per layer "
             f"({machine.get('cache_mib', 0):.0f} MiB), tiny cache {machine.get('tiny_cache_slots')} "
             f"({machine.get('tiny_cache_mib', 0):.0f} MiB)."]
    od = (machine.get("odirect") or {}).get("bytes_per_s")
    h2d = machine.get("h2d") or {}
    if od:
        lines.append(f"O_DIRECT random expert reads, 1 thread, same run: {od / 1e9:.2f} GB/s. Host-to-device: pinned "
                     f"{h2d.get('pinned_bytes_per_s', 0) / 1e9:.1f} GB/s, pageable {h2d.get('pageable_bytes_per_s', 0) / 1e9:.1f} GB/s.")
    lines += ["", bench_client.markdown_table(list(reps.values()), "a-stock-cpu-moe")]
    pairs = [("c-ours-odirect", "a-stock-cpu-moe"), ("c-ours-odirect", "b-stock-all-gpu"),
             ("c-ours-odirect", "d-ours-buffered"), ("c-ours-odirect", "e-fork-llama-server"),
             ("f-ours-ram-tier", "c-ours-odirect"), ("f-ours-ram-tier-inclusive", "c-ours-odirect"),
             ("h-ours-ram-tier-prefetch", "c-ours-odirect"), ("h-ours-ram-tier-prefetch", "f-ours-ram-tier"),
             ("h4-ours-ram-tier-prefetch-4-threads", "c-ours-odirect"),
             ("g-ours-read-threads-4", "c-ours-odirect"),
             ("s-ours-spill-tier", "c-ours-odirect"), ("sp-ours-spill-tier-prefetch", "c-ours-odirect"),
             ("s4-ours-spill-tier-4-threads", "g-ours-read-threads-4"),
             ("sp4-ours-spill-tier-prefetch-4-threads", "g-ours-read-threads-4"),
             ("sp4-ours-spill-tier-prefetch-4-threads", "c-ours-odirect")]
    lines += ["| ratio | decode | prefill |", "|---|---|---|"]
    for x, y in pairs:
        if x in reps and y in reps:
            r = [(_all(reps[x], k) or 0) / (_all(reps[y], k) or float("nan")) for k in ("decode_tok_s", "prefill_tok_s")]
            lines.append(f"| {x} ÷ {y} | {r[0]:.2f}x | {r[1]:.2f}x |")
    lines += ["", "| system | decode tok/s | SSD MB per decode token | read GB/s while reading | physical bound tok/s "
              "(O_DIRECT GB/s ÷ bytes per token) | of the bound | CPU s per GB read (user+sys / sys) | page cache at end |",
              "|---|---|---|---|---|---|---|---|"]
    for name, rp in reps.items():
        ex = rp.get("extra", {})
        bpt = _all(rp, "ssd_bytes_per_token")
        if bpt is None:
            continue
        delta = ex.get("pack_delta", {})
        rs = delta.get("read_seconds")
        bw = delta.get("pack_read_bytes", 0) / rs if rs else None
        dec = _all(rp, "decode_tok_s") or 0
        bound = od / bpt if od and bpt else None
        cpu = ex.get("cpu_s_per_gb_read")
        lines.append(f"| {name} | {dec:.2f} | {bpt / 1e6:.1f} | {bw / 1e9 if bw else float('nan'):.2f} | "
                     f"{bound if bound else float('nan'):.2f} | {dec / bound if bound else float('nan'):.0%} | "
                     f"{cpu if cpu is not None else float('nan'):.2f} / {ex.get('cpu_sys_s_per_gb_read', float('nan')):.2f} | "
                     f"{ex.get('cgroup', {}).get('stat_file', 0) / 1e9:.2f} GB |")
    c = reps.get("c-ours-odirect")
    if c:
        bpt = _all(c, "ssd_bytes_per_token")
        dec = _all(c, "decode_tok_s")
        delta = c.get("extra", {}).get("pack_delta", {})
        if bpt and dec and delta.get("read_seconds"):
            # per decode token: time in reads at the bandwidth the run achieved while reading, and everything else
            # (compute, lookups, copies, the hook's round trips); the projection swaps the disk for a PCIe 5 SSD
            # and keeps everything else
            bw = delta["pack_read_bytes"] / delta["read_seconds"]
            t_tok = 1 / dec
            t_read = bpt / bw
            t_rest = max(0.0, t_tok - t_read)
            lines += ["", f"Projection from (c): {bpt / 1e6:.0f} MB read per decode token; {t_tok * 1e3:.0f} ms per "
                      f"token here, of which ~{t_read * 1e3:.0f} ms reading at the {bw / 1e9:.2f} GB/s achieved while "
                      f"reading and ~{t_rest * 1e3:.0f} ms the rest."]
            for gbs in (12, 14):
                lines.append(f"- PCIe 5 SSD at {gbs} GB/s: {1 / (bpt / (gbs * 1e9) + t_rest):.1f} tok/s "
                             f"(read {bpt / (gbs * 1e9) * 1e3:.0f} ms + rest {t_rest * 1e3:.0f} ms per token)")
            lines += overlap_lines(reps, bw, t_rest)
    lines += step_profile_lines(reps)
    return "\n".join(lines) + "\n"


def step_profile_lines(reps: dict) -> list[str]:
    """Per system of ours, where a graph step's expert work goes (the provider's timers, over every step of the run,
    prompts included): the acquire ops (the device waits for them), the part of that spent waiting for running
    prefetch reads or for copies, and the pack reads' thread time (summed over the read threads)."""
    lines = ["", "| system | steps | acquire ms per step | of which prefetch wait | of which copy wait | "
             "read ms per step (all threads) |", "|---|---|---|---|---|---|"]
    for name, rp in reps.items():
        d = rp.get("extra", {}).get("pack_delta", {})
        steps = d.get("steps")
        if not steps or "acquire_seconds" not in d:
            continue
        per = {k: d.get(f"{k}_seconds", float("nan")) * 1e3 / steps for k in ("acquire", "prefetch_wait", "copy_wait", "read")}
        lines.append(f"| {name} | {steps:.0f} | {per['acquire']:.1f} | {per['prefetch_wait']:.1f} | "
                     f"{per['copy_wait']:.1f} | {per['read']:.1f} |")
    return lines


def overlap_lines(reps: dict, bw: float, t_rest: float) -> list[str]:
    """Per system of ours: decode step time against max(read time, compute time) of the same step. The
    read time is the step's pack bytes at the bandwidth (c) achieved while reading (the disk's busy time, whoever
    reads); the compute time is (c)'s time outside reads (nothing here changes it). Serial reads and compute give
    read + compute; full overlap gives the larger of the two. With prefetch, also its counters. Systems with several
    read threads are left out: (c)'s one-thread bandwidth is not their disk's busy bandwidth, which no counter gives."""
    lines = ["", "| system | ms per decode token | read ms | compute ms | step ÷ max(read, compute) | "
             "prediction accuracy | prefetches used / wasted / dropped of issued |", "|---|---|---|---|---|---|---|"]
    for name, rp in reps.items():
        bpt, dec = _all(rp, "ssd_bytes_per_token"), _all(rp, "decode_tok_s")
        cmd = rp.get("extra", {}).get("command", [])
        threads = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a in ("--read-threads", "--expert-read-threads")]
        if not bpt or not dec or threads[-1:] != ["1"]:
            continue
        t_tok, t_read = 1 / dec, bpt / bw
        d = rp.get("extra", {}).get("pack_delta", {})
        acc = d["predicted_correct"] / d["predicted"] if d.get("predicted") else None
        pf = (f"{d.get('prefetch_used', 0):.0f} / {d.get('prefetch_wasted', 0):.0f} / "
              f"{d.get('prefetch_cancelled', 0):.0f} of {d['prefetch_issued']:.0f}") if d.get("prefetch_issued") else "–"
        lines.append(f"| {name} | {t_tok * 1e3:.0f} | {t_read * 1e3:.0f} | {t_rest * 1e3:.0f} | "
                     f"{t_tok / max(t_read, t_rest):.2f} | {f'{acc:.1%}' if acc is not None else '–'} | {pf} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=Path("/tmp/ep-bench/30b-a3b.gguf"),
                    help="the original GGUF (generated with --shape if missing)")
    ap.add_argument("--pack", type=Path, default=Path("/tmp/ep-bench/30b-a3b.pack"), help="its pack (built if missing)")
    ap.add_argument("--shape", default="30b-a3b")
    ap.add_argument("--systems", default="b,c,e,d,c-tiny,f,f-incl,h,h4,g,a")
    ap.add_argument("--ram-cap", type=float, default=0.20, help="host RAM cap as a fraction of the model file")
    ap.add_argument("--cache-frac", type=float, default=0.14, help="expert cache as a fraction of the experts")
    ap.add_argument("--tiny-cache-frac", type=float, default=0.005)
    ap.add_argument("--ram-tier-frac", type=float, default=0.10, help="host-RAM tier (system f), fraction of model")
    ap.add_argument("--n-predict", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=150, help="seconds per system for the workload")
    ap.add_argument("--slow-n-predict", type=int, default=4, help="tokens per request for system a")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prepare-only", action="store_true", help="generate and pack the model, then stop")
    ap.add_argument("--report-only", action="store_true", help="write OUT/report.md from OUT/*.json, then stop")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        (args.out / "report.md").write_text(report(args.out))
        print((args.out / "report.md").read_text())
        return 0

    from expert_pack_devtools.lossless import cache_mib_for_slots
    from ggml_expert_pack.packer import build
    from ggml_expert_pack.packer.format import load_manifest
    from ggml_expert_pack.tools import tool_path

    py = expert_pack_argv()
    if not args.model.exists():
        args.model.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(py + ["synth", str(args.model), "--shape", args.shape, "--quiet"], check=True)
    if not (args.pack / "manifest.json").exists():
        build(args.model, args.pack, force=True)
    if args.prepare_only:
        return 0

    m = load_manifest(args.pack)
    n_exp = m["n_experts"]
    model_bytes = args.model.stat().st_size
    trunk = args.pack / "trunk.gguf"
    slots = max(m.get("n_expert_used", 8), round(args.cache_frac * n_exp))
    tiny_slots = max(m.get("n_expert_used", 8), round(args.tiny_cache_frac * n_exp))
    cache_mib = cache_mib_for_slots(args.pack, slots)
    tiny_mib = cache_mib_for_slots(args.pack, tiny_slots)
    cap = int(args.ram_cap * model_bytes)
    run_info = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": str(args.model), "model_bytes": model_bytes,
                "n_experts": n_exp, "ram_cap_bytes": cap, "cache_slots": slots, "cache_mib": cache_mib,
                "tiny_cache_slots": tiny_slots, "tiny_cache_mib": tiny_mib, "cpus": os.cpu_count()}
    drop_caches()
    run_info["odirect"] = odirect_bandwidth(args.pack)
    run_info["h2d"] = h2d_bandwidth()
    (args.out / "machine.json").write_text(json.dumps(run_info, indent=1) + "\n")
    print(json.dumps(run_info, indent=1), flush=True)

    server = str(tool_path("llama-server"))
    common = ["--host", "127.0.0.1", "--port", "{port}", "-c", str(args.ctx), "-np", "1", "-ngl", "99", "--metrics",
              "--no-webui"]
    ours = py + ["serve", "-m", str(trunk), "--expert-pack", str(args.pack), "--port", "{port}", "-c", str(args.ctx),
                 "-ngl", "-1"]
    ram_tier_mib = args.ram_tier_frac * model_bytes / 2**20
    # one read thread unless a system says otherwise: the systems keep the configurations measured before
    # read_threads' default became 4 (system g is that default)
    ours_1t = ours + ["--read-threads", "1"]
    systems = {
        "a": ([server, "-m", str(args.model), "--cpu-moe", *common], args.slow_n_predict),
        "b": ([server, "-m", str(args.model), *common], args.n_predict),
        "c": (ours_1t + ["--cache-mib", f"{cache_mib}"], args.n_predict),
        "d": (ours_1t + ["--cache-mib", f"{cache_mib}", "--direct-io", "off"], args.n_predict),
        "e": ([server, "-m", str(trunk), "--expert-pack", str(args.pack), "--expert-cache-mib", f"{cache_mib}",
               "--expert-read-threads", "1", *common], args.n_predict),
        "c-tiny": (ours_1t + ["--cache-mib", f"{tiny_mib}"], args.n_predict),
        "f": (ours_1t + ["--cache-mib", f"{cache_mib}", "--ram-cache-mib", f"{ram_tier_mib:.0f}",
                         "--ram-tier-mode", "victim"], args.n_predict),
        "f-incl": (ours_1t + ["--cache-mib", f"{cache_mib}", "--ram-cache-mib", f"{ram_tier_mib:.0f}",
                           "--ram-tier-mode", "inclusive"], args.n_predict),
        "h": (ours_1t + ["--cache-mib", f"{cache_mib}", "--ram-cache-mib", f"{ram_tier_mib:.0f}", "--prefetch", "on",
                         "--ram-tier-mode", "victim"], args.n_predict),
        "h4": (ours + ["--cache-mib", f"{cache_mib}", "--ram-cache-mib", f"{ram_tier_mib:.0f}", "--prefetch", "on",
                            "--read-threads", "4", "--ram-tier-mode", "victim"], args.n_predict),
        "g": (ours + ["--cache-mib", f"{cache_mib}", "--read-threads", "4"], args.n_predict),
    }
    spill = ["--cache-mib", f"{cache_mib}", "--ram-cache-mib", f"{ram_tier_mib:.0f}", "--ram-tier-mode", "spill"]
    systems.update({
        "s": (ours_1t + spill, args.n_predict),
        "sp": (ours_1t + spill + ["--prefetch", "on"], args.n_predict),
        "s4": (ours + spill + ["--read-threads", "4"], args.n_predict),
        "sp4": (ours + spill + ["--prefetch", "on", "--read-threads", "4"], args.n_predict),
    })
    names = {"a": "a-stock-cpu-moe", "b": "b-stock-all-gpu", "c": "c-ours-odirect", "d": "d-ours-buffered",
             "e": "e-fork-llama-server", "c-tiny": "c-ours-odirect-tiny-cache", "f": "f-ours-ram-tier",
             "g": "g-ours-read-threads-4", "f-incl": "f-ours-ram-tier-inclusive", "h": "h-ours-ram-tier-prefetch",
             "h4": "h4-ours-ram-tier-prefetch-4-threads", "s": "s-ours-spill-tier", "sp": "sp-ours-spill-tier-prefetch",
             "s4": "s4-ours-spill-tier-4-threads", "sp4": "sp4-ours-spill-tier-prefetch-4-threads"}
    cg = make_cgroup("expert-pack-bench", cap)
    for key in args.systems.split(","):
        cmd, n_predict = systems[key]
        need = {"f": "--ram-cache-mib", "f-incl": "--ram-tier-mode", "h": "--prefetch", "h4": "--prefetch",
                "s": "spill", "sp": "spill", "s4": "spill", "sp4": "spill"}.get(key)
        if need:
            probe = subprocess.run(py + ["serve", "--help"], capture_output=True, text=True)
            if need not in probe.stdout:
                print(f"system {key} skipped: this build has no {need}", flush=True)
                continue
        name = names[key]
        drop_caches()
        if cg is not None:
            try:
                (cg / "memory.reclaim").write_text(str(1 << 40))
                (cg / "memory.peak").write_text("0")  # resettable on recent kernels
            except OSError:
                pass
        try:
            srv = Server(cmd, args.out / f"{name}.log", cg)
        except RuntimeError as e:
            print(f"{name}: {e}", flush=True)
            (args.out / f"{name}.error").write_text(str(e) + "\n")
            continue
        try:
            u0, s0 = cpu_seconds(srv.proc.pid)
            before = bench_client.pack_counters(srv.base)
            rep = bench_client.run(srv.base, name, n_predict=n_predict, budget_s=args.budget_s)
            u1, s1 = cpu_seconds(srv.proc.pid)
            after = bench_client.pack_counters(srv.base)
            d = asdict(rep)
            extra = {"load_s": srv.load_s, "cpu_user_s": u1 - u0, "cpu_sys_s": s1 - s0, "command": cmd,
                     "cgroup": cgroup_figures(cg), "run": run_info}
            if before and after:
                delta = {k: after[k] - before.get(k, 0) for k in after if k != "hit_ratio"}
                extra["pack_delta"] = delta
                gb = delta.get("pack_read_bytes", 0) / 1e9
                if gb > 0:
                    extra["cpu_s_per_gb_read"] = (u1 - u0 + s1 - s0) / gb
                    extra["cpu_sys_s_per_gb_read"] = (s1 - s0) / gb
            d["extra"] = extra
            (args.out / f"{name}.json").write_text(json.dumps(d, indent=1) + "\n")
            print(bench_client.markdown_table([d]), flush=True)
        finally:
            srv.stop()
    reports = bench_client.load_reports(sorted(p for p in args.out.glob("*.json") if not p.name.startswith("machine")))
    (args.out / "table.md").write_text(bench_client.markdown_table(reports, "a-stock-cpu-moe"))
    try:
        bench_client.plot(reports, args.out / "rates.png")
    except ImportError:
        pass
    (args.out / "report.md").write_text(report(args.out))
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
