"""The HTTP server over real loopback HTTP: `expert-pack serve` in a subprocess with a tiny model and its pack,
spoken to by the official openai client, plain HTTP, a Prometheus parser and headless Chromium."""
from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from expert_pack_devtools.bench_client import free_port
from ggml_expert_pack.packer import build

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
N_CTX = 512
LOG: dict[str, Path] = {}  # the module server's log, for the tests that read it


@pytest.fixture(scope="module")
def server(synth_model, tmp_path_factory, start_serve):
    model = synth_model("qwen3moe")
    pack = tmp_path_factory.mktemp("srv") / "pack"
    build(model, pack, progress=False)
    args = ["-m", pack / "trunk.gguf", "--expert-pack", pack, "-c", N_CTX, "--alias", "tiny-moe", "-t", 2,
            "--stats-file", pack.parent / "stats.json", "--ram-cache-mib", 64]
    with start_serve(None, args, name="srv") as s:
        LOG["path"] = s.log
        yield s.base


def post(base, path, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(base, path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return r.read().decode()


def client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


# --- OpenAI client ------------------------------------------------------------------------------------------

def test_openai_models(server):
    ids = [m.id for m in client(server).models.list()]
    assert ids == ["tiny-moe"]


def test_openai_chat_streamed_equals_unstreamed(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Tell me about experts."}]
    r = c.chat.completions.create(model="tiny-moe", messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.choices[0].finish_reason == "length"
    parts, usage = [], None
    for ch in c.chat.completions.create(model="tiny-moe", messages=msgs, max_tokens=12, temperature=0,
                                        stream=True):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        usage = ch.usage or usage
    assert len(parts) > 1
    assert "".join(parts) == r.choices[0].message.content
    assert usage.completion_tokens == 12


def test_openai_completions(server):
    c = client(server)
    r = c.completions.create(model="tiny-moe", prompt="The capital of France is", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 10
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-moe", prompt="The capital of France is", max_tokens=10, temperature=0, stream=True))
    assert text == r.choices[0].text


def test_openai_unknown_model_is_served_by_the_loaded_one(server):
    # llama-server serves any model name a request gives with the model it has loaded (no 404)
    r = client(server).completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert r.model == "tiny-moe" and r.usage.completion_tokens == 1


# --- llama-server's /completion -----------------------------------------------------------------------------

TIMING_KEYS = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


def test_completion_with_timings(server):
    status, r = post(server, "/completion", {"prompt": "Hello world", "n_predict": 20, "ignore_eos": True,
                                              "temperature": 0})
    assert status == 200
    assert set(r["timings"]) >= TIMING_KEYS
    t = r["timings"]
    assert t["predicted_n"] == 20 == r["tokens_predicted"]
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] == pytest.approx(1e3 * 20 / t["predicted_ms"])
    assert t["prompt_n"] >= 1 and r["stopped_limit"] and not r["stopped_eos"]
    assert r["content"]


def test_completion_stream_ends_with_timings(server):
    req = urllib.request.Request(server + "/completion", data=json.dumps(
        {"prompt": "Hello world", "n_predict": 8, "ignore_eos": True, "temperature": 0, "stream": True}).encode())
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"]
    assert events[-1]["timings"]["predicted_n"] == 8
    _, whole = post(server, "/completion", {"prompt": "Hello world", "n_predict": 8, "ignore_eos": True,
                                            "temperature": 0})
    assert "".join(e["content"] for e in events) == whole["content"]


def test_tokenize_detokenize_health_props(server):
    _, t = post(server, "/tokenize", {"content": "Hello world"})
    assert t["tokens"] and all(isinstance(x, int) for x in t["tokens"])
    _, d = post(server, "/detokenize", {"tokens": t["tokens"]})
    assert d["content"] == "Hello world"
    assert json.loads(get(server, "/health"))["status"] == "ok"
    props = json.loads(get(server, "/props"))
    assert props["default_generation_settings"]["n_ctx"] == N_CTX and props["expert_pack"] is True


def test_serve_cache_flags_reach_the_pack_config(tmp_path):
    from ggml_expert_pack.cli import build_parser
    from ggml_expert_pack.server.main import pack_config
    ap = build_parser()
    args = ap.parse_args(["serve", "-m", "m.gguf", "--expert-pack", str(tmp_path), "--ram-cache-mib", "512",
                          "--read-threads", "3", "--cache-mib", "64"])
    assert pack_config(args) == {"pack_dir": str(tmp_path), "ram_cache_mib": 512.0, "read_threads": 3,
                                 "cache_vram_mib": 64.0}
    for flag in ("--ram-cache-mib", "--read-threads"):
        with pytest.raises(ValueError, match=f"{flag} needs --expert-pack"):
            pack_config(ap.parse_args(["serve", "-m", "m.gguf", flag, "2"]))
    # the fork's spellings, prefetch and the tier's mode
    args = ap.parse_args(["serve", "-m", "m.gguf", "--expert-pack", str(tmp_path), "--expert-ram-cache-mib", "64",
                          "--expert-prefetch", "on", "--ram-tier-mode", "inclusive"])
    assert pack_config(args) == {"pack_dir": str(tmp_path), "ram_cache_mib": 64.0, "prefetch": True,
                                 "ram_tier_mode": "inclusive"}
    for flag, value in (("--prefetch", "on"), ("--ram-tier-mode", "victim")):
        with pytest.raises(ValueError, match=f"{flag} needs --expert-pack"):
            pack_config(ap.parse_args(["serve", "-m", "m.gguf", flag, value]))


def test_metrics_parse(server):
    from prometheus_client.parser import text_string_to_metric_families
    post(server, "/completion", {"prompt": "metrics", "n_predict": 4, "ignore_eos": True})
    fams = {f.name: f for f in text_string_to_metric_families(get(server, "/metrics"))}
    value = {f.name: f.samples[0].value for f in fams.values()}
    for k in ("cache_hits", "cache_misses", "cache_evictions", "pack_read_bytes", "h2d_bytes", "fallback_count",
              "io_errors"):
        assert f"expert_pack_{k}" in fams, k
        assert fams[f"expert_pack_{k}"].type == "counter"
    assert value["expert_pack_pack_read_bytes"] > 0
    for k in ("ram_hits", "ram_misses", "ram_evictions"):
        assert fams[f"expert_pack_{k}"].type == "counter", k
    for k in ("ram_blocks", "ram_bytes"):
        assert fams[f"expert_pack_{k}"].type == "gauge", k
    for k in ("acquire", "read", "copy_wait", "prefetch_wait"):  # the step profile, from the stats file's timings
        assert fams[f"expert_pack_{k}_seconds"].type == "counter", k
    # the default cache holds every expert here: preloaded (its reads are bytes, not misses), so every step hits and
    # the RAM tier is not even allocated
    assert value["expert_pack_cache_hits"] > 0
    assert value["expert_pack_ram_misses"] == value["expert_pack_cache_misses"] == 0
    assert value["expert_pack_ram_blocks"] == value["expert_pack_ram_hits"] == 0
    assert value["llamacpp:tokens_predicted"] >= 4
    assert value["llamacpp:predicted_tokens_seconds"] > 0  # tok/s


# --- bad input -----------------------------------------------------------------------------------------------

MALFORMED = [
    ("/v1/completions", None, b"{not json", 400),
    ("/v1/completions", {"prompt": 42, "max_tokens": 4}, None, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, None, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, None, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 9}, None, 400),
    ("/v1/completions", {"prompt": "word " * (2 * N_CTX), "max_tokens": 4}, None, 400),
    ("/v1/chat/completions", {"model": 5, "messages": [{"role": "user", "content": "x"}]}, None, 400),
    ("/v1/chat/completions", {"messages": "hello"}, None, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, None, 400),
    ("/completion", {"prompt": "x", "n_predict": 4, "stream": "yes"}, None, 400),
    ("/detokenize", {"tokens": [-5, 10 ** 12]}, None, 400),
]


@pytest.mark.parametrize("path,body,raw,status", MALFORMED, ids=[f"{i}" for i in range(len(MALFORMED))])
def test_malformed_request_then_a_good_one(server, path, body, raw, status):
    got, r = post(server, path, body, raw)
    assert got == status, r
    err = r["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    got, ok = post(server, "/v1/completions", {"prompt": "still alive?", "max_tokens": 2})
    assert got == 200 and ok["usage"]["completion_tokens"] == 2


def raw_post(base, path, raw: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=raw, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


JSON = {"Content-Type": "application/json"}
BAD_BODIES = [  # (path, raw body, headers, status, words in the message)
    ("/v1/completions", b"[" * 100_000, JSON, 400, "nests too deeply"),
    ("/completion", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, JSON, 400, "nests too deeply"),
    ("/completion", b'{"prompt": "\\ud800"}', JSON, 400, "'prompt' holds an unpaired UTF-16 surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', JSON, 400,
     "'messages[0].content' holds an unpaired UTF-16 surrogate"),
    ("/tokenize", b'{"content": "\\ud83d\\ude00", "x\\ud800": 1}', JSON, 400, "unpaired UTF-16 surrogate"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', JSON, 400, "not valid UTF-8: byte 0xff at offset 12"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1}', {"Content-Type": "text/plain"}, 415,
     "Content-Type 'text/plain' is not JSON"),
    ("/tokenize", b"\x89PNG\r\n\x1a\n", {"Content-Type": "image/png"}, 415, "'image/png' is not JSON"),
    ("/tokenize", b'{"content": "x"}', {"Content-Type": "multipart/form-data; boundary=x"}, 415, "is not JSON"),
    ("/tokenize", b'{"content": "x"}', {"Content-Type": "application/json; charset=latin-1"}, 415, "must be UTF-8"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', JSON, 400, "NaN is not a JSON value"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", JSON, 400, "not valid JSON"),
]


@pytest.mark.parametrize("path,raw,headers,status,words", BAD_BODIES, ids=[
    "deep-array", "deep-object", "surrogate", "surrogate-in-messages", "surrogate-in-key", "not-utf8", "text-plain",
    "image-png", "multipart", "latin1", "nan", "huge-int"])
def test_bad_body_is_a_4xx_and_the_server_stays_healthy(server, path, raw, headers, status, words):
    got, r = raw_post(server, path, raw, headers)
    assert got == status, r
    err = r["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err
    if status == 415:
        assert err["code"] == "unsupported_media_type"
    assert json.loads(get(server, "/health"))["status"] == "ok"


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8",
                                   "Application/JSON;charset=UTF-8", None, "application/x-www-form-urlencoded"])
def test_json_content_types_accepted(server, ctype):
    # no Content-Type counts as JSON, as llama-server takes it; form-urlencoded is what `curl -d` and urllib send
    # by default, so the common `curl URL -d '{...}'` works too
    import http.client
    host, port = server.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("POST", "/tokenize", b'{"content": "Hello"}', {} if ctype is None else {"Content-Type": ctype})
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["tokens"]
    c.close()


def logged(pattern: str) -> str:
    """The server's log once a line matches `pattern` (the line is written as the response closes, which can be
    just after the client has it)."""
    deadline = time.monotonic() + 30
    while True:
        text = LOG["path"].read_text()
        if re.search(pattern, text, re.M) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_request_log_lines(server):
    status, r = post(server, "/v1/completions", {"prompt": "log me", "max_tokens": 2})
    assert status == 200
    n_prompt = r["usage"]["prompt_tokens"]
    post(server, "/v2/nothing", {})
    line = rf"^request: POST /v1/completions 127\.0\.0\.1 200 [\d.]+ ms prompt_tokens={n_prompt} completion_tokens=2$"
    text = logged(line)
    assert re.search(line, text, re.M), text[-3000:]
    line = r"^request: POST /v2/nothing 127\.0\.0\.1 404 [\d.]+ ms$"
    text = logged(line)
    assert re.search(line, text, re.M), text[-3000:]
    assert "request: GET /health" not in text  # polled: not logged when healthy


def test_unknown_endpoint_and_method(server):
    got, r = post(server, "/v2/nothing", {})
    assert got == 404 and r["error"]["message"]
    req = urllib.request.Request(server + "/completion")  # GET
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405


# --- concurrency and cancellation ----------------------------------------------------------------------------

def test_four_concurrent_clients(server):
    prompts = [f"Client number {i} says" for i in range(4)]
    body = lambda p: {"prompt": p, "n_predict": 24, "ignore_eos": True, "temperature": 0}  # noqa: E731
    expected = [post(server, "/completion", body(p))[1]["content"] for p in prompts]
    got: dict[int, str] = {}
    errors: list = []

    def worker(i):
        try:
            status, r = post(server, "/completion", body(prompts[i]))
            assert status == 200
            got[i] = r["content"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert [got[i] for i in range(4)] == expected


def _metric(server, name):
    from prometheus_client.parser import text_string_to_metric_families
    for f in text_string_to_metric_families(get(server, "/metrics")):
        if f.name == name:
            return f.samples[0].value
    raise KeyError(name)


def test_disconnect_stops_generation(server):
    cancelled0 = _metric(server, "llamacpp:n_requests_cancelled")
    predicted0 = _metric(server, "llamacpp:tokens_predicted")
    n_predict = N_CTX - 16
    body = json.dumps({"prompt": "A long story:", "n_predict": n_predict, "ignore_eos": True, "stream": True})
    host, port = server.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    seen = b""
    while b"data: " not in seen:  # wait until streaming has begun
        chunk = s.recv(4096)
        assert chunk, "connection closed before any token"
        seen += chunk
    s.close()
    t_close = time.perf_counter()
    while _metric(server, "llamacpp:n_requests_cancelled") == cancelled0:
        assert time.perf_counter() - t_close < 30, "generation was not stopped"
        time.sleep(0.01)
    freed_s = time.perf_counter() - t_close
    assert _metric(server, "llamacpp:requests_processing") == 0
    assert _metric(server, "llamacpp:tokens_predicted") - predicted0 < n_predict  # it stopped early
    got, ok = post(server, "/v1/completions", {"prompt": "next", "max_tokens": 2})
    assert got == 200
    print(f"\nserver freed {freed_s * 1e3:.0f} ms after the client closed")


def test_disconnect_from_a_non_streamed_request_leaves_no_traceback(server):
    cancelled0 = _metric(server, "llamacpp:n_requests_cancelled")
    body = json.dumps({"prompt": "A long story:", "n_predict": N_CTX - 16, "ignore_eos": True})
    host, port = server.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    t0 = time.perf_counter()
    while _metric(server, "llamacpp:requests_processing") == 0:  # the generation has started
        assert time.perf_counter() - t0 < 60, "the generation never started"
        time.sleep(0.01)
    s.close()
    while _metric(server, "llamacpp:n_requests_cancelled") == cancelled0:
        assert time.perf_counter() - t0 < 60, "generation was not stopped"
        time.sleep(0.01)
    got, ok = post(server, "/v1/completions", {"prompt": "next", "max_tokens": 2})
    assert got == 200
    line = r"^request: POST /completion 127\.0\.0\.1 499 [\d.]+ ms prompt_tokens=\d+ completion_tokens=\d+ " \
           r"\(client disconnected\)$"
    text = logged(line)
    assert re.search(line, text, re.M), text[-3000:]
    assert "Traceback" not in text, text[-3000:]


# --- the chat page -------------------------------------------------------------------------------------------

def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def test_chat_page_streams_a_reply(server):
    playwright = pytest.importorskip("playwright.sync_api")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(server + "/")
        page.wait_for_function("document.getElementById('model').textContent === 'tiny-moe'")
        page.evaluate("window.updates = 0; new MutationObserver(() => window.updates++).observe("
                      "document.getElementById('log'), {subtree: true, childList: true, characterData: true})")
        page.fill("#input", "Hello, who are you?")
        page.keyboard.press("Enter")
        page.wait_for_selector(".msg.user")
        # the reply grows while it streams, then is marked done
        page.wait_for_function("document.querySelector('.msg.assistant') && "
                               "document.querySelector('.msg.assistant').textContent.length > 0")
        page.wait_for_selector(".msg.assistant[data-done='1']", timeout=60_000)
        reply = page.text_content(".msg.assistant")
        stats = page.text_content("#stats")
        updates = page.evaluate("window.updates")
        page.screenshot(path=str(ARTIFACTS / "chat-page.png"))
        browser.close()
    assert reply and "tok/s" in stats
    assert updates > 3, "the reply arrived in one piece, not streamed"
    assert page.url.startswith(server)
    assert (ARTIFACTS / "chat-page.png").stat().st_size > 1000


# --- the benchmark client against this server ---------------------------------------------------------------

def test_bench_client_reference_workload(server, tmp_path):
    from ggml_expert_pack.cli import main
    out = tmp_path / "bench"
    assert main(["bench-client", server, "--system", "ours", "--out", str(out), "--n-predict", "6"]) == 0
    rep = json.loads((out / "ours.json").read_text())
    assert rep["completed"] == 10 and [r["dataset"] for r in rep["results"]] == ["alpaca", "mmlu"] * 5
    assert all(r["predicted_n"] == 6 and r["error"] is None for r in rep["results"])
    for ds in ("alpaca", "mmlu", "all"):
        row = rep["summary"][ds]
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
        assert 0 <= row["hit_rate"] <= 1 and row["ssd_bytes_per_token"] >= 0
        # the decode phase apart from the prompt's (counters read again at the first streamed token)
        assert 0 <= row["decode_hit_rate"] <= 1
    # (how much falls in each phase is a race on this tiny model: it generates faster than /metrics answers)
    assert all(0 <= r["decode_read_bytes"] <= r["pack_read_bytes"] and r["decode_hits"] <= r["cache_hits"]
               for r in rep["results"])
    # a second system read from the same folder: the table divides by the baseline
    other = {**rep, "system": "other"}
    (out / "other.json").write_text(json.dumps(other))
    assert main(["bench-client", server, "--system", "ours", "--out", str(out), "--n-predict", "2",
                 "--baseline", "other"]) == 0
    table = (out / "table.md").read_text()
    assert "| ours | alpaca |" in table and "| other | mmlu |" in table and "÷ other" in table
    if (out / "rates.png").exists():
        assert (out / "rates.png").stat().st_size > 1000


def test_bench_client_budget_and_dead_server(tmp_path):
    from expert_pack_devtools.bench_client import run
    rep = run(f"http://127.0.0.1:{free_port()}", "dead", n_predict=4, budget_s=5, log=lambda m: None)
    assert rep.completed == 0 and all(r.error for r in rep.results) and rep.summary == {}
    rep = run("http://127.0.0.1:9", "none", budget_s=0, log=lambda m: None)
    assert rep.skipped == 10 and not rep.results


# --- llama-server's flags: request defaults, --api-key, --no-webui; /props and the start-time header ----------

KEY = "s3cret"


@pytest.fixture(scope="module")
def flagged(packs, start_serve):
    """A server started with llama-server's request-default and access flags."""
    args = ["-c", N_CTX, "-t", 2, "-n", 5, "--seed", 3, "--temp", 0, "--top-k", 7, "--top-p", 0.5, "--min-p", 0.1,
            "--repeat-penalty", 1.1, "--api-key", f"{KEY},other", "--metrics", "--no-webui", "--no-slots"]
    with start_serve(packs("qwen3moe")[1], args, name="flagged") as s:  # /health needs no key
        yield s.base


def call(base, path, body=None, headers=None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET (body None) or POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                  **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status, h = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, h = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw), h
    except ValueError:
        return status, {"text": raw.decode()}, h


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_key_is_required_but_on_health(flagged):
    want = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    for path, body in (("/completion", {"prompt": "x", "n_predict": 1}), ("/v1/models", None), ("/props", None),
                       ("/metrics", None), ("/tokenize", {"content": "x"}), ("/v2/nothing", None)):
        for headers in (None, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}, {"Authorization": KEY + "x"}):
            status, r, _ = call(flagged, path, body, headers)
            assert (status, r) == (401, want), (path, headers, status, r)
    assert call(flagged, "/health")[:2] == (200, {"status": "ok"})
    assert call(flagged, "/v1/health")[:2] == (200, {"status": "ok"})
    assert call(flagged, "/v1/models", headers=AUTH)[0] == 200
    assert call(flagged, "/v1/models", headers={"Authorization": "Bearer other"})[0] == 200  # a list of keys
    assert call(flagged, "/v1/models", headers={"X-Api-Key": KEY})[0] == 200
    assert call(flagged, "/v1/models", headers={"Authorization": KEY})[0] == 200  # "Bearer " is optional
    import openai
    assert [m.id for m in openai.OpenAI(base_url=flagged + "/v1", api_key=KEY, max_retries=0).models.list()]
    with pytest.raises(openai.AuthenticationError):
        client(flagged).models.list()


def test_n_predict_flag_is_the_default_length(flagged):
    status, r, _ = call(flagged, "/completion", {"prompt": "Hello world", "ignore_eos": True}, AUTH)
    assert status == 200 and r["tokens_predicted"] == 5 and r["stopped_limit"], r
    assert r["generation_settings"]["n_predict"] == 5
    status, r, _ = call(flagged, "/completion", {"prompt": "Hello world", "ignore_eos": True, "n_predict": 3}, AUTH)
    assert r["tokens_predicted"] == 3 and r["generation_settings"]["n_predict"] == 3  # the request's own wins
    status, r, _ = call(flagged, "/v1/completions", {"prompt": "Hello world"}, AUTH)
    assert status == 200 and r["usage"]["completion_tokens"] <= 5, r
    status, r, _ = call(flagged, "/v1/completions", {"prompt": "Hello world", "max_tokens": 2}, AUTH)
    assert r["usage"]["completion_tokens"] == 2
    status, r, _ = call(flagged, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, AUTH)
    assert status == 200 and r["usage"]["completion_tokens"] <= 5, r


def test_sampling_flags_are_the_request_defaults(flagged):
    status, r, _ = call(flagged, "/completion", {"prompt": "Hello world", "n_predict": 1}, AUTH)
    g = r["generation_settings"]
    assert (g["temperature"], g["top_k"], g["top_p"], g["min_p"], g["repeat_penalty"], g["seed"]) == \
        (0.0, 7, 0.5, 0.1, 1.1, 3), g
    status, r, _ = call(flagged, "/completion", {"prompt": "Hello world", "n_predict": 1, "temperature": 0.7,
                                                  "top_k": 2, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.0,
                                                  "seed": -1}, AUTH)
    g = r["generation_settings"]
    assert (g["temperature"], g["top_k"], g["top_p"], g["min_p"], g["repeat_penalty"], g["seed"]) == \
        (0.7, 2, 0.9, 0.0, 1.0, None), g  # the request's own win; seed -1 = random
    status, r, _ = call(flagged, "/props", headers=AUTH)
    assert r["default_generation_settings"]["params"] == {"n_predict": 5, "seed": 3, "temperature": 0.0,
                                                          "top_k": 7, "top_p": 0.5, "min_p": 0.1,
                                                          "repeat_penalty": 1.1}
    status, r, _ = call(flagged, "/completion", {"prompt": "x", "repeat_penalty": 0}, AUTH)
    assert status == 400 and "'repeat_penalty' must be > 0" in r["error"]["message"], r


def test_no_webui(flagged, server):
    assert call(flagged, "/")[0] == 404  # / is open, as llama-server's; without the page there is nothing
    with urllib.request.urlopen(server + "/", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")


def test_props_slots_and_the_start_time_header(server):
    status, props, h = call(server, "/props")
    assert props["total_slots"] == 1 and props["is_sleeping"] is False
    assert props["default_generation_settings"]["params"] == {"n_predict": -1, "seed": -1, "temperature": 0.8,
                                                              "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                                              "repeat_penalty": 1.0}  # llama-server's
    start = h["Process-Start-Time-Unix"]
    assert start.isdigit() and int(start) <= time.time()
    for path, body in (("/health", None), ("/metrics", None), ("/v2/nothing", None),
                       ("/completion", {"prompt": 5})):
        assert call(server, path, body)[2]["Process-Start-Time-Unix"] == start, path


def test_flagged_start_time_header_on_a_refusal(flagged):
    status, _, h = call(flagged, "/props")
    assert status == 401 and h["Process-Start-Time-Unix"].isdigit()


def test_no_slots_and_no_embedding_are_llama_servers_501(flagged, server):
    status, r, _ = call(flagged, "/slots", headers=AUTH)
    assert (status, r) == (501, {"error": {"code": 501, "message": "This server does not support slots endpoint. "
                                           "Start it with `--slots`", "type": "not_supported_error"}})
    want = {"error": {"code": 501, "message": "This server does not support embeddings. Start it with "
                                              "`--embeddings`", "type": "not_supported_error"}}
    for path in ("/v1/embeddings", "/embedding", "/embeddings"):
        status, r, _ = call(server, path, {"input": "hello"})
        assert (status, r) == (501, want), path
    status, r, _ = call(server, "/slots")  # on by default, as llama-server's
    assert status == 200 and [s["id"] for s in r] == [0]
