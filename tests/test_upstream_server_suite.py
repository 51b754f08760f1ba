"""llama.cpp's own server test suite (the vendored tools/server/tests) against stock llama-server, the fork's
llama-server with a pack, and `expert-pack serve`, on a local synthetic model (scripts/upstream_server_suite.py).

The whole run is opt-in: EP_UPSTREAM_SUITE=1. It installs the suite's requirements into a venv of its own
(EP_UPSTREAM_VENV, default /tmp/upv; never this one), builds stock llama-server into build/stock-server when it is
missing (scripts/build_stock_server.sh), and runs the suite three times. The fork must pass every test that passes on
stock; serve must pass at least as many of those as known.toml's floor says (the count of the last recorded run), so
that it cannot fall back unnoticed. The wrappers' command-line translation and known.toml are checked always."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "upstream_server_suite.py"
SUITE = ROOT / "scripts" / "upstream_suite"
UNIT = ROOT / "vendor" / "upstream" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "tools" / "server" / "tests" / "unit"

_spec = importlib.util.spec_from_file_location("ep_upstream_shim", SUITE / "shim.py")
shim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shim)


_spec = importlib.util.spec_from_file_location("ep_upstream_runner", SCRIPT)
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


def known() -> dict:
    with open(SUITE / "known.toml", "rb") as f:
        return tomllib.load(f)


def test_fork_wrapper_adds_the_pack(tmp_path):
    model, pack = str(tmp_path / "m.gguf"), str(tmp_path / "m.pack")
    got = shim.fork_argv(["--port", "8080", "--model", model, "--no-jinja", "--parallel", "2"], "/bin/ls",
                         {model: pack}, "1.5")
    assert got == ["/bin/ls", "--port", "8080", "--model", f"{pack}/trunk.gguf", "--no-jinja", "--parallel", "2",
                   "--expert-pack", pack, "--expert-cache-mib", "1.5", "--expert-cache-reserve-mib", "0"]
    # a router server (no model) runs as it is
    assert shim.fork_argv(["--port", "8080", "--models-max", "2"], "/bin/ls", {model: pack}, "1.5") == \
        ["/bin/ls", "--port", "8080", "--models-max", "2"]


def test_serve_wrapper_translates(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_ARG_THREADS", raising=False)
    model, pack = str(tmp_path / "m.gguf"), str(tmp_path / "m.pack")
    got = shim.serve_argv(["--port", "8080", "--temp", "0.8", "--offline", "--model", model, "--cont-batching",
                           "--parallel", "2", "--no-jinja", "--ctx-size", "512", "--reranking"], "/x/expert-pack",
                          {model: pack}, "1.5")
    # dropped: --offline, --cont-batching, --parallel 2, --no-jinja; anything else (--reranking) is serve's to refuse
    assert got == ["/x/expert-pack", "serve", pack, "--cache-mib", "1.5", "--cache-reserve-mib", "0",
                   "--port", "8080", "--temp", "0.8", "--ctx-size", "512", "--reranking"]
    # a flag serve accepts passes through (the runner reads them from serve's --help)
    assert shim.serve_argv(["--model", model, "--parallel", "2"], "/x/expert-pack", {model: pack}, "1.5",
                           frozenset({"--parallel"}))[-2:] == ["--parallel", "2"]
    # the runner's LLAMA_ARG_THREADS becomes --threads, unless the command line has its own
    monkeypatch.setenv("LLAMA_ARG_THREADS", "1")
    assert shim.serve_argv(["--model", model], "/x/expert-pack", {model: pack}, "1.5")[-2:] == ["--threads", "1"]
    assert shim.serve_argv(["--model", model, "-t", "2"], "/x/expert-pack", {model: pack}, "1.5")[-2:] == ["-t", "2"]


def test_wrapper_runs_the_shim(tmp_path, monkeypatch):
    """The wrapper the suite starts as llama-server: its baked-in arguments reach the shim (a kept flag such as
    --parallel too), which execs the translated command (here echo, which prints it)."""
    monkeypatch.delenv("LLAMA_ARG_THREADS", raising=False)
    model, pack = tmp_path / "m.gguf", tmp_path / "m.pack"
    w = runner.write_wrapper(tmp_path / "llama-server", "serve", Path("/bin/echo"), {"generation": (model, pack)},
                             1.5, ["--parallel"])
    r = subprocess.run([str(w), "--model", str(model), "--parallel", "2", "--no-jinja"], capture_output=True,
                       text=True, check=True)
    assert r.stdout.split() == ["serve", str(pack), "--cache-mib", "1.500", "--cache-reserve-mib", "0",
                                "--parallel", "2"]


def test_known_patterns_match_literally():
    assert runner.matches("test_a.py::test_b[*]", "test_a.py::test_b[x-1]")
    assert not runner.matches("test_a.py::test_b[*]", "test_a.py::test_b_other")
    assert not runner.matches("test_a.py::test_b", "test_a.py::test_b[x]")


def test_known_names_the_suites_files():
    k = known()
    for f, v in k["excluded"].items():
        assert (UNIT / f).exists(), f
        assert v["reason"].strip(), f
    files = {p.name for p in UNIT.glob("test_*.py")}
    for pattern, v in k["cannot_pass"].items():
        assert pattern.split("::")[0] in files and pattern.split("::")[0] not in k["excluded"], pattern
        assert v["reason"].strip(), pattern
    assert isinstance(k["floor"]["serve"], int)


def test_doc_quotes_the_recorded_run():
    """docs/SERVER_COMPAT.md's table is the table.md of the results it names, and known.toml's floor is that run's
    count for serve."""
    doc = (ROOT / "docs" / "SERVER_COMPAT.md").read_text()
    results = re.search(r"\(results/([^)]+)/\)", doc).group(1)
    recorded = ROOT / "docs" / "results" / results
    rows = lambda text: [ln for ln in text.splitlines() if ln.startswith("|")]  # noqa: E731
    assert rows(doc)[-len(rows((recorded / "table.md").read_text())):] == rows((recorded / "table.md").read_text())
    s = json.loads((recorded / "summary.json").read_text())
    assert known()["floor"]["serve"] == s["per_target"]["serve"]["baseline_passed"]


@pytest.mark.skipif(os.environ.get("EP_UPSTREAM_SUITE") != "1",
                    reason="the upstream server suite runs with EP_UPSTREAM_SUITE=1 (long; installs its requirements "
                           "into a separate venv)")
def test_upstream_server_suite(tmp_path):
    out = tmp_path / "out"
    venv = os.environ.get("EP_UPSTREAM_VENV", "/tmp/upv")
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--work", str(tmp_path / "work"), "--venv", venv,
           "--build-stock"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    print(r.stdout[-20000:])
    assert (out / "summary.json").exists(), r.stdout[-5000:] + r.stderr[-5000:]
    s = json.loads((out / "summary.json").read_text())
    base = s["baseline"]
    assert base, "nothing passed on stock llama-server: the setup is broken (see pytest-stock.log)"
    fork = s["per_target"]["fork"]
    assert fork["baseline_not_passed"] == {}, f"the fork's llama-server does not pass what stock passes:\n" \
        + "\n".join(f"  {t}: {o}" for t, o in fork["baseline_not_passed"].items())
    serve = s["per_target"]["serve"]
    floor = known()["floor"]["serve"]
    print(f"serve passes {serve['baseline_passed']} of stock's {len(base)}")
    assert serve["baseline_passed"] >= floor, \
        f"serve passes {serve['baseline_passed']} of stock's {len(base)} tests, fewer than the {floor} of the last " \
        "recorded run (scripts/upstream_suite/known.toml, [floor]); not passing:\n" \
        + "\n".join(f"  {t}: {o}" for t, o in serve["baseline_not_passed"].items())
