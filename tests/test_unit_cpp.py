"""The runtime's C++ unit tests (tests/cpp/unit_tests.cpp: policy, RAM-tier modes, I/O queue, prefetch, memory
limit, configuration), built with the library into the build directory by `pip install .` and run here."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _binary() -> Path | None:
    found = sorted(ROOT.glob("build/*/ggml_expert_pack/expert-pack-unit-tests"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def test_cpp_unit_tests():
    exe = _binary()
    if exe is None:
        pytest.skip("no build directory with expert-pack-unit-tests (it is built by `pip install .` from this tree)")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout
