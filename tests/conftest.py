"""Shared fixtures: small synthetic models generated once per test session (seconds each)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The tests exercise the installed package. `python -m pytest` in the checkout puts the checkout first on sys.path,
# where the source folder ggml_expert_pack/ would shadow it: that folder is not the installed package (the wheel adds
# packer/, server/ and pybind/ into it, pyproject.toml, and bin/, data/ and the libraries beside it).
_CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _CHECKOUT]

import ggml_expert_pack  # noqa: E402

if not (Path(ggml_expert_pack.__file__).parent / "packer").is_dir():
    raise pytest.UsageError(f"ggml_expert_pack is imported from {Path(ggml_expert_pack.__file__).parent}, not from an "
                            "install: run `pip install .` (README, Quick start)")

from expert_pack_devtools.synth import SHAPES, SynthConfig, generate  # noqa: E402

# The smallest models that still exercise each arch's features.
TINY = {
    "qwen3moe": dict(arch="qwen3moe", **SHAPES["tiny"]),
    "deepseek4": dict(arch="deepseek4", **{**SHAPES["tiny"], "n_head": 4, "head_dim": 64,
                                            "n_hash_layers": 1, "n_mtp_layers": 1}),
    "kimi-k3": dict(arch="kimi-k3", **{**SHAPES["tiny"], "n_dense_lead": 1, "n_expert_latent": 256}),
}


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    from ggml_expert_pack.libggml import gpu_devices
    if gpu_devices():
        return
    skip = pytest.mark.skip(reason="no CUDA device (or a CPU-only build)")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def synth_model(model_dir):
    """synth_model(name, **overrides) -> path of a generated model, generated once per distinct request."""
    cache: dict = {}

    def make(name: str, shards: int = 1, **overrides):
        cfg = SynthConfig.from_dict({**TINY[name], **overrides})
        # keyed by the whole configuration: requests that spell the same model differently (a default given
        # explicitly, such as expert_type="q4_k") share one file
        key = (shards, repr(dataclasses.asdict(cfg)))
        if key not in cache:
            out = model_dir / f"{name}-{len(cache)}.gguf"
            cache[key] = generate(cfg, out, shards=shards, progress=False)[0]
        return cache[key]

    return make


@pytest.fixture(scope="session")
def packs(synth_model, tmp_path_factory):
    """packs(name, **overrides) -> (original model, pack directory), packed once per distinct model.
    Tests that damage a pack work on a copy."""
    from ggml_expert_pack.packer import build
    root = tmp_path_factory.mktemp("packs")
    cache: dict = {}

    def get(name: str, **overrides):
        src = synth_model(name, **overrides)
        if src not in cache:  # one pack per model file
            cache[src] = (src, build(src, root / f"{name}-{len(cache)}").pack_dir)
        return cache[src]
    return get


@dataclasses.dataclass
class Served:
    """A running `expert-pack serve`: its base URL, its log file (stdout and stderr) and its process."""
    base: str
    log: Path
    proc: subprocess.Popen


@pytest.fixture(scope="session")
def start_serve(tmp_path_factory):
    """start_serve(model, args=(), name="serve") -> a context manager that runs `expert-pack serve [model] *args
    --port <free>` (model: a pack folder or a GGUF file; None when args name it with -m) from the checkout, its
    output in a log file of its own, and yields a Served once /health answers (the test fails with the log if it
    never does); leaving it stops the server (SIGTERM, then SIGKILL after 10 s). A module's server:

        with start_serve(packs("qwen3moe")[1], ["-c", 512, "-t", 2]) as s:
            yield s.base
    """
    from expert_pack_devtools.bench_client import free_port, wait_healthy
    from expert_pack_devtools.proc import expert_pack_argv

    @contextlib.contextmanager
    def start(model=None, args=(), name: str = "serve", timeout_s: float = 120):
        log_path = tmp_path_factory.mktemp(name) / "server.log"
        port = free_port()
        cmd = [*expert_pack_argv(), "serve", *([] if model is None else [str(model)]), *map(str, args),
               "--port", str(port)]
        base = f"http://127.0.0.1:{port}"
        with open(log_path, "w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_CHECKOUT)
            try:
                if not wait_healthy(base, proc, timeout_s):
                    proc.kill()
                    pytest.fail(f"server did not start:\n{log_path.read_text()}")
                yield Served(base, log_path, proc)
            finally:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    return start


@pytest.fixture(scope="session")
def stock():
    """Stock llama.cpp's reference runs, each computed once per test run and shared by every test that compares
    against the same model file and settings: stock.run(model, **run_kw) is lossless.run(model, None, **run_kw),
    stock.generate(model, prompt, n, **session_kw) a fresh Session's greedy generate (expert_pack_devtools.lossless,
    StockCache). The references are the same bits a fresh computation gives, so the comparisons stay exact."""
    from expert_pack_devtools.lossless import StockCache
    _STOCK.append(StockCache())
    return _STOCK[-1]


_STOCK: list = []


def pytest_terminal_summary(terminalreporter):
    for c in _STOCK:
        terminalreporter.write_line(f"stock references: {c.computed} computed, {c.hits} reused")
