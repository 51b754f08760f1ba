"""docs/BENCHMARKS.md's tables, regenerated from the raw results they name (`expert-pack bench tables`).

A generated table sits between two markers:

    <!-- table KIND: results/PATH[,PATH...] -->
    | ... |
    <!-- end table -->

KIND names a renderer below; the paths are relative to the Markdown file, and a bare file name is in the folder of
the path before it (`results/RUN/a.json,b.json`). `regenerate` recomputes every marked table
from its files and rewrites the region; `--check` leaves the file alone and names the tables that differ. Each
renderer reads one kind of raw result and returns the table's lines:

* harness reports (one JSON per system, `expert-pack bench run`, and those of the harness's predecessor):
  `systems`, `ratios`, `bound`, `tier`, `overlap`; the first file is the baseline or reference where a table has one
* `scripts/bench_decode.py`'s decode.json: `decode`
* `scripts/bench_pack.py`'s pack_speed.json: `pack-speed`
* `scripts/bench_storage.py`'s storage.json: `storage-decode`, `storage-timeline`, `storage-prefill`
* pytest's junit XML: `junit`
"""
from __future__ import annotations

import functools
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from . import harness

DEFAULT_DOC = Path(__file__).resolve().parents[3] / "docs" / "BENCHMARKS.md"
MARKER = re.compile(r"^<!-- table (?P<kind>[a-z-]+): (?P<paths>[^ ]+) -->\n(?P<body>.*?)^<!-- end table -->$",
                    re.M | re.S)
NA = "–"
# the names results before the harness gave its systems, by the letter the systems' files keep as `formerly`
OLD_NAMES = {"a-stock-cpu-moe": "a", "b-stock-all-gpu": "b", "c-ours-odirect": "c", "d-ours-buffered": "d",
             "e-fork-llama-server": "e", "c-ours-odirect-tiny-cache": "c-tiny", "f-ours-ram-tier": "f",
             "f-ours-ram-tier-inclusive": "f-incl", "g-ours-read-threads-4": "g", "h-ours-ram-tier-prefetch": "h",
             "h4-ours-ram-tier-prefetch-4-threads": "h4", "s-ours-spill-tier": "s", "s4-ours-spill-tier-4-threads": "s4",
             "sp-ours-spill-tier-prefetch": "sp", "sp4-ours-spill-tier-prefetch-4-threads": "sp4"}
RENDERERS: dict = {}


def renderer(kind: str):
    def register(fn):
        RENDERERS[kind] = fn
        return fn
    return register


