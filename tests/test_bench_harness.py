"""The benchmark harness (expert_pack_devtools.bench): every system and question file loads and resolves against a
real pack, and the command lines it builds are ones the servers accept. No server is started."""
from __future__ import annotations

import json
import re

import pytest

from expert_pack_devtools.bench import harness
from ggml_expert_pack.cli import build_parser, main

SERVE_CACHE_FLAGS = ("--cache-mib", "--cache-reserve-mib", "--ram-cache-mib", "--ram-tier-mode", "--prefetch",
                     "--stage-slots", "--read-splits", "--read-threads", "--direct-io", "--verify-checksums")


@pytest.fixture(scope="module")
def model_pack(packs):
    return packs("qwen3moe")


def test_every_file_loads_with_a_descriptive_name():
    systems = harness.system_names()
    assert len(systems) >= 15 and harness.question_names()
    letters = [harness.load_system(n).get("formerly") for n in systems]
    assert len(set(filter(None, letters))) == len(list(filter(None, letters)))  # each old letter names one system
    for n in systems:
        assert len(n) > 8 and "-" in n, n  # descriptive, not a letter
    for q in harness.question_names():
        assert harness.load_question(q)["baseline"] in harness.load_question(q)["systems"]


@pytest.mark.parametrize("name", harness.question_names())
def test_question_resolves_to_command_lines_the_servers_take(model_pack, name):
    src, pack = model_pack
    q = harness.load_question(name)
    p = harness.plan(q, src, pack, strict=False)
    v = p["values"]
    assert v["cache_slots"] >= 1 and v["ram_cap_bytes"] == int(q["workload"]["ram_cap_frac"] * src.stat().st_size)
    assert [s["system"] for s in p["systems"]] == q["systems"]
    for s in p["systems"]:
        argv, cfg = s["argv"], s["config"]
        assert not [a for a in argv if re.search(r"\{(?!port\})\w*\}", a)], argv  # only the port is left open
        assert s["n_predict"] == q["workload"][cfg["n_predict"]]
        assert f"-c {q['workload']['ctx']}" in " ".join(argv)
        if cfg["program"] == "expert-pack serve":
            args = argv[argv.index("serve") + 1:]
            assert all(f in args for f in SERVE_CACHE_FLAGS), (cfg["name"], set(SERVE_CACHE_FLAGS) - set(args))
            assert str(v["cache_mib"]) in args or str(v["tiny_cache_mib"]) in args  # full precision: exact slots
            ns = build_parser().parse_args(["serve", *[a.replace("{port}", "8080") for a in args]])
            from ggml_expert_pack.server.main import pack_config, validate_pack_config
            validate_pack_config(pack_config(ns))  # the provider's own checks take the configuration
        else:
            assert "--expert-pack" not in argv or all(
                "--expert-" + f[2:] in argv for f in SERVE_CACHE_FLAGS), cfg["name"]
            from ggml_expert_pack.server.main import llama_server_flags
            known = llama_server_flags()
            if known:  # the fork's llama-server is installed: it knows every flag
                assert {a for a in argv[1:] if a.startswith("-") and not re.fullmatch(r"-\d+", a)} <= known


def test_dry_run_writes_the_plan_and_starts_nothing(model_pack, tmp_path, capsys):
    src, pack = model_pack
    out = tmp_path / "out"
    assert main(["bench", "run", "read-threads", "--model", str(src), "--pack", str(pack), "--out", str(out),
                 "--dry-run", "--set", "budget_s=7"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["question"]["workload"]["budget_s"] == 7.0
    assert [s["system"] for s in plan["systems"]] == ["serve-odirect", "serve-4-threads"]
    text = capsys.readouterr().out
    assert "expert-pack serve -m" in text and "--read-threads 4" in text
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]


@pytest.mark.parametrize("argv, msg", [
    (["bench", "show", "no-such-question"], "no question 'no-such-question'"),
    (["bench", "show", "read-threads", "--set", "budget_s=-1"], "budget_s must be > 0"),
    (["bench", "show", "read-threads", "--set", "colour=red"], "expected KEY=VALUE"),
    (["bench", "report", "/nonexistent-results"], "no run.json"),
])
def test_bad_input_is_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_question_files_are_named(tmp_path, capsys):
    q = json.loads((harness.QUESTIONS_DIR / "read-threads.json").read_text())
    for edit, msg in [({"systems": ["serve-odirect", "no-such-system"]}, "no system 'no-such-system'"),
                      ({"baseline": "stock-all-gpu"}, "is not one of its systems"),
                      ({"metrics": ["speed"]}, "unknown metric speed")]:
        path = tmp_path / "q.json"
        path.write_text(json.dumps({**q, **edit}))
        assert main(["bench", "show", str(path)]) == 2
        assert msg in capsys.readouterr().err


def test_report_from_results(tmp_path):
    """report: the question's metrics per system and the ratio to its baseline, with the run's provenance."""
    q = harness.load_question("read-threads")
    run = {"date": "2026-12-01 10:00 UTC", "commit": "0123456789abcdef", "dirty": False,
           "machine": {"host": "h", "cpus": 16, "gpus": ["NVIDIA H200"]},
           "question": {k: q[k] for k in ("name", "question", "baseline", "metrics", "workload", "systems")},
           "values": {"model_bytes": 1e9, "ram_cap_bytes": 2e8, "cache_slots": 18, "n_experts": 128,
                      "cache_mib": 100.0, "tiny_cache_slots": 8, "tiny_cache_mib": 50.0, "ram_tier_mib": 95}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    for name, dec in (("serve-odirect", 2.0), ("serve-4-threads", 3.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"system": name, "summary": {"all": {
            "requests": 4, "decode_tok_s": dec, "prefill_tok_s": 5.0, "ssd_bytes_per_token": 4e8}}}))
    text = harness.report(tmp_path)
    assert "commit 0123456789ab" in text and "NVIDIA H200" in text
    assert "| serve-4-threads | 3.00 | 5.00 | 400.0 | 1.50x | 1.00x |" in text
