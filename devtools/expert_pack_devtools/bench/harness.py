"""The benchmark harness by question (docs/BENCHMARKS.md, "Method").

A *system* (systems/NAME.json) is one server configuration with every flag written out: a description, the program
(`llama-server`: the fork's binary, stock llama.cpp without --expert-pack; or `expert-pack serve`), its arguments
with placeholders for what a run decides ({model}, {trunk}, {pack}, {port}, {ctx}, {cache_mib}, {tiny_cache_mib},
{ram_tier_mib}), which workload field sets its tokens per request, and the letter earlier results used for it.
A *question* (questions/NAME.json) names the systems to run, the baseline the ratios divide by, the metrics to
report and the workload. `run` resolves both against the pack and writes one JSON per system carrying the commit,
the machine, the date and the resolved configuration; `report` turns a results folder into Markdown.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS_DIR = HERE / "systems"
QUESTIONS_DIR = HERE / "questions"

PROGRAMS = ("llama-server", "expert-pack serve")
PLACEHOLDERS = ("model", "trunk", "pack", "port", "ctx", "cache_mib", "tiny_cache_mib", "ram_tier_mib")
# workload fields: what each is, and its type
WORKLOAD = {
    "shape": (str, "synth shape of the benchmark model when it has to be generated"),
    "ctx": (int, "context size of every server"),
    "ram_cap_frac": (float, "host-RAM cap (cgroup v2 memory.max, page cache included) as a fraction of the model file"),
    "cache_frac": (float, "expert cache as a fraction of a layer's experts ({cache_mib})"),
    "tiny_cache_frac": (float, "the small cache as a fraction of a layer's experts ({tiny_cache_mib})"),
    "ram_tier_frac": (float, "host-RAM tier as a fraction of the model file ({ram_tier_mib})"),
    "n_predict": (int, "tokens generated per request"),
    "slow_n_predict": (int, "tokens per request for systems too slow for n_predict"),
    "budget_s": (float, "seconds per system for the workload; requests not started by then are skipped"),
}
# metrics of bench_client's summary (its "all" row); tok/s metrics get a ratio to the baseline
METRICS = {
    "prefill_tok_s": ("prefill tok/s", "{:.2f}", True),
    "decode_tok_s": ("decode tok/s", "{:.2f}", True),
    "hit_rate": ("hit rate", "{:.3f}", False),
    "decode_hit_rate": ("decode hit rate", "{:.3f}", False),
    "ssd_bytes_per_token": ("SSD MB per decode token", "{:.1f}", False),
    "requests": ("requests", "{:.0f}", False),
}
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def _read_json(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no {what} {path.stem!r} ({path} does not exist)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a {what} is a JSON object")
    return d


def _keys(d: dict, path: Path, required: set, optional: set = frozenset()) -> None:
    missing, unknown = required - d.keys(), d.keys() - required - optional
    if missing:
        raise ValueError(f"{path}: missing {', '.join(sorted(missing))}")
    if unknown:
        raise ValueError(f"{path}: unknown key {', '.join(sorted(unknown))}")


def system_names() -> list[str]:
    return sorted(p.stem for p in SYSTEMS_DIR.glob("*.json"))


def question_names() -> list[str]:
    return sorted(p.stem for p in QUESTIONS_DIR.glob("*.json"))


def load_system(name: str) -> dict:
    """A system file, checked: known keys, a known program, string arguments, known placeholders only."""
    path = SYSTEMS_DIR / f"{name}.json"
    if not _NAME.match(name):
        raise ValueError(f"system name {name!r}: lowercase letters, digits and '-' only")
    s = _read_json(path, "system")
    _keys(s, path, {"description", "program", "args", "n_predict"}, {"formerly"})
    if s["program"] not in PROGRAMS:
        raise ValueError(f"{path}: program {s['program']!r} is not one of {', '.join(PROGRAMS)}")
    if not isinstance(s["args"], list) or not all(isinstance(a, str) for a in s["args"]):
        raise ValueError(f"{path}: args is a list of strings")
    for a in s["args"]:
        for ph in re.findall(r"\{(\w*)\}", a):
            if ph not in PLACEHOLDERS:
                raise ValueError(f"{path}: unknown placeholder {{{ph}}} (known: {', '.join(PLACEHOLDERS)})")
    if s["n_predict"] not in ("n_predict", "slow_n_predict"):
        raise ValueError(f"{path}: n_predict names a workload field: n_predict or slow_n_predict")
    return {"name": name, **s}


def load_question(spec: str) -> dict:
    """A question by name (questions/NAME.json) or path, checked, with its systems loaded."""
    path = Path(spec) if spec.endswith(".json") else QUESTIONS_DIR / f"{spec}.json"
    q = _read_json(path, "question")
    _keys(q, path, {"question", "systems", "baseline", "metrics", "workload"})
    if not isinstance(q["systems"], list) or not q["systems"] or len(set(q["systems"])) != len(q["systems"]):
        raise ValueError(f"{path}: systems is a non-empty list of distinct system names")
    if q["baseline"] not in q["systems"]:
        raise ValueError(f"{path}: baseline {q['baseline']!r} is not one of its systems")
    bad = [m for m in q["metrics"] if m not in METRICS]
    if bad:
        raise ValueError(f"{path}: unknown metric {', '.join(bad)} (known: {', '.join(METRICS)})")
    q["workload"] = check_workload(q["workload"], str(path))
    return {"name": path.stem, "path": str(path), **q,
            "system_configs": {n: load_system(n) for n in q["systems"]}}


def check_workload(w: dict, where: str) -> dict:
    if not isinstance(w, dict):
        raise ValueError(f"{where}: workload is a JSON object")
    _keys(w, Path(where), set(WORKLOAD))
    out = {}
    for k, (typ, _) in WORKLOAD.items():
        v = w[k]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise ValueError(f"{where}: workload {k} must be {typ.__name__}, got {v!r}")
        if typ is not str and v <= 0:
            raise ValueError(f"{where}: workload {k} must be > 0, got {v!r}")
        out[k] = v
    return out


def override(workload: dict, settings: list[str]) -> dict:
    """Workload with KEY=VALUE settings applied (`run --set`), checked as the file is."""
    w = dict(workload)
    for s in settings:
        k, sep, v = s.partition("=")
        if not sep or k not in WORKLOAD:
            raise ValueError(f"--set {s!r}: expected KEY=VALUE with KEY one of {', '.join(WORKLOAD)}")
        typ = WORKLOAD[k][0]
        try:
            w[k] = typ(v)
        except ValueError:
            raise ValueError(f"--set {k}: not a {typ.__name__}: {v!r}") from None
    return check_workload(w, "--set")


def sizes(workload: dict, pack: Path, model_bytes: int) -> dict:
    """The run's placeholder values that depend on the pack: cache budgets giving exactly the slot counts the
    fractions ask for (at least one token's experts), the RAM tier's MiB and the RAM cap."""
    from ggml_expert_pack.packer.format import load_manifest

    from ..lossless import cache_mib_for_slots
    m = load_manifest(pack)
    n_exp, k = m["n_experts"], m.get("n_expert_used", 8)
    slots = max(k, round(workload["cache_frac"] * n_exp))
    tiny = max(k, round(workload["tiny_cache_frac"] * n_exp))
    return {"n_experts": n_exp, "cache_slots": slots, "cache_mib": cache_mib_for_slots(pack, slots),
            "tiny_cache_slots": tiny, "tiny_cache_mib": cache_mib_for_slots(pack, tiny),
            "ram_tier_mib": round(workload["ram_tier_frac"] * model_bytes / 2**20),
            "ram_cap_bytes": int(workload["ram_cap_frac"] * model_bytes), "model_bytes": model_bytes}


def _fmt(v) -> str:
    return str(v)  # floats in full: a cache budget rounded down could lose a slot


def program_argv(program: str, strict: bool = True) -> list[str]:
    """The argv prefix of a program: the wheel's llama-server binary, or the installed `expert-pack serve`. Not
    strict (a dry run): a missing llama-server stays as its name."""
    if program == "llama-server":
        from ggml_expert_pack.tools import tool_path
        try:
            return [str(tool_path("llama-server"))]
        except FileNotFoundError:
            if strict:
                raise
            return ["llama-server"]
    from ..proc import expert_pack_argv
    return [*expert_pack_argv(), "serve"]


def resolve(system: dict, workload: dict, values: dict, strict: bool = True) -> dict:
    """A system's command line with every placeholder but {port} filled (the port is chosen at start), and the tokens
    per request; `values` holds model, trunk, pack and the sizes."""
    vals = {**{k: _fmt(v) for k, v in values.items()}, "ctx": str(workload["ctx"]), "port": "{port}"}
    args = [re.sub(r"\{(\w+)\}", lambda m: vals[m.group(1)], a) for a in system["args"]]
    return {"system": system["name"], "argv": [*program_argv(system["program"], strict), *args],
            "n_predict": workload[system["n_predict"]], "config": system}


# ---- provenance ---------------------------------------------------------------------------------------------
def commit() -> dict:
    """The checkout's commit and whether it has uncommitted changes; "unknown" outside a git checkout."""
    def git(*a):
        return subprocess.run(["git", "-C", str(HERE), *a], capture_output=True, text=True, timeout=30)
    try:
        r = git("rev-parse", "HEAD")
        if r.returncode != 0:
            raise OSError
        return {"commit": r.stdout.strip(), "dirty": bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        from ggml_expert_pack import __version__
        return {"commit": "unknown", "version": __version__}


def machine() -> dict:
    out = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
           "cpus": os.cpu_count()}
    try:
        out["mem_total_kib"] = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            out["gpus"] = [l.strip() for l in r.stdout.splitlines() if l.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return out


# ---- run ----------------------------------------------------------------------------------------------------
def prepare(question: dict, model: Path, pack: Path) -> None:
    """Generate the benchmark model (the workload's shape) and pack it, where missing."""
    from ggml_expert_pack.packer import build

    from ..proc import expert_pack_argv
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([*expert_pack_argv(), "synth", str(model), "--shape", question["workload"]["shape"], "--quiet"],
                       check=True)
    if not (pack / "manifest.json").exists():
        build(model, pack, force=True)


def plan(question: dict, model: Path, pack: Path, systems: list[str] | None = None, strict: bool = True) -> dict:
    """What a run does: the resolved workload, sizes and every system's command line (no server started)."""
    chosen = systems or question["systems"]
    unknown = [s for s in chosen if s not in question["system_configs"]]
    if unknown:
        raise ValueError(f"not a system of question {question['name']}: {', '.join(unknown)} "
                         f"(its systems: {', '.join(question['systems'])})")
    values = {"model": str(model), "trunk": str(pack / "trunk.gguf"), "pack": str(pack),
              **sizes(question["workload"], pack, model.stat().st_size)}
    return {"question": {k: question[k] for k in ("name", "question", "baseline", "metrics", "workload", "systems")},
            "values": values,
            "systems": [resolve(question["system_configs"][s], question["workload"], values, strict) for s in chosen]}


def run(question: dict, out: Path, model: Path, pack: Path, systems: list[str] | None = None,
        dry_run: bool = False) -> int:
    """Run the question's systems one after another (each cold, inside the RAM cap), one JSON per system in OUT."""
    from .. import bench_client, proc
    from . import machine as mc
    out.mkdir(parents=True, exist_ok=True)
    if dry_run:
        if not model.exists() or not (pack / "manifest.json").exists():
            raise ValueError(f"--dry-run needs the model and its pack ({model}, {pack}): run `expert-pack bench "
                             "run QUESTION --prepare-only` first")
        p = plan(question, model, pack, systems, strict=False)
        for s in p["systems"]:
            print(f"{s['system']} (n_predict {s['n_predict']}):\n  {proc.shown(s['argv'])}")
        (out / "plan.json").write_text(json.dumps(p, indent=1) + "\n")
        return 0
    prepare(question, model, pack)
    p = plan(question, model, pack, systems)
    run_info = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), **commit(), "machine": machine(),
                "question": p["question"], "values": p["values"]}
    mc.drop_caches()
    run_info["odirect"] = mc.odirect_bandwidth(pack)
    run_info["h2d"] = mc.h2d_bandwidth()
    cg = mc.make_cgroup("expert-pack-bench", p["values"]["ram_cap_bytes"])
    run_info["ram_cap_applied"] = cg is not None
    (out / "run.json").write_text(json.dumps(run_info, indent=1) + "\n")
    print(json.dumps(run_info, indent=1), flush=True)
    for s in p["systems"]:
        name = s["system"]
        mc.drop_caches()
        if cg is not None:
            try:
                (cg / "memory.reclaim").write_text(str(1 << 40))
                (cg / "memory.peak").write_text("0")  # resettable on recent kernels
            except OSError:
                pass
        try:
            srv = mc.Server(s["argv"], out / f"{name}.log", cg)
        except RuntimeError as e:
            print(f"{name}: {e}", flush=True)
            (out / f"{name}.error").write_text(str(e) + "\n")
            continue
        try:
            u0, s0 = mc.cpu_seconds(srv.proc.pid)
            before = bench_client.pack_counters(srv.base)
            rep = bench_client.run(srv.base, name, n_predict=s["n_predict"], budget_s=question["workload"]["budget_s"])
            u1, s1 = mc.cpu_seconds(srv.proc.pid)
            after = bench_client.pack_counters(srv.base)
            d = asdict(rep)
            extra = {"load_s": srv.load_s, "cpu_user_s": u1 - u0, "cpu_sys_s": s1 - s0,
                     "command": [c.replace("{port}", str(srv.port)) for c in s["argv"]],
                     "cgroup": mc.cgroup_figures(cg)}
            if before and after:
                delta = {k: after[k] - before.get(k, 0) for k in after if k != "hit_ratio"}
                extra["pack_delta"] = delta
                gb = delta.get("pack_read_bytes", 0) / 1e9
                if gb > 0:
                    extra["cpu_s_per_gb_read"] = (u1 - u0 + s1 - s0) / gb
                    extra["cpu_sys_s_per_gb_read"] = (s1 - s0) / gb
            d["extra"] = extra
            d["provenance"] = {k: run_info[k] for k in ("date", "commit", "machine")} | {
                "dirty": run_info.get("dirty"), "config": s["config"], "n_predict": s["n_predict"],
                "workload": question["workload"], "values": p["values"]}
            (out / f"{name}.json").write_text(json.dumps(d, indent=1) + "\n")
            print(bench_client.markdown_table([d]), flush=True)
        finally:
            srv.stop()
    print(write_report(out), end="")
    return 0


def write_report(out: Path) -> str:
    """OUT/report.md, OUT/table.md (per dataset, ratios to the baseline) and OUT/rates.png (with matplotlib)."""
    from .. import bench_client
    text = report(out)
    (out / "report.md").write_text(text)
    baseline = json.loads((out / "run.json").read_text())["question"]["baseline"]
    reps = _reports(out)
    (out / "table.md").write_text(bench_client.markdown_table(list(reps.values()), baseline))
    try:
        bench_client.plot(list(reps.values()), out / "rates.png")
    except ImportError:  # matplotlib is optional (pip install '.[bench]')
        pass
    return text


def _reports(out: Path) -> dict:
    from .. import bench_client
    return {r["system"]: r for r in bench_client.load_reports(
        sorted(p for p in out.glob("*.json") if p.name not in ("run.json", "plan.json")))}


# ---- report -------------------------------------------------------------------------------------------------
def _all(rep: dict, key: str):
    return rep.get("summary", {}).get("all", {}).get(key)


def report(out: Path) -> str:
    """Markdown from a results folder: provenance, the question's metrics per system with ratios to its baseline,
    reads against the O_DIRECT bound, and where a step's expert work goes."""
    info_path = out / "run.json"
    if not info_path.exists():
        raise ValueError(f"{out}: no run.json (not a results folder of `expert-pack bench run`)")
    info = json.loads(info_path.read_text())
    q = info["question"]
    reps = _reports(out)
    v, mach = info.get("values", {}), info.get("machine", {})
    w = q["workload"]
    lines = [f"# {q['name']}: {q['question']}", "",
             f"{info.get('date')}, commit {info.get('commit', 'unknown')[:12]}{' (uncommitted changes)' if info.get('dirty') else ''}; "
             f"{mach.get('host')}, {mach.get('cpus')} CPUs{', ' + '; '.join(mach['gpus']) if mach.get('gpus') else ''}. "
             f"Model {v.get('model_bytes', 0) / 1e9:.2f} GB; " + (
                 f"RAM cap {v.get('ram_cap_bytes', 0) / 1e9:.2f} GB ({w['ram_cap_frac']:.0%} of the model, cgroup v2 "
                 "memory.max, page cache included)" if info.get("ram_cap_applied", True) else
                 "no RAM cap (no cgroup v2 memory controller)") + "; cache "
             f"{v.get('cache_slots')} of {v.get('n_experts')} experts per layer ({v.get('cache_mib', 0):.0f} MiB), small "
             f"cache {v.get('tiny_cache_slots')} ({v.get('tiny_cache_mib', 0):.0f} MiB), RAM tier "
             f"{v.get('ram_tier_mib', 0):.0f} MiB; {w['n_predict']} tokens per request ({w['slow_n_predict']} for slow "
             f"systems), {w['budget_s']:.0f} s per system."]
    od = (info.get("odirect") or {}).get("bytes_per_s")
    h2d = info.get("h2d") or {}
    if od:
        lines.append(f"O_DIRECT random expert reads, 1 thread, same run: {od / 1e9:.2f} GB/s." + (
            f" Host-to-device: pinned {h2d.get('pinned_bytes_per_s', 0) / 1e9:.1f} GB/s, pageable "
            f"{h2d.get('pageable_bytes_per_s', 0) / 1e9:.1f} GB/s." if h2d else ""))
    reps = {n: reps[n] for n in [*q["systems"], *reps] if n in reps}  # the question's order first
    base = reps.get(q["baseline"])
    head = ["system"] + [METRICS[m][0] for m in q["metrics"]] + \
        [f"{METRICS[m][0]} ÷ {q['baseline']}" for m in q["metrics"] if METRICS[m][2]]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in q["systems"]:
        if name not in reps:
            lines.append(f"| {name} | " + " | ".join("–" for _ in head[1:]) + " |")
            continue
        r = reps[name]
        cells = []
        for m in q["metrics"]:
            x = _all(r, m)
            if x is not None and m == "ssd_bytes_per_token":
                x /= 1e6
            cells.append(METRICS[m][1].format(x) if x is not None else "–")
        for m in q["metrics"]:
            if METRICS[m][2]:
                x, y = _all(r, m), _all(base, m) if base else None
                cells.append(f"{x / y:.2f}x" if x is not None and y else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += bound_lines(reps, od) + step_profile_lines(reps)
    return "\n".join(lines) + "\n"


def bound_lines(reps: dict, od: float | None) -> list[str]:
    """Per system that reads the pack: read bandwidth while reading against the single-thread O_DIRECT bound, CPU
    per GB read, the page cache at the end."""
    lines = ["", "| system | decode tok/s | SSD MB per decode token | read GB/s while reading | physical bound tok/s "
             "(O_DIRECT GB/s ÷ bytes per token) | of the bound | CPU s per GB read (user+sys / sys) | page cache at end |",
             "|---|---|---|---|---|---|---|---|"]
    n = len(lines)
    nan = float("nan")
    for name, rp in reps.items():
        ex = rp.get("extra", {})
        bpt = _all(rp, "ssd_bytes_per_token")
        if not bpt:
            continue
        delta = ex.get("pack_delta", {})
        rs = delta.get("read_seconds")
        bw = delta.get("pack_read_bytes", 0) / rs if rs else None
        dec = _all(rp, "decode_tok_s") or 0
        bound = od / bpt if od else None
        cpu = ex.get("cpu_s_per_gb_read")
        lines.append(f"| {name} | {dec:.2f} | {bpt / 1e6:.1f} | {bw / 1e9 if bw else nan:.2f} | "
                     f"{bound if bound else nan:.2f} | {dec / bound if bound else nan:.0%} | "
                     f"{cpu if cpu is not None else nan:.2f} / {ex.get('cpu_sys_s_per_gb_read', nan):.2f} | "
                     f"{ex.get('cgroup', {}).get('stat_file', 0) / 1e9:.2f} GB |")
    return lines if len(lines) > n else []


def step_profile_lines(reps: dict) -> list[str]:
    """Per system of ours, where a graph step's expert work goes (the provider's timers over every step, prompts
    included): the acquire ops (the device waits for them), the part spent waiting for prefetch reads or for copies,
    and the pack reads' thread time (summed over the read threads)."""
    lines = ["", "| system | steps | acquire ms per step | of which prefetch wait | of which copy wait | "
             "read ms per step (all threads) |", "|---|---|---|---|---|---|"]
    n = len(lines)
    for name, rp in reps.items():
        d = rp.get("extra", {}).get("pack_delta", {})
        steps = d.get("steps")
        if not steps or "acquire_seconds" not in d:
            continue
        per = {k: d.get(f"{k}_seconds", float("nan")) * 1e3 / steps for k in ("acquire", "prefetch_wait", "copy_wait", "read")}
        lines.append(f"| {name} | {steps:.0f} | {per['acquire']:.1f} | {per['prefetch_wait']:.1f} | "
                     f"{per['copy_wait']:.1f} | {per['read']:.1f} |")
    return lines if len(lines) > n else []
