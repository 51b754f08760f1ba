"""`expert-pack serve`'s command line and start-up: every refusal is one line in the command line's terms (exit 2,
no traceback, before any model is loaded), the port is bound before the model loads, a pack folder alone is
served under the model's general.name, and a signal stops it cleanly."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from expert_pack_devtools.bench_client import free_port, wait_healthy
from ggml_expert_pack.cli import build_parser, main
from expert_pack_devtools.proc import expert_pack_argv

ROOT = Path(__file__).resolve().parent.parent


def refused(capsys, argv: list[str]) -> str:
    """Run `expert-pack serve ARGV` in-process; it must refuse with exit 2 and exactly one line on stderr."""
    from expert_pack_devtools.bench_client import free_port
    try:  # a free port first (a later --port in argv wins): a refusal must not depend on 8080 being free
        code = main(["serve", "--port", str(free_port()), *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    out = capsys.readouterr()
    assert code == 2, out
    err = out.err.strip()
    assert err and "\n" not in err, err
    assert "Traceback" not in err and "usage:" not in err
    assert err.startswith("expert-pack serve: error: "), err
    return err


# --- flags ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["-m", "x.gguf", "--port", "99999"], ["--port", "1..65535", "99999"]),
    (["-m", "x.gguf", "--port", "0"], ["--port", "1..65535"]),
    (["-m", "x.gguf", "--threads-http", "0"], ["--threads-http", ">= 1"]),
    (["-m", "x.gguf", "-c", "-1"], ["--ctx-size", ">= 0", "training context"]),
    (["-m", "x.gguf", "-b", "0"], ["--batch-size", ">= 1"]),
    (["-m", "x.gguf", "-ngl", "-2"], ["--n-gpu-layers", ">= -1"]),
    (["-m", "x.gguf", "-t", "0"], ["--threads", ">= 1"]),
    (["-m", "x.gguf", "--port", "http"], ["--port", "not an integer"]),
    (["-m", "x.gguf", "--direct-io", "of"], ["--direct-io", "invalid choice"]),
    (["-m", "x.gguf", "-n", "-2"], ["--n-predict", ">= -1", "-1 = unlimited"]),
    (["-m", "x.gguf", "--seed", "-5"], ["--seed", "-1 = random"]),
    (["-m", "x.gguf", "--temp", "-0.5"], ["--temp", ">= 0"]),
    (["-m", "x.gguf", "--temp", "warm"], ["--temp", "not a number"]),
    (["-m", "x.gguf", "--top-k", "-1"], ["--top-k", ">= 0"]),
    (["-m", "x.gguf", "--top-p", "1.5"], ["--top-p", "0..1"]),
    (["-m", "x.gguf", "--min-p", "nan"], ["--min-p", "0..1"]),
    (["-m", "x.gguf", "--repeat-penalty", "0"], ["--repeat-penalty", "> 0"]),
], ids=["port-high", "port-zero", "threads-http", "ctx", "batch", "ngl", "threads", "port-text", "choice",
        "n-predict", "seed", "temp", "temp-text", "top-k", "top-p", "min-p", "repeat-penalty"])
def test_flag_ranges_are_checked_up_front(capsys, argv, words):
    err = refused(capsys, argv)
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("typo,meant", [("--cache-mb", "--cache-mib"), ("--expert-cache-mb", "--expert-cache-mib"),
                                        ("--threads-htp", "--threads-http"), ("--alais", "--alias"),
                                        ("--ram-cache-mb=5", "--ram-cache-mib")])
def test_unknown_flag_gets_a_suggestion(capsys, typo, meant):
    err = refused(capsys, ["-m", "x.gguf", typo, "5"] if "=" not in typo else ["-m", "x.gguf", typo])
    assert f"unrecognized argument {typo.split('=')[0]} (did you mean {meant}?)" in err, err


def test_llama_server_request_defaults_and_their_spellings(monkeypatch):
    from ggml_expert_pack.server.main import api_keys, request_defaults
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "-m", "m.gguf"])
    assert request_defaults(args) == {"n_predict": -1, "seed": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                      "min_p": 0.05, "repeat_penalty": 1.0}  # llama-server's own
    assert api_keys(args) == () and args.webui is True and args.metrics is False
    args = build_parser().parse_args(["serve", "-m", "m.gguf", "--predict", "7", "-s", "9", "--temperature", "0.2",
                                      "--metrics", "--no-ui", "--api-key", "a, b,,"])
    assert (args.n_predict, args.seed, args.temp, args.metrics, args.webui) == (7, 9, 0.2, True, False)
    assert api_keys(args) == ("a", "b")
    assert build_parser().parse_args(["serve", "-m", "m.gguf", "--n-predict", "3"]).n_predict == 3
    monkeypatch.setenv("LLAMA_API_KEY", "from-env")  # llama-server's variable
    assert api_keys(build_parser().parse_args(["serve", "-m", "m.gguf"])) == ("from-env",)
    assert api_keys(build_parser().parse_args(["serve", "-m", "m.gguf", "--api-key", "flag"])) == ("flag",)


@pytest.mark.parametrize("flag", ["--cache-reuse", "-fa", "--cont-batching", "--ctx-checkpoints=3", "--jinja"])
def test_llama_server_flag_serve_lacks_is_named(capsys, flag):
    from ggml_expert_pack.server.main import llama_server_flags
    from ggml_expert_pack.tools import tool_path
    try:
        tool_path("llama-server")
    except FileNotFoundError:
        pytest.skip("this install was built without the fork's llama-server")
    assert {"--ctx-size", "-n", "--n-predict", "--api-key", "--no-webui"} <= llama_server_flags()
    err = refused(capsys, ["-m", "x.gguf", flag, "2"] if "=" not in flag else ["-m", "x.gguf", flag])
    name = flag.split("=")[0]
    assert err == f"expert-pack serve: error: {name} is a llama-server flag that expert-pack serve does not " \
                  "implement", err


def test_without_llama_server_an_unknown_flag_is_argparses(capsys, monkeypatch):
    from ggml_expert_pack.server import main as serve_main
    monkeypatch.setattr(serve_main, "llama_server_flags", lambda: frozenset())
    err = refused(capsys, ["-m", "x.gguf", "--cache-reuse", "2"])
    assert "unrecognized argument --cache-reuse" in err, err


def test_unknown_flag_without_a_near_one(capsys):
    err = refused(capsys, ["-m", "x.gguf", "--zzzzzz"])
    assert "unrecognized argument --zzzzzz" in err and "--help" in err


def test_no_model(capsys):
    assert "no model" in refused(capsys, [])


def test_llama_server_slots_embedding_and_pooling_flags(capsys, tmp_path):
    args = build_parser().parse_args(["serve", "-m", "m.gguf"])
    assert (args.slots, args.embedding, args.pooling) == (True, False, None)  # llama-server's defaults
    args = build_parser().parse_args(["serve", "-m", "m.gguf", "--no-slots", "--embeddings", "--pooling", "mean"])
    assert (args.slots, args.embedding, args.pooling) == (False, True, "mean")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    err = refused(capsys, ["-m", str(model), "--pooling", "mean"])
    assert err.endswith("--pooling mean needs --embedding"), err
    err = refused(capsys, ["-m", str(model), "--embedding", "--pooling", "rank"])
    assert "--pooling" in err and "invalid choice" in err, err


def test_size_flags_pass_through_to_the_provider(tmp_path):
    from ggml_expert_pack.server.main import pack_config
    args = build_parser().parse_args(["serve", "-m", "m.gguf", "--expert-pack", str(tmp_path), "--cache-mib", "8G",
                                      "--cache-reserve-mib", "512M", "--ram-cache-mib", "auto"])
    assert pack_config(args) == {"pack_dir": str(tmp_path), "cache_vram_mib": "8G", "cache_vram_reserve_mib": "512M",
                                 "ram_cache_mib": "auto"}
    args = build_parser().parse_args(["serve", "-m", "m.gguf", "--expert-pack", str(tmp_path), "--cache-mib", "100",
                                      "--ram-cache-mib", "1.5"])
    assert pack_config(args) == {"pack_dir": str(tmp_path), "cache_vram_mib": 100.0, "ram_cache_mib": 1.5}


def test_provider_messages_speak_flags():
    from ggml_expert_pack.server.main import flag_terms
    assert flag_terms("expert_pack key 'cache_vram_mib' must be a number >= 0, got -5.0") == \
        "--cache-mib must be a number >= 0, got -5.0"
    assert flag_terms("expert_pack key 'prefetch' needs the host-RAM tier: prefetched experts land in its blocks "
                      "(set ram_cache_mib)") == \
        "--prefetch needs the host-RAM tier: prefetched experts land in its blocks (set --ram-cache-mib)"
    assert flag_terms("expert cache too small on CPU: 1.0 MiB (cache_vram_mib 1.0, free 9 MiB - reserve 0 MiB)") == \
        "expert cache too small on CPU: 1.0 MiB (--cache-mib 1.0, free 9 MiB - reserve 0 MiB)"


# --- paths ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pack(packs):
    return packs("qwen3moe")[1]


def test_missing_path(capsys, tmp_path):
    err = refused(capsys, ["-m", str(tmp_path / "nope.gguf")])
    assert err.endswith(f"-m {tmp_path / 'nope.gguf'}: no such file or directory"), err
    err = refused(capsys, [str(tmp_path / "nope.pack")])
    assert "no such file or directory" in err


def test_trunk_without_its_pack_names_the_flag(capsys, pack):
    err = refused(capsys, ["-m", str(pack / "trunk.gguf")])
    assert f"add --expert-pack {pack}" in err and "expert_pack=" not in err, err


def test_pack_folder_given_to_m_with_another_pack(capsys, pack, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    err = refused(capsys, ["-m", str(pack), "--expert-pack", str(other)])
    assert f"this is a pack folder: use {pack / 'trunk.gguf'} or pass the folder to --expert-pack" in err, err


def test_trunk_of_another_pack(capsys, pack, packs):
    other = packs("qwen3moe", seed=7)[1]
    err = refused(capsys, ["-m", str(pack / "trunk.gguf"), "--expert-pack", str(other)])
    assert "trunk of another pack" in err and "--expert-pack" in err, err


def test_folder_that_is_no_pack_and_file_that_is_no_gguf(capsys, tmp_path):
    assert "neither a GGUF file nor an expert pack" in refused(capsys, ["-m", str(tmp_path)])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    err = refused(capsys, ["-m", str(junk)])
    assert f"-m {junk} is not a GGUF file" in err, err
    assert "is not an expert pack: it has no manifest.json" in refused(
        capsys, ["-m", str(junk), "--expert-pack", str(tmp_path)])


def test_a_later_shard(capsys, synth_model):
    first = synth_model("qwen3moe", shards=3)
    second = first.with_name(first.name.replace("-00001-of-", "-00002-of-"))
    err = refused(capsys, ["-m", str(second)])
    assert f"-m {second} is shard 2 of 3 of a split model: give the first" in err, err


def test_pack_flags_in_flag_terms(capsys, pack):
    err = refused(capsys, [str(pack), "--cache-mib", "-5"])
    assert "--cache-mib must be" in err and "cache_vram_mib" not in err and "expert_pack" not in err, err
    err = refused(capsys, [str(pack), "--stage-slots", "0"])
    assert "--stage-slots must be" in err, err
    err = refused(capsys, [str(pack), "--prefetch", "on"])
    assert err.startswith("expert-pack serve: error: --prefetch needs") and "--ram-cache-mib" in err, err


def test_stats_file_in_a_missing_folder(capsys, pack):
    err = refused(capsys, [str(pack), "--stats-file", "/nonexistent/dir/s.json"])
    assert "--stats-file /nonexistent/dir/s.json: no such directory /nonexistent/dir" in err, err


def test_pack_folder_alone_is_the_trunk_with_its_pack(pack):
    from ggml_expert_pack.server.main import Plan
    for argv in ([str(pack)], ["-m", str(pack)], ["-m", str(pack), "--expert-pack", str(pack)]):
        args = build_parser().parse_args(["serve", *argv])
        plan = Plan(args)
        assert plan.model == pack / "trunk.gguf" and plan.pack == pack and args.expert_pack == str(pack)
        assert plan.alias == "synthetic-qwen3moe"  # the model's general.name
    args = build_parser().parse_args(["serve", str(pack), "--alias", "mine"])
    assert Plan(args).alias == "mine"


def test_served_name_falls_back_to_the_pack_folder(tmp_path):
    from ggml_expert_pack.server.main import served_name
    header = SimpleNamespace(get=lambda k, d=None: d)  # no general.name
    assert served_name(tmp_path / "q.pack" / "trunk.gguf", tmp_path / "q.pack", header) == "q.pack"
    assert served_name(tmp_path / "q.gguf", None, header) == "q.gguf"


def test_gate_answers_503_while_loading():
    from ggml_expert_pack.server.main import Gate
    seen = []
    body = b"".join(Gate()({"PATH_INFO": "/health", "REQUEST_METHOD": "GET"}, lambda s, h, e=None: seen.append(s)))
    assert seen == ["503 Service Unavailable"]
    assert json.loads(body)["error"]["message"] == "Loading model"


def test_gate_503_carries_the_start_time_header():
    from ggml_expert_pack.server.main import Gate
    gate = Gate()
    seen = []
    b"".join(gate({"PATH_INFO": "/props", "REQUEST_METHOD": "GET"}, lambda s, h, e=None: seen.append(dict(h))))
    assert seen[0]["Process-Start-Time-Unix"] == str(gate.start_time)


# --- start-up and stop, in a subprocess -----------------------------------------------------------------------

def serve_cmd(*argv) -> list[str]:
    return [*expert_pack_argv(), "serve", *map(str, argv)]


def test_port_in_use_fails_before_loading(pack):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # --verbose: had the model started loading, llama.cpp's loader would have logged
        r = subprocess.run(serve_cmd(pack, "--port", port, "--verbose"), capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    assert r.returncode == 2, r
    err = r.stderr.strip()
    assert err == f"expert-pack serve: error: --port {port}: 127.0.0.1:{port} is already in use", err
    assert "llama_model_load" not in r.stdout + r.stderr and "loading" not in err


def test_pack_folder_served_under_general_name_logs_requests_and_stops_on_signals(pack, tmp_path):
    for sig in (signal.SIGINT, signal.SIGTERM):
        port = free_port()
        stats = tmp_path / f"stats-{sig.name}.json"
        log = open(tmp_path / f"serve-{sig.name}.log", "w+")
        proc = subprocess.Popen(serve_cmd(pack, "--port", port, "-c", 256, "-t", 2, "--stats-file", stats),
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        base = f"http://127.0.0.1:{port}"
        try:
            assert wait_healthy(base, proc, 120), log.seek(0) or log.read()
            with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
                assert [m["id"] for m in json.loads(r.read())["data"]] == ["synthetic-qwen3moe"]
            req = urllib.request.Request(base + "/v1/completions", data=json.dumps(
                {"model": "synthetic-qwen3moe", "prompt": "Hello", "max_tokens": 3}).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        finally:
            proc.send_signal(sig)
            code = proc.wait(60)
        log.seek(0)
        text = log.read()
        assert code == 0, text
        assert re.search(r"^request: POST /v1/completions 127\.0\.0\.1 200 [\d.]+ ms prompt_tokens=\d+ "
                         r"completion_tokens=3$", text, re.M), text
        assert re.search(r"^request: GET /v1/models 127\.0\.0\.1 200 [\d.]+ ms$", text, re.M), text
        assert f"{sig.name}: stopped" in text and "Traceback" not in text, text
        # one line at start says how the cache was sized and the batch chosen for prompts
        assert re.search(r"^expert-pack serve: expert pack: \d+ of 16 experts cached per MoE layer, .*; "
                         r"n_batch 256, n_ubatch 256$", text, re.M), text
        # nothing lost: the final counters were written when the model was freed (the periodic flush is every 64
        # steps; this generation took fewer)
        assert json.loads(stats.read_text())["steps"] > 0
