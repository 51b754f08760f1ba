"""The fork's own llama.cpp tools take --expert-pack: llama-server answers completions from a trunk +
pack exactly as stock llama-server does from the original GGUF; llama-bench and llama-cli run with a pack; bad
flags and a wrong pack fail with a clear message."""
from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from expert_pack_devtools.bench_client import free_port, pack_counters, wait_healthy
from expert_pack_devtools.lossless import cache_mib_for_slots
from ggml_expert_pack.tools import tool_path

try:
    SERVER = tool_path("llama-server")
except FileNotFoundError as e:  # a build without EXPERT_PACK_BUILD_TOOLS
    pytest.skip(str(e), allow_module_level=True)

N_CTX = 256
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"



class LlamaServer:
    def __init__(self, args: list[str], log_path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        cmd = [str(SERVER), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(N_CTX), "-t", "2",
               "-np", "1", "--no-webui", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_healthy(self.base, self.proc, 120):
            self.stop()
            pytest.fail(f"llama-server did not start:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def completion(self, **body) -> dict:
        req = urllib.request.Request(self.base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _complete(server: LlamaServer) -> dict:
    return server.completion(prompt=PROMPT, n_predict=24, temperature=0, ignore_eos=True, cache_prompt=False,
                             n_probs=0, seed=1)


def _get(server: LlamaServer, path: str):
    with urllib.request.urlopen(server.base + path, timeout=60) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def _series(text: str, prefix: str = "expert_pack_") -> dict[str, float]:
    """/metrics' samples whose names start with `prefix`: {name with its labels: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _shape(text: str) -> list[str]:
    """The expert_pack_* part of a /metrics text without its values: HELP and TYPE lines, sample names and labels."""
    return [line if line.startswith("#") else line.rpartition(" ")[0] for line in text.splitlines()
            if line.startswith(("expert_pack_", "# HELP expert_pack_", "# TYPE expert_pack_"))]


@pytest.fixture(scope="module")
def stock_completion(tmp_path_factory):
    """stock_completion(src): the reference, stock llama-server (the fork without --expert-pack) on the original GGUF,
    started once per model for the module (the request is the same greedy one each time)."""
    cache: dict = {}

    def get(src) -> dict:
        if src not in cache:
            stock = LlamaServer(["-m", str(src)], tmp_path_factory.mktemp("stock") / "stock.log")
            try:
                cache[src] = _complete(stock)
            finally:
                stock.stop()
        return cache[src]
    return get


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_llama_server_with_pack_answers_like_stock(packs, stock_completion, tmp_path, arch):
    src, pack = packs(arch)
    want = stock_completion(src)
    stats = tmp_path / "stats.json"
    # the smallest cache that holds one token's experts (top-4 of the tiny models): every step evicts
    ours = LlamaServer(["-m", str(pack / "trunk.gguf"), "--expert-pack", str(pack),
                        "--expert-cache-mib", f"{cache_mib_for_slots(pack, 4)}", "--expert-cache-reserve-mib", "0",
                        "--expert-stats-file", str(stats), "--metrics"], tmp_path / "ours.log")
    try:
        got = _complete(ours)
        again = _complete(ours)
        m = pack_counters(ours.base)
        text = _get(ours, "/metrics")
    finally:
        ours.stop()
    assert got["content"] == want["content"] and len(got["content"]) > 0
    assert again["content"] == want["content"]
    assert got["timings"]["predicted_n"] == 24
    s = json.loads(stats.read_text())
    assert s["cache_misses"] > 0 and s["cache_evictions"] > 0 and s["io_errors"] == 0
    assert s["pack_read_bytes"] > 0
    # one line at the default log level says how the cache was sized
    assert re.search(r"expert pack: 4 of 16 experts cached per MoE layer, 0 of \d+ MoE layers resident; CPU: ",
                     ours.output())
    # with the default -b/-ub, the batch is sized for whole prompts (here the whole context)
    assert f"expert pack: n_batch = n_ubatch = {N_CTX}" in ours.output()
    # llama-server's /metrics carries the provider's counters, under the names of expert-pack's own server
    # (expert_pack_cache_misses_total, ...: pack_counters reads them as bench-client does)
    assert m["cache_misses"] > 0 and m["pack_read_bytes"] > 0
    assert m["io_errors"] == 0 and 0 <= m["hit_ratio"] <= 1
    # each device's cache under serve's names and labels: on the CPU one device, whose counters are the totals
    series = _series(text)
    for k in ("cache_hits", "cache_misses", "cache_evictions", "h2d_bytes"):
        assert series[f'expert_pack_device_{k}_total{{device="CPU"}}'] == series[f"expert_pack_{k}_total"], k
    assert series['expert_pack_device_slots_per_layer{device="CPU"}'] == 4
    assert series['expert_pack_device_cache_bytes{device="CPU"}'] > 0
    # the same families (HELP, TYPE) and series as expert-pack serve renders from the same stats
    from types import SimpleNamespace
    from ggml_expert_pack.server.api import metrics_text
    engine = SimpleNamespace(totals=SimpleNamespace(prompt_tokens=0, prompt_seconds=0.0, predicted_tokens=0,
                                                    predicted_seconds=0.0, requests=0, cancelled=0),
                             busy=False, lane=SimpleNamespace(waiting=0))
    assert _shape(text) == _shape(metrics_text(engine, s))


def test_llama_server_with_prefetch_answers_like_stock(packs, stock_completion, tmp_path):
    """--expert-ram-cache-mib with --expert-prefetch on: same text as stock, and the prefetch counters on /metrics."""
    from expert_pack_devtools.lossless import ram_mib_for_blocks
    src, pack = packs("qwen3moe")
    want = stock_completion(src)
    ours = LlamaServer(["-m", str(pack / "trunk.gguf"), "--expert-pack", str(pack),
                        "--expert-cache-mib", f"{cache_mib_for_slots(pack, 4)}", "--expert-cache-reserve-mib", "0",
                        "--expert-ram-cache-mib", f"{ram_mib_for_blocks(pack, 12)}", "--expert-prefetch", "on",
                        "--expert-ram-tier-mode", "inclusive", "--metrics"], tmp_path / "ours.log")
    try:
        got = _complete(ours)
        m = pack_counters(ours.base)
    finally:
        ours.stop()
    assert got["content"] == want["content"] and len(got["content"]) > 0
    assert m["prefetch_issued"] > 0 and m["predicted"] > 0
    assert m["io_errors"] == 0
    for k in ("acquire_seconds", "read_seconds", "copy_wait_seconds", "prefetch_wait_seconds"):  # the step profile
        assert m[k] >= 0, k


def test_llama_server_metrics_while_sleeping(packs, tmp_path):
    """--sleep-idle-seconds frees the model and its pack when idle: /metrics then answers the snapshot taken before
    the sleep, expert_pack_* included (llama.cpp's test_sleep.py compares the two scrapes), without waking the
    server; after the wake (a new provider) the counters go on from the snapshot's values."""
    src, pack = packs("qwen3moe")
    ours = LlamaServer(["-m", str(pack / "trunk.gguf"), "--expert-pack", str(pack),
                        "--expert-cache-mib", f"{cache_mib_for_slots(pack, 4)}", "--expert-cache-reserve-mib", "0",
                        "--metrics", "--sleep-idle-seconds", "1"], tmp_path / "ours.log")
    try:
        first = _complete(ours)
        _get(ours, "/metrics")  # the first scrape resets llama-server's throughput window, as in test_sleep.py
        awake = _get(ours, "/metrics")
        for _ in range(600):  # until the server says it sleeps (its idle timer is 1 s)
            if _get(ours, "/props")["is_sleeping"]:
                break
            time.sleep(0.1)
        assert _get(ours, "/props")["is_sleeping"], ours.output()[-3000:]
        asleep = _get(ours, "/metrics")
        still_asleep = _get(ours, "/props")["is_sleeping"]
        again = _complete(ours)  # wakes it: the model and a new provider load
        woken = _get(ours, "/metrics")
    finally:
        ours.stop()
    assert "server is entering sleeping state" in ours.output()
    assert asleep == awake
    assert still_asleep
    a, b = _series(awake), _series(woken)
    assert a["expert_pack_cache_misses_total"] > 0 and a['expert_pack_device_cache_misses_total{device="CPU"}'] > 0
    assert set(a) == set(b)
    assert again["content"] == first["content"]
    for name, v in a.items():  # counters carry on from the snapshot's values
        if name.endswith("_total") or "_total{" in name:
            assert b[name] >= v, name
    # the new provider's cache started empty: its misses add to the earlier ones
    assert b["expert_pack_cache_misses_total"] > a["expert_pack_cache_misses_total"]
    assert b['expert_pack_device_cache_misses_total{device="CPU"}'] == b["expert_pack_cache_misses_total"]
    assert b["expert_pack_steps_total"] > a["expert_pack_steps_total"]
    assert 0 <= b["expert_pack_hit_ratio"] <= 1


def test_llama_server_refuses_a_bad_pack(packs, tmp_path):
    src, pack = packs("qwen3moe")
    other_src, other_pack = packs("qwen3moe", seed=7)
    for args, needle in [
        (["-m", str(pack / "trunk.gguf"), "--expert-pack", str(tmp_path / "nowhere")], "nowhere"),
        (["-m", str(pack / "trunk.gguf"), "--expert-pack", str(other_pack)], "pack"),
        (["-m", str(pack / "trunk.gguf")], "add --expert-pack PACK_DIR"),
        (["-m", str(src), "--expert-pack", str(pack), "--expert-cache-mib", "-5"], "--expert-cache-mib"),
        (["-m", str(src), "--expert-pack", str(pack), "--expert-ram-cache-mib", "lots"], "must be a size in MiB"),
        (["-m", str(src), "--expert-pack", str(pack), "--expert-stats-file", str(tmp_path / "no" / "s.json")],
         "--expert-stats-file"),
        (["-m", str(src), "--expert-pack", str(pack), "--expert-direct-io", "maybe"], "expert-direct-io"),
        (["-m", str(src), "--expert-pack", str(pack), "--expert-prefetch", "on"], "needs the host-RAM tier"),
        (["-m", str(src), "--expert-pack", str(pack), "--expert-ram-tier-mode", "lru"], "expert-ram-tier-mode"),
        (["-m", str(pack / "trunk.gguf"), "--expert-pack", str(pack), "--split-mode", "row"],
         "expert pack: --split-mode row is not supported with an expert pack; use --split-mode layer"),
    ]:
        r = subprocess.run([str(SERVER), "--port", str(free_port()), "-c", str(N_CTX), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, args
        assert needle in r.stdout + r.stderr, (args, (r.stdout + r.stderr)[-2000:])


def test_llama_bench_with_pack(packs, tmp_path):
    src, pack = packs("qwen3moe")
    stats = tmp_path / "stats.json"
    r = subprocess.run([str(tool_path("llama-bench")), "-m", str(pack / "trunk.gguf"), "--expert-pack", str(pack),
                        "--expert-cache-mib", f"{cache_mib_for_slots(pack, 4)}", "--expert-cache-reserve-mib", "0",
                        "--expert-stats-file", str(stats),
                        "-p", "16", "-n", "4", "-r", "1", "-t", "2", "-o", "json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert {row["n_prompt"] for row in rows} == {16, 0} and all(row["avg_ts"] > 0 for row in rows)
    assert json.loads(stats.read_text())["cache_misses"] > 0
    # the row split is refused with a pack, in one line, before any test runs
    r = subprocess.run([str(tool_path("llama-bench")), "-m", str(pack / "trunk.gguf"), "--expert-pack", str(pack),
                        "-sm", "layer,row", "-p", "16", "-n", "4", "-r", "1", "-t", "2", "-o", "json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and not r.stdout.strip().strip("[]")
    assert r.stderr.strip().splitlines()[-1] == ("llama_bench: error: expert pack: --split-mode row is not "
                                                 "supported with an expert pack; use --split-mode layer")


def _cli_reply(model, *extra) -> str:
    r = subprocess.run([str(tool_path("llama-cli")), "-m", str(model), *extra, "-p", "Hello there", "-n", "12",
                        "-st", "--temp", "0", "-c", str(N_CTX), "-t", "2"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    # the single turn's reply: after the echoed prompt, before the speed line
    reply = r.stdout.split("> Hello there", 1)[1].split("[ Prompt:", 1)[0].strip()
    assert reply
    return reply


def test_llama_cli_with_pack(packs):
    src, pack = packs("qwen3moe")
    r = subprocess.run([str(tool_path("llama-cli")), "--help"], capture_output=True, text=True, timeout=60)
    assert "--expert-pack" in r.stdout + r.stderr and "--expert-cache-mib" in r.stdout + r.stderr
    ours = _cli_reply(pack / "trunk.gguf", "--expert-pack", str(pack), "--expert-cache-mib",
                      f"{cache_mib_for_slots(pack, 4)}", "--expert-cache-reserve-mib", "0")
    assert ours == _cli_reply(src)
