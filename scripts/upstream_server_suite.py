#!/usr/bin/env python3
"""Run llama.cpp's own server test suite (the vendored tools/server/tests: pytest files in unit/, helper utils.py)
against three servers on a local synthetic MoE model, and tabulate the outcome per test file:

  stock  stock llama-server, built from the pristine vendored sdist (scripts/build_stock_server.sh)
  fork   the fork's llama-server --expert-pack PACK (an expert cache that evicts)
  serve  expert-pack serve PACK (the same cache)

Nothing is downloaded and the vendored files are not edited: the tests are copied into --work (they write tmp/
beside themselves and read ../../../models/templates), and the pytest plugin upstream_suite/ep_upstream_plugin.py
points every model the suite would fetch from Hugging Face at the synthetic model (a tiny random-weight qwen3moe with
llama's SentencePiece vocabulary and a ChatML template, and for the embedding presets the same with mean pooling;
generated and packed once into --work). For fork and serve, LLAMA_SERVER_BIN_PATH is a wrapper
(upstream_suite/shim.py) that adds the pack, or translates the command line to `expert-pack serve`.

upstream_suite/known.toml lists, once, the files not run (features out of scope: vision, LoRA, speculative decoding,
router mode, ...) and the tests that cannot pass on the synthetic model (assertions on the generated text or on token
counts of the suite's own models, fetches from the internet, multimodal input), with a reason each. The baseline
is what passes on stock; fork and serve are counted against it.

The suite's requirements (its requirements.txt, plus pytest-timeout) go into a separate venv (--venv, created when
missing with this interpreter's `-m venv`; never the venv this script runs in). Run it with the Python that has
ggml_expert_pack and expert_pack_devtools installed, from outside the checkout:

  cd /tmp && python /work/main/scripts/upstream_server_suite.py --out /tmp/ups-out
  cd /tmp && python /work/main/scripts/upstream_server_suite.py --targets fork --files test_basic.py test_tokenize.py

Every server gets one CPU thread (--threads) unless a test sets its own. Writes to --out: junit-TARGET.xml,
pytest-TARGET.log, run.json (the run's commit and uncommitted files, date, machine, command, binaries, the suite's
packages), summary.json (every test's outcome per target, the baseline, what fails where) and table.md. Exit status 0 when the fork passes every
test that passes on stock, 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent / "upstream_suite"
KNOWN = HERE / "known.toml"
LLAMA_CPP = ROOT / "vendor" / "upstream" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
TESTS = LLAMA_CPP / "tools" / "server" / "tests"
STOCK_BIN = ROOT / "build" / "stock-server" / "bin" / "llama-server"
TARGETS = ("stock", "fork", "serve")

# The order files run in: the core API first, so that a run cut short still covers it.
ORDER = [
    "test_basic.py", "test_tokenize.py", "test_completion.py", "test_chat_completion.py", "test_ignore_eos.py",
    "test_ctx_shift.py", "test_security.py", "test_metrics.py", "test_slot_save.py", "test_template.py",
    "test_tool_call.py", "test_infill.py", "test_embedding.py", "test_rerank.py", "test_kv_keep_only_active.py",
    "test_sleep.py", "test_compat_oai_responses.py", "test_compat_anthropic.py", "test_compat_gcp.py",
    "test_proxy.py",
]


def load_known(path: Path = KNOWN) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def suite_files(known: dict) -> tuple[list[str], dict[str, str]]:
    """(files to run, in ORDER first; files not run -> reason)."""
    present = sorted(p.name for p in (TESTS / "unit").glob("test_*.py"))
    excluded = {f: v["reason"] for f, v in known.get("excluded", {}).items()}
    ordered = [f for f in ORDER if f in present] + [f for f in present if f not in ORDER]
    return [f for f in ordered if f not in excluded], excluded


def expected_failure(test_id: str, known: dict) -> dict | None:
    """known.toml's entry ({kind, reason}) for `test_id` (FILE::NAME[PARAMS]) not passing on the synthetic model."""
    for pattern, v in known.get("cannot_pass", {}).items():
        if matches(pattern, test_id):
            return v
    return None