def md(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def ratio(x: float | None, y: float | None) -> str:
    """x ÷ y with about three significant digits."""
    if x is None or not y:
        return NA
    r = x / y
    return f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


# ---- harness reports ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _letters() -> dict:
    """letter -> the system's name today (the systems' files)."""
    return {c["formerly"]: n for n in harness.system_names() if (c := harness.load_system(n)).get("formerly")}


def label(rep: dict) -> str:
    """"(c) `serve-odirect`": the letter and the system's name, from the report's configuration or its old name."""
    cfg = rep.get("provenance", {}).get("config", {})
    name, letter = cfg.get("name"), cfg.get("formerly")
    if not name:
        letter = OLD_NAMES.get(rep["system"])
        name = _letters().get(letter, rep["system"])
    return f"({letter}) `{name}`" if letter else f"`{name}`"


def reports(paths: list[Path]) -> list[dict]:
    reps = []
    for p in paths:
        r = _load_json(p)
        if not isinstance(r.get("summary"), dict) or "system" not in r:
            raise ValueError(f"{p}: not a report of the benchmark harness")
        r["_path"] = p
        reps.append(r)
    return reps


def _all(rep: dict, key: str):
    return rep["summary"].get("all", {}).get(key)


def _delta(rep: dict) -> dict:
    return rep.get("extra", {}).get("pack_delta", {})


def _odirect(rep: dict) -> float | None:
    """The run's single-thread O_DIRECT bandwidth: the harness's run.json beside the report, or (before the harness)
    the run figures the report carries."""
    run = rep["_path"].parent / "run.json"
    info = _load_json(run) if run.exists() else rep.get("extra", {}).get("run", {})
    return (info.get("odirect") or {}).get("bytes_per_s")


def _read_bw(rep: dict) -> float | None:
    """Pack bytes ÷ time inside reads (all read threads' time summed)."""
    d = _delta(rep)
    return d["pack_read_bytes"] / d["read_seconds"] if d.get("read_seconds") else None


def _mb(rep: dict) -> str:
    b = _all(rep, "ssd_bytes_per_token")
    return f"{b / 1e6:.1f}" if b else NA


@renderer("systems")
def render_systems(paths: list[Path]) -> list[str]:
    """The reference workload per system, with prefill and decode against the first system's."""
    reps = reports(paths)
    base = reps[0]
    letter = label(base).split(" ")[0]
    rows = []
    for r in reps:
        hit = (f"{_all(r, 'hit_rate'):.3f} / {_all(r, 'decode_hit_rate'):.3f}"
               if _all(r, "hit_rate") is not None else NA)
        rows.append([label(r), _all(r, "requests"), f"{_all(r, 'prefill_tok_s'):.1f}", f"{_all(r, 'decode_tok_s'):.2f}",
                     hit, _mb(r), ratio(_all(r, "prefill_tok_s"), _all(base, "prefill_tok_s")),
                     ratio(_all(r, "decode_tok_s"), _all(base, "decode_tok_s"))])
    return md(["system", "requests", "prefill tok/s", "decode tok/s", "hit rate (all / decode)",
               "SSD MB per decode token", f"prefill ÷ {letter}", f"decode ÷ {letter}"], rows)


@renderer("ratios")
def render_ratios(paths: list[Path]) -> list[str]:
    """The first system's decode and prefill over each of the others'."""
    first, *others = reports(paths)
    return md(["ratio", "decode", "prefill"],
              [[f"{label(first).split(' ')[0]} ÷ {label(r)}", ratio(_all(first, "decode_tok_s"), _all(r, "decode_tok_s")),
                ratio(_all(first, "prefill_tok_s"), _all(r, "prefill_tok_s"))] for r in others])


@renderer("bound")
def render_bound(paths: list[Path]) -> list[str]:
    """Decode against the physical bound: the run's O_DIRECT bandwidth ÷ the bytes read per decode token."""
    rows = []
    for r in reports(paths):
        bpt, dec, od, bw = _all(r, "ssd_bytes_per_token"), _all(r, "decode_tok_s"), _odirect(r), _read_bw(r)
        bound = od / bpt if od and bpt else None
        ex = r.get("extra", {})
        cpu = ex.get("cpu_s_per_gb_read")
        rows.append([label(r), f"{dec:.2f}", _mb(r), f"{bw / 1e9:.2f}" if bw else NA,
                     f"{bound:.2f}" if bound else NA, f"{dec / bound:.0%}" if bound else NA,
                     f"{cpu:.2f} / {ex['cpu_sys_s_per_gb_read']:.2f}" if cpu is not None else NA,
                     f"{ex['cgroup']['stat_file'] / 1e9:.2f} GB" if "stat_file" in ex.get("cgroup", {}) else NA])
    return md(["system", "decode tok/s", "SSD MB per decode token", "read GB/s while reading",
               "bound (O_DIRECT GB/s ÷ MB/token)", "of the bound", "CPU s per GB read (all / kernel)",
               "page cache at the end"], rows)


@renderer("tier")
def render_tier(paths: list[Path]) -> list[str]:
    """Decode against the first system's, bytes per token and where a graph step's expert work goes (the provider's
    timers over every step, prompts included)."""
    reps = reports(paths)
    base, rows = reps[0], []
    for r in reps:
        d = _delta(r)
        per = {k: d[f"{k}_seconds"] * 1e3 / d["steps"] for k in ("acquire", "read", "prefetch_wait")
               if f"{k}_seconds" in d}
        rows.append([label(r), f"{_all(r, 'decode_tok_s'):.2f}", ratio(_all(r, "decode_tok_s"), _all(base, "decode_tok_s")),
                     _mb(r), f"{per['acquire']:.1f}",
                     f"{per['prefetch_wait']:.1f}" if d.get("prefetch_issued") else NA, f"{per['read']:.0f}"])
    return md(["system", "decode tok/s", f"÷ {label(base).split(' ')[0]}", "SSD MB per decode token",
               "acquire ms per step", "of which prefetch wait", "read ms per step (all threads)"], rows)


@renderer("overlap")
def render_overlap(paths: list[Path]) -> list[str]:
    """A decode step against max(read time, compute time): read time is the step's bytes at the bandwidth the first
    system achieved while reading, compute time the first system's time per token outside reads."""
    reps = reports(paths)
    ref = reps[0]
    bw = _read_bw(ref)
    compute = 1 / _all(ref, "decode_tok_s") - _all(ref, "ssd_bytes_per_token") / bw
    rows = []
    for r in reps:
        step, read = 1 / _all(r, "decode_tok_s"), _all(r, "ssd_bytes_per_token") / bw
        rows.append([label(r), f"{step * 1e3:.0f}", f"{read * 1e3:.0f}", f"{compute * 1e3:.0f}",
                     f"{step / max(read, compute):.2f}"])
    return md(["system", "ms per decode token", "read ms", "compute ms", "step ÷ max(read, compute)"], rows)


# ---- scripts/bench_decode.py, scripts/bench_pack.py -----------------------------------------------------------
@renderer("decode")
def render_decode(paths: list[Path]) -> list[str]:
    """Stock llama.cpp with every weight on the GPU against the pack with every expert cached."""
    rows = []
    for p in paths:
        d = _load_json(p)
        for key, what in (("stock", "stock llama.cpp, every weight on the GPU"),
                          ("all_hit", "pack, every expert cached (resident layers)")):
            r = d[key]
            rows.append([what, f"{r['prefill_tok_s']:,.0f}", f"{r['decode_tok_s']:.1f}",
                         ratio(r["decode_tok_s"], d["stock"]["decode_tok_s"]), f"{r['decode_step_ms']:.2f} ms"])
    return md(["run", "prefill tok/s", "decode tok/s", "decode ÷ stock", "median step"], rows)


@renderer("pack-speed")
def render_pack_speed(paths: list[Path]) -> list[str]:
    """Copy, cp and `expert-pack build` in GB/s (mean and runs), verify and synth times."""
    rows = []
    for p in paths:
        d = _load_json(p)

        def runs(key):
            v = d[f"{key}_bytes_per_s_runs"]
            return f"{sum(v) / len(v) / 1e9:.2f} ({', '.join(f'{x / 1e9:.2f}' for x in v)})"
        gb = d["model_bytes"] / 1e9
        rows += [["copy, 64 MiB read/write loop + fsync", runs("copy")],
                 ["`cp` (copy_file_range) + sync", runs("cp")],
                 ["`expert-pack build` (pack + trunk + manifest, checksums, fsync)",
                  f"{runs('pack')} = {d['pack_over_copy']:.0%} of the faster copy"],
                 ["`expert-pack verify` (every checksum)", f"{gb:.2f} GB in {d['verify_seconds']:.1f} s"],
                 ["`expert-pack synth --shape 30b-a3b`",
                  f"{gb:.2f} GB in {d['synth_seconds']:.1f} s ({d['synth_bytes_per_s'] / 1e9:.2f} GB/s)"]]
    return md(["run", "GB/s (runs)"], rows)


# ---- scripts/bench_storage.py -----------------------------------------------------------------------------------
def _storage_order(s: str) -> tuple:
    """The VM disk, then emulated drives by bandwidth, then RAM-backed storage."""
    return (0, 0) if s == "disk" else (2, 0) if s == "ram" else (1, float(s))


def _storage_name(s: str) -> str:
    return {"disk": "VM disk", "ram": "RAM-backed"}.get(s, f"emulated {s} GB/s")


@renderer("storage-decode")
def render_storage_decode(paths: list[Path]) -> list[str]:
    """Decode tok/s per storage (rows) and provider configuration (columns), with the share of the drive-bound
    limit where the drive's bandwidth is known."""
    runs = [r for p in paths for r in _load_json(p)["runs"]]
    configs = list(dict.fromkeys(r["config"] for r in runs))
    rows = []
    for s in sorted({r["storage"] for r in runs}, key=_storage_order):
        by = {r["config"]: r for r in runs if r["storage"] == s}
        limit = next((r["drive_bound_tok_s"] for r in by.values() if "drive_bound_tok_s" in r), None)
        rows.append([_storage_name(s)] + [
            NA if c not in by else f"{by[c]['decode_tok_s']:.2f}" + (
                f" ({by[c]['of_drive_bound']:.0%})" if "of_drive_bound" in by[c] else "") for c in configs]
            + [f"{limit:.1f}" if limit else NA])
    return md(["storage", *(f"`{c}`" for c in configs), "drive-bound limit"], rows)


@renderer("storage-timeline")
def render_storage_timeline(paths: list[Path]) -> list[str]:
    """One decode step's timeline in RAM-backed storage, mean per MoE layer (ms), per configuration."""
    rows = []
    for p in paths:
        for r in _load_json(p)["runs"]:
            if r["storage"] != "ram":
                continue
            t, cfg = r["timeline_summary"], r.get("provider_config", {})
            hashed = ("off" if cfg.get("verify_pack_sha256") is False else
                      "overlapped" if cfg.get("read_splits", 1) > 1 else f"{t['hash']:.3f}")
            rows.append([f"`{r['config']}`", f"{t['misses']:.2f}", f"{t['acquire']:.3f}", f"{t['reads_landed']:.3f}",
                         f"{t['io']:.3f}", hashed, f"{t['copy_wait']:.3f}", f"{t['device_gap']:.3f}"])
    return md(["configuration", "misses", "acquire (ids on the host -> slot ids back)",
               "reads landed and checked, from the plan", "one read (I/O)", "checksum after the read",
               "copies complete after the last read", "device work to the next layer's ids"], rows)


@renderer("storage-prefill")
def render_storage_prefill(paths: list[Path]) -> list[str]:
    """Prefill per prompt length and ubatch, bytes read and passes over the pack, against stock all-GPU."""
    rows = []
    for p in paths:
        sweep = _load_json(p)["prefill"]
        stock = {r["prompt_tokens"]: r["prefill_tok_s"] for r in sweep if r["system"] == "stock"}
        rows += [[f"{r['prompt_tokens']:,}", f"{r['n_ubatch']:,}", f"{r['prefill_tok_s']:,.0f}",
                  f"{r['bytes_per_prompt_token'] / 1e6:.1f}", f"{r['passes_over_pack']:.2f}",
                  f"{stock[r['prompt_tokens']]:,.0f}" if r["prompt_tokens"] in stock else NA]
                 for r in sweep if r["system"] != "stock"]
    return md(["prompt tokens", "ubatch", "prefill tok/s", "MB read per prompt token", "passes over the pack",
               "stock all-GPU tok/s"], rows)


# ---- junit ------------------------------------------------------------------------------------------------------
@renderer("junit")
def render_junit(paths: list[Path]) -> list[str]:
    """Per test run: the test files (in the order they ran), the outcome and its time, the date (UTC)."""
    rows = []
    for p in paths:
        root = ET.parse(p).getroot()
        s = root if root.tag == "testsuite" else root.find("testsuite")
        files = dict.fromkeys("tests/" + next((x for x in c.get("classname").split(".") if x.startswith("test_")),
                                               c.get("classname")) + ".py" for c in s.iter("testcase"))
        n, fails, errs, skips = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        outcome = ", ".join(f"{v} {w}" for v, w in ((n - fails - errs - skips, "passed"), (fails, "failed"),
                                                     (errs, "errors"), (skips, "skipped")) if v)
        rows.append(["`" + " ".join(files) + "`", f"{outcome} ({float(s.get('time')):.0f} s)",
                     s.get("timestamp", "")[:16].replace("T", " "), f"[{p.name}]({p.as_posix()})"])
    return md(["tests", "result", "date (UTC)", "junit"], rows)


# ---- the document -----------------------------------------------------------------------------------------------
def regenerate(text: str, base: Path) -> tuple[str, list[str]]:
    """The document with every marked table recomputed from its files (paths relative to `base`), and the tables
    that changed ("line N: table KIND of PATH and M more")."""
    changed, out, pos = [], [], 0
    for m in MARKER.finditer(text):
        kind, spec = m["kind"], m["paths"]
        if kind not in RENDERERS:
            raise ValueError(f"table {kind}: no such renderer (known: {', '.join(RENDERERS)})")
        rel, folder = [], ""
        for s in spec.split(","):
            s = s if "/" in s else folder + s
            folder = s.rpartition("/")[0] + "/" if "/" in s else ""
            rel.append(s)
        missing = [s for s in rel if not (base / s).is_file()]
        if missing:
            raise ValueError(f"table {kind}: no file {', '.join(missing)} (paths are relative to {base})")
        body = "\n".join(RENDERERS[kind]([Path(base / s) for s in rel])) + "\n"
        body = body.replace(f"]({base.as_posix()}/", "](")  # links relative to the document
        if body != m["body"]:
            more = f" and {len(rel) - 1} more" if len(rel) > 1 else ""
            changed.append(f"line {text.count(chr(10), 0, m.start()) + 1}: table {kind} of {rel[0]}{more}")
        out += [text[pos:m.start("body")], body]
        pos = m.end("body")
    return "".join(out) + text[pos:], changed


def tables(doc: Path, check: bool = False) -> int:
    """Rewrite the document's generated tables; with `check`, only say which differ (exit 1)."""
    text = doc.read_text()
    if not MARKER.search(text):
        raise ValueError(f"{doc}: no generated tables (markers '<!-- table KIND: PATHS -->' ... '<!-- end table -->')")
    new, changed = regenerate(text, doc.parent)
    for c in changed:
        print(f"{'differs' if check else 'regenerated'}: {c}")
    if check:
        if changed:
            print(f"{doc}: {len(changed)} table(s) differ from their raw results; run `expert-pack bench tables`")
        return 1 if changed else 0
    if new != text:
        doc.write_text(new)
    return 0
