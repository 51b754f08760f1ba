"""Fuzzing with fixed seeds: mutated manifests, trunks, sources and pack data through verify, inspect and
load-and-generate (scripts/fuzz.py holds the engine; `python scripts/fuzz.py --count N` runs longer campaigns).

Allowed outcomes: a clean refusal (one line on stderr and a non-zero exit; at load, an exception with a message)
or acceptance with output identical to the unmutated original's. A crash (signal), a hang, a traceback or changed
output without an error fails, with the mutation and a command that repeats it in the message. Loading runs in a
worker subprocess that serves many mutations in turn, so a crash fails its test instead of ending the run.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SEED = 20251201
COUNTS = {"manifest": 300, "manifest-resealed": 200, "trunk": 200, "trunk-resealed": 200, "pack": 200, "source": 100}

_spec = importlib.util.spec_from_file_location("ep_fuzz", Path(__file__).resolve().parent.parent / "scripts" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["ep_fuzz"] = fuzz
_spec.loader.exec_module(fuzz)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fuzz")
    worker = fuzz.Worker(workdir, 300)
    base = fuzz.prepare(workdir, worker=worker, log=lambda m: None)
    worker.timeout_s = max(30.0, 30 * base.load_s)
    yield fuzz.Campaign(base, worker, SEED, log=lambda m: None)
    worker.close()


def _check(results, cls):
    bad = [r for r in results if r.bad]
    summary = fuzz.table(results)
    assert not bad, (f"{len(bad)} of {len(results)} {cls} mutations failed:\n" + "\n".join(r.line() for r in bad)
                     + "\n" + summary)


@pytest.mark.parametrize("cls", list(COUNTS))
def test_mutations(campaign, cls):
    results = campaign.run(cls, COUNTS[cls])
    assert len(results) == COUNTS[cls]
    _check(results, cls)


def test_the_oracle_sees_each_outcome(campaign, tmp_path):
    """The judge itself: an untouched pack is identical everywhere, a flipped block byte is refused by verify,
    and a worker that dies is reported as a crash with its signal, not as the end of the run."""
    r = fuzz.Result("pack", -1, "untouched")
    d = tmp_path / "same"
    fuzz._link_pack(campaign.base, d, ())
    campaign._stages(d, r, must_refuse=False)
    assert [s.outcome for s in r.stages] == ["identical"] * 3, r.stages
    st = fuzz.cli_stage("verify", ["verify", str(tmp_path / "nope"), "--quiet"], campaign.base.verify_out, {})
    assert st.outcome == "refused" and "no such directory" in st.detail
    crash, res = campaign.worker.run({"id": "die", "model": "/nonexistent", "crash_for_test": True})
    assert crash == "crash" and "SIGABRT" in res["detail"]
    st, _ = fuzz.load_stage(campaign.worker, {"id": "after", "model": str(campaign.base.pack / "trunk.gguf"),
                                              "pack": str(campaign.base.pack)}, campaign.base.tokens)
    assert st.outcome == "identical"  # a fresh worker took over


def test_a_mutation_repeats_from_its_seed(campaign):
    a = campaign.one("manifest", 7)
    b = campaign.one("manifest", 7)
    assert a.desc == b.desc and [s.outcome for s in a.stages] == [s.outcome for s in b.stages]