def matches(pattern: str, test_id: str) -> bool:
    """known.toml's patterns: `*` matches any run of characters; everything else, brackets included, is literal."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), test_id, flags=re.S) is not None


# ---- setup -------------------------------------------------------------------------------------------------------
def ensure_venv(venv: Path, log) -> Path:
    py = venv / "bin" / "python"
    if Path(sys.prefix).resolve() == venv.resolve():
        raise SystemExit(f"--venv {venv} is the venv this script runs in; give the suite its own")
    stamp = venv / ".ep-upstream-requirements"
    want = (TESTS / "requirements.txt").read_text() + "pytest-timeout\n"
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py
    log(f"venv: {venv}")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(TESTS / "requirements.txt"), "pytest-timeout"],
                   check=True)
    stamp.write_text(want)
    return py


def make_vocab(dest: Path) -> Path:
    """The vocab of the suite's own tiny models (llama's SentencePiece vocabulary, which adds BOS, as
    stories260K's does), with the ChatML chat template of the qwen2 vocab (stories260K has none; a template lets the
    chat endpoints of `expert-pack serve`, which renders the model's own, run too)."""
    from ggml_expert_pack.gguf_file import read_header
    from ggml_expert_pack.gguf_stream import GGUFStreamWriter, kv_str
    spm = read_header(LLAMA_CPP / "models" / "ggml-vocab-llama-spm.gguf")
    qwen2 = read_header(LLAMA_CPP / "models" / "ggml-vocab-qwen2.gguf")
    kvs = [kv for k, kv in spm.kvs.items() if k != "tokenizer.chat_template"]
    kvs.append(kv_str("tokenizer.chat_template", qwen2.kvs["tokenizer.chat_template"].value))
    tmp = dest.with_suffix(".tmp")
    w = GGUFStreamWriter(tmp, kvs, [])
    with open(tmp, "wb") as f:
        w.begin(f)
    os.replace(tmp, dest)
    return dest


MODEL_DESCRIPTION = ("qwen3moe, shape tiny (4 layers x 16 experts, top-4, hidden 256), random weights (seed 42), "
                     "llama SentencePiece vocab (32,000 tokens) with a ChatML template; the embedding presets' "
                     "model is the same with qwen3moe.pooling_type = mean")


def ensure_models(work: Path, log) -> dict[str, tuple[Path, Path]]:
    """{"generation": (model, pack), "embedding": (model, pack)}, made once into work/models. The embedding model is
    the generation model with mean pooling in its metadata (the suite's embedding model, bert-bge-small, pools; a
    causal model without the key does not, and llama-server's OpenAI embeddings refuse that)."""
    from expert_pack_devtools.synth import SHAPES, SynthConfig, archs, generate
    from ggml_expert_pack.gguf_stream import kv_u32
    from ggml_expert_pack.packer import build
    d = work / "models"
    d.mkdir(parents=True, exist_ok=True)
    vocab = d / "vocab-llama-spm-chatml.gguf"
    out = {}
    for kind, name in (("generation", "tiny-qwen3moe-spm"), ("embedding", "tiny-qwen3moe-spm-mean")):
        model, pack = d / f"{name}.gguf", d / f"{name}.pack"
        if not model.exists():
            log(f"model: {model}")
            if not vocab.exists():
                make_vocab(vocab)
            cfg = SynthConfig.from_dict({"arch": "qwen3moe", **SHAPES["tiny"], "name": name, "seed": 42,
                                         "vocab": str(vocab)})
            kvs = archs.ARCH_KVS["qwen3moe"]
            if kind == "embedding":  # LLM_KV_POOLING_TYPE, read for every arch; 1 = LLAMA_POOLING_TYPE_MEAN
                archs.ARCH_KVS["qwen3moe"] = lambda c: kvs(c) + [kv_u32("qwen3moe.pooling_type", 1)]
            try:
                generate(cfg, model, progress=False)
            finally:
                archs.ARCH_KVS["qwen3moe"] = kvs
        if not (pack / "manifest.json").exists():
            log(f"pack: {pack}")
            shutil.rmtree(pack, ignore_errors=True)
            build(model, pack)
        out[kind] = (model, pack)
    return out


def ensure_stock(path: Path, build_if_missing: bool, log) -> Path:
    if path.exists():
        return path
    if not build_if_missing or path != STOCK_BIN:
        raise SystemExit(f"no stock llama-server at {path}: run scripts/build_stock_server.sh (or --build-stock)")
    log("building stock llama-server (scripts/build_stock_server.sh)")
    subprocess.run(["bash", str(ROOT / "scripts" / "build_stock_server.sh")], check=True, cwd=ROOT)
    return path


def copy_tests(dest: Path) -> Path:
    """A fresh copy of the suite at dest/llama.cpp/tools/server/tests, with the models/ and tools/mtmd/ it reads
    by relative path linked beside it."""
    root = dest / "llama.cpp"
    shutil.rmtree(root, ignore_errors=True)
    (root / "tools").mkdir(parents=True)
    os.symlink(LLAMA_CPP / "models", root / "models")
    os.symlink(LLAMA_CPP / "tools" / "mtmd", root / "tools" / "mtmd")
    (root / "tools" / "server").mkdir()
    shutil.copytree(TESTS, root / "tools" / "server" / "tests",
                    ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    tests = root / "tools" / "server" / "tests"
    (tests / "tmp").mkdir()
    return tests


def serve_keeps(ep: Path) -> list[str]:
    """The flags the shim would drop for serve that this serve accepts (from its --help)."""
    sys.path.insert(0, str(HERE))
    try:
        import shim
    finally:
        sys.path.remove(str(HERE))
    text = subprocess.run([str(ep), "serve", "--help"], capture_output=True, text=True, check=True).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]*", text))
    return sorted(f for f in (*shim.SERVE_DROPPED, *shim.SERVE_DROPPED_WITH_VALUE) if f in known)


def write_wrapper(path: Path, mode: str, bin_path: Path, models: dict[str, tuple[Path, Path]],
                  cache_mib: float, keep: list[str] = ()) -> Path:
    maps = [a for m, p in models.values() for a in ("--map", f"{m}={p}")]
    args = [sys.executable, str(HERE / "shim.py"), "--mode", mode, "--bin", str(bin_path), *maps,
            "--cache-mib", f"{cache_mib:.3f}", *[f"--keep={f}" for f in keep], "--"]
    path.write_text(f"#!/bin/sh\nexec {shlex.join(args)} \"$@\"\n")
    path.chmod(0o755)
    return path


def built(path: Path) -> str:
    """When an executable and the shared libraries beside its package were last written (the build that ran)."""
    files = [path.resolve(), *sorted((path.resolve().parent.parent.parent / "llama_cpp" / "lib").glob("*.so*"))]
    newest = max(f.stat().st_mtime for f in files if f.exists())
    return datetime.datetime.fromtimestamp(newest).astimezone().isoformat(timespec="seconds")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- run and read ------------------------------------------------------------------------------------------------
def run_target(target: str, server_bin: Path, files: list[str], py: Path, models: dict, work: Path, out: Path,
               timeout_s: int, threads: int, log) -> dict:
    tests = copy_tests(work / target)
    junit = out / f"junit-{target}.xml"
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(server_bin), "EP_UPSTREAM_MODEL": str(models["generation"][0]),
           "EP_UPSTREAM_EMBEDDING_MODEL": str(models["embedding"][0]),
           "PYTHONPATH": str(HERE), "PORT": str(free_port()), "LLAMA_CACHE": str(work / "llama-cache"),
           "PYTHONDONTWRITEBYTECODE": "1", "LLAMA_ARG_THREADS": str(threads)}
    for k in ("SLOW_TESTS", "DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "LLAMA_ARG_HOST", "LLAMA_API_KEY"):
        env.pop(k, None)
    cmd = [str(py), "-m", "pytest", "-p", "ep_upstream_plugin", "-p", "no:cacheprovider", "-m", "not slow",
           f"--timeout={timeout_s}", f"--junitxml={junit}", "-o", "junit_family=xunit1", "-rA", "-v",
           *[f"unit/{f}" for f in files]]
    log(f"{target}: {shlex.join(cmd)}  (in {tests}, LLAMA_SERVER_BIN_PATH={server_bin})")
    t0 = time.time()
    with open(out / f"pytest-{target}.log", "w") as f:
        rc = subprocess.run(cmd, cwd=tests, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    results = read_junit(junit) if junit.exists() else {}
    log(f"{target}: pytest exit {rc}, {len(results)} tests in {wall:.0f} s")
    return {"rc": rc, "wall_s": round(wall, 1), "bin": str(server_bin), "results": results}


def read_junit(path: Path) -> dict[str, str]:
    """FILE::NAME[PARAMS] -> passed / failed / skipped."""
    out = {}
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        import gzip
        with gzip.open(path.with_name(path.name + ".gz")) as f:
            root = ET.parse(f).getroot()
    else:
        root = ET.parse(path).getroot()
    for tc in root.iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        if cls:
            key = f"{cls.split('.')[-1]}.py::{name}"
        else:  # a collection error: the module itself
            key = f"{name.split('.')[-1]}.py::<collection>"
        tags = {c.tag for c in tc}
        out[key] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    return out


def start_refusals(log: Path) -> dict[str, str]:
    """Failed test (its section title in pytest's log: NAME[PARAMS], no file) -> why serve refused to start its
    server: a llama-server flag serve does not implement (`--flag`), else serve's one-line error in quotes."""
    if not log.exists():
        return {}
    out: dict[str, str] = {}
    name, in_failures = None, False
    for line in log.read_text(errors="replace").splitlines():
        if re.match(r"^=+ (FAILURES|ERRORS) =+$", line):
            in_failures = True
            continue
        if re.match(r"^=+ .* =+$", line):
            in_failures = False
        if not in_failures:
            continue
        if m := re.match(r"^_+ ([^_\s].*) _+$", line):  # a test's section (one underscore each side if it is long)
            name = m.group(1)
        elif name and name not in out:
            if m := re.search(r"expert-pack serve: error: (-[-\w]+) is a llama-server flag", line):
                out[name] = f"`{m.group(1)}`"
            elif m := re.search(r"expert-pack serve: error: (.*)", line):
                out[name] = f'"{m.group(1).strip()[:100]}"'
    return out


def refusal_counts(refusals: dict[str, str], tests: list[str]) -> dict[str, int]:
    """reason -> how many of `tests` (FILE::NAME[PARAMS]) serve refused to start for it."""
    counts: dict[str, int] = {}
    for t in tests:
        why = refusals.get(t.split("::", 1)[1])
        if why:
            counts[why] = counts.get(why, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def summarize(runs: dict[str, dict], files: list[str], excluded: dict[str, str], known: dict) -> dict:
    stock = runs.get("stock", {}).get("results", {})
    baseline = sorted(t for t, o in stock.items() if o == "passed")
    s: dict = {"baseline": baseline, "per_target": {}, "unexplained_on_stock": {}, "explained_on_stock": {}}
    for t, o in sorted(stock.items()):
        if o == "failed":
            why = expected_failure(t, known)
            if why:
                s["explained_on_stock"][t] = f"{why['kind']}: {why['reason']}"
            else:
                s["unexplained_on_stock"][t] = ""
    for target, r in runs.items():
        res = r["results"]
        counts = {o: sum(1 for v in res.values() if v == o) for o in ("passed", "failed", "skipped")}
        of_base = [t for t in baseline if res.get(t) == "passed"]
        s["per_target"][target] = {
            **counts, "baseline_passed": len(of_base) if stock else None,
            "baseline_not_passed": {t: res.get(t, "not run") for t in baseline if res.get(t) != "passed"},
            "passed_not_on_stock": sorted(t for t, o in res.items() if o == "passed" and t not in set(baseline))
            if stock else [],
        }
    s["files"] = files
    s["excluded"] = excluded
    return s


def refused_line(counts: dict[str, int], n_missed: int) -> str:
    return (f"Of the {n_missed} stock passes serve does not pass, {sum(counts.values())} fail because serve refuses to "
            "start (a llama-server flag it does not implement, or its error): "
            + "; ".join(f"{f} {n}" for f, n in counts.items()) + ".")


def table(runs: dict[str, dict], files: list[str], excluded: dict[str, str], s: dict) -> str:
    targets = list(runs)
    base = set(s["baseline"])
    have_stock = "stock" in runs
    head = ["file", "tests"] + [f"{t} p/f/s" for t in targets]
    if have_stock:
        head += ["stock passes"] + [f"{t} of those" for t in targets if t != "stock"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    tot = {t: [0, 0, 0] for t in targets}
    tot_base = {t: 0 for t in targets}
    n_all = 0
    for f in files:
        ids = sorted({k for r in runs.values() for k in r["results"] if k.startswith(f + "::")})
        n_all += len(ids)
        row = [f, str(len(ids))]
        for t in targets:
            res = runs[t]["results"]
            c = [sum(1 for k in ids if res.get(k) == o) for o in ("passed", "failed", "skipped")]
            tot[t] = [a + b for a, b in zip(tot[t], c)]
            row.append("/".join(map(str, c)))
        if have_stock:
            fb = [k for k in ids if k in base]
            row.append(str(len(fb)))
            for t in targets:
                if t == "stock":
                    continue
                n = sum(1 for k in fb if runs[t]["results"].get(k) == "passed")
                tot_base[t] += n
                row.append(f"{n}/{len(fb)}")
        lines.append("| " + " | ".join(row) + " |")
    row = ["**all run**", str(n_all)] + ["/".join(map(str, tot[t])) for t in targets]
    if have_stock:
        row += [str(len(base))] + [f"**{tot_base[t]}/{len(base)}**" for t in targets if t != "stock"]
    lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("p/f/s: passed / failed (errors included) / skipped.")
    if have_stock:
        kinds: dict[str, int] = {}
        for why in s["explained_on_stock"].values():
            kinds[why.split(":", 1)[0]] = kinds.get(why.split(":", 1)[0], 0) + 1
        n_fail = len(s["explained_on_stock"]) + len(s["unexplained_on_stock"])
        lines.append(f"Stock fails {n_fail}: known.toml explains "
                     + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])) or "none")
                     + (f"; {len(s['unexplained_on_stock'])} unexplained" if s["unexplained_on_stock"] else "")
                     + " (text: asserts stories260K's words; tokens: its token counts; network, media, ui, model: "
                       "see known.toml).")
    lines.append("")
    lines.append("Not run (upstream_suite/known.toml):")
    lines.append("")
    for f, why in excluded.items():
        lines.append(f"* `{f}`: {why}")
    return "\n".join(lines) + "\n"


def git_state() -> dict:
    """The checkout's commit and its uncommitted tracked files (the dev venv's packages may link into the checkout,
    so these are part of what ran)."""
    try:
        c = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                           check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.splitlines()
        return {"commit": c, "uncommitted": [ln[3:] for ln in dirty]}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "uncommitted": []}


def machine() -> str:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: stock,fork,serve (default all)")
    p.add_argument("--files", nargs="*", help="test files of unit/ to run (default: all but known.toml's excluded)")
    p.add_argument("--out", type=Path, required=True, help="folder for the junit XML, logs, summary and table")
    p.add_argument("--work", type=Path, default=Path("/tmp/ep-upstream-suite"),
                   help="scratch folder: the test copies, the synthetic model and pack (default %(default)s)")
    p.add_argument("--venv", type=Path, default=Path("/tmp/upv"), help="venv for the suite (default %(default)s)")
    p.add_argument("--stock-bin", type=Path, default=STOCK_BIN, help="stock llama-server (default %(default)s)")
    p.add_argument("--build-stock", action="store_true", help="build the default --stock-bin when it is missing")
    p.add_argument("--cache-slots", type=int, default=8,
                   help="experts per layer the fork's and serve's cache holds (of 16; default %(default)s: it evicts)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads of every server (LLAMA_ARG_THREADS, which the shim gives serve as --threads) where "
                        "a test sets none (default %(default)s: on a shared 2-core machine two threads spin-wait "
                        "on each other and decode 50x slower)")
    p.add_argument("--summarize-only", action="store_true",
                   help="run nothing: redo summary.json and table.md from --out's run.json and junit XML (after an "
                        "edit of known.toml)")
    p.add_argument("--timeout", type=int, default=300, help="per-test timeout of pytest-timeout, s (a hang guard)")
    a = p.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    if bad := [t for t in targets if t not in TARGETS]:
        p.error(f"unknown target(s) {bad}; choose from {TARGETS}")

    def log(msg: str) -> None:
        print(f"[upstream-suite {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    known = load_known()
    files, excluded = suite_files(known)
    if a.files:
        unknown = [f for f in a.files if not (TESTS / "unit" / f).exists()]
        if unknown:
            p.error(f"not in the suite: {unknown}")
        files = [f for f in files if f in a.files] + [f for f in a.files if f not in files]
    a.out.mkdir(parents=True, exist_ok=True)
    if a.summarize_only:
        run = json.loads((a.out / "run.json").read_text())
        runs = {t: {**v, "results": read_junit(a.out / f"junit-{t}.xml")} for t, v in run["targets"].items()}
        # (read_junit also takes junit-TARGET.xml.gz, as docs/results keeps them)
        return report(run, runs, run["files"], excluded, known, a.out)
    a.work.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone()
    state = git_state()

    py = ensure_venv(a.venv, log)
    models = ensure_models(a.work, log)
    from expert_pack_devtools.lossless import cache_mib_for_slots
    from ggml_expert_pack.tools import tool_path
    cache_mib = cache_mib_for_slots(models["generation"][1], a.cache_slots)  # the same experts in both
    bins, builds = {}, {}
    if "stock" in targets:
        bins["stock"] = ensure_stock(a.stock_bin, a.build_stock, log)
        builds["stock"] = built(bins["stock"])
    if "fork" in targets:
        bins["fork"] = write_wrapper(a.work / "llama-server-fork", "fork", tool_path("llama-server"), models,
                                     cache_mib)
        builds["fork"] = built(tool_path("llama-server"))
    if "serve" in targets:
        ep = Path(sys.executable).parent / "expert-pack"
        if not ep.exists():
            raise SystemExit(f"no expert-pack command beside {sys.executable}")
        keep = serve_keeps(ep)
        log(f"serve: accepts {keep or 'none'} of the flags the shim drops otherwise")
        bins["serve"] = write_wrapper(a.work / "llama-server-serve", "serve", ep, models, cache_mib, keep)

    runs = {t: run_target(t, bins[t], files, py, models, a.work, a.out, a.timeout, a.threads, log) for t in targets}
    run = {
        **state, "date": started.isoformat(timespec="seconds"), "machine": machine(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        "models": {k: str(m) for k, (m, _) in models.items()}, "model": MODEL_DESCRIPTION,
        "cache": f"{a.cache_slots} of 16 experts per layer ({cache_mib:.3f} MiB)", "timeout_s": a.timeout,
        "threads": a.threads, "files": files,
        "targets": {t: {"bin": r["bin"], "rc": r["rc"], "wall_s": r["wall_s"], **({"built": builds[t]} if t in builds
                                                                                   else {})}
                    for t, r in runs.items()},
        "suite_packages": subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True,
                                         text=True).stdout.split(),
    }
    (a.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    return report(run, runs, files, excluded, known, a.out)


def report(run: dict, runs: dict, files: list[str], excluded: dict[str, str], known: dict, out: Path) -> int:
    """summary.json and table.md from the runs' results; prints the table. 1 when the fork misses a stock pass."""
    s = summarize(runs, files, excluded, known)
    if "serve" in runs:
        saved = out / "serve-start-refusals.json"  # kept beside the results: the log is too large to keep
        if (out / "pytest-serve.log").exists():
            refusals = start_refusals(out / "pytest-serve.log")
            saved.write_text(json.dumps(refusals, indent=1) + "\n")
        else:
            refusals = json.loads(saved.read_text()) if saved.exists() else {}
        missed = list(s["per_target"]["serve"]["baseline_not_passed"])
        s["serve_start_refusals"] = refusal_counts(refusals, missed)
        s["serve_missed_otherwise"] = [t for t in missed if t.split("::", 1)[1] not in refusals]
    s["run"] = run
    s["results"] = {t: r["results"] for t, r in runs.items()}
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    tab = table(runs, files, excluded, s)
    if s.get("serve_start_refusals") and "stock" in runs:
        tab += "\n" + refused_line(s["serve_start_refusals"], len(s["per_target"]["serve"]["baseline_not_passed"])) + "\n"
    (out / "table.md").write_text(tab)
    print(tab)
    for t, v in s["per_target"].items():
        if t != "stock" and "stock" in runs:
            print(f"{t}: {v['baseline_passed']}/{len(s['baseline'])} of stock's passes; not passing: "
                  f"{len(v['baseline_not_passed'])}")
    if s["unexplained_on_stock"]:
        print(f"stock failures known.toml does not explain ({len(s['unexplained_on_stock'])}):")
        for t in s["unexplained_on_stock"]:
            print(f"  {t}")
    fork = s["per_target"].get("fork")
    return 1 if fork and "stock" in runs and fork["baseline_not_passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
