"""`expert-pack serve --parallel N`: N slots generate together in one batch. Concurrent requests all complete with
the text they get alone (greedy), run in different slots, honour their own limits and stop strings; a waiting request
gets a slot when one frees; a client that goes away frees its slot; /slots, /props and /metrics report the slots;
a prompt longer than a slot's context is refused. Shapes and behaviour only, never timing."""
from __future__ import annotations

import http.client
import json
import subprocess
import threading
import urllib.error
import urllib.request

import pytest

N_CTX, SLOTS = 1024, 2


@pytest.fixture(scope="module")
def srv(packs, start_serve):
    with start_serve(packs("qwen3moe")[1], ["-c", N_CTX, "-t", 2, "--parallel", SLOTS, "--slots", "--metrics"],
                     name="parallel") as s:
        yield s.base


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(base, path):
    with urllib.request.urlopen(base + path, timeout=60) as r:
        return r.read().decode()


def concurrently(base, bodies, path="/completion"):
    out = [None] * len(bodies)

    def go(i):
        out[i] = post(base, path, bodies[i])
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def greedy(prompt, n=12, **kw):
    return {"prompt": prompt, "n_predict": n, "temperature": 0, **kw}


def test_concurrent_requests_get_the_text_they_get_alone(srv):
    prompts = ["The expert pack", "Streams experts from disk", "The expert pack", "A third prompt, longer than both"]
    alone = {p: post(srv, "/completion", greedy(p))[1]["content"] for p in set(prompts)}
    got = concurrently(srv, [greedy(p) for p in prompts])  # four requests, two slots: two wait for a free one
    for p, (status, r) in zip(prompts, got):
        assert status == 200, r
        assert r["content"] == alone[p]
        assert r["tokens_predicted"] == 12 and r["stop_type"] == "limit"
        assert 0 <= r["id_slot"] < SLOTS
    assert {r["id_slot"] for _, r in got} == set(range(SLOTS))


def test_each_request_keeps_its_own_limits_stop_strings_and_sampler(srv):
    full = post(srv, "/completion", greedy("The expert pack", 24))[1]["content"]
    stop = full[6:9]
    bodies = [greedy("The expert pack", 24, stop=[stop]), greedy("The expert pack", 5),
              {"prompt": "The expert pack", "n_predict": 8, "temperature": 0.9, "seed": 3},
              greedy("The expert pack", 0)]
    (s1, a), (s2, b), (s3, c), (s4, d) = concurrently(srv, bodies)
    assert (s1, s2, s3, s4) == (200, 200, 200, 200)
    assert a["content"] == full[:full.index(stop)] and a["stop_type"] == "word" and a["stopping_word"] == stop
    assert b["tokens_predicted"] == 5 and b["stop_type"] == "limit"
    assert c["tokens_predicted"] == 8
    # alone, a seed gives the same text again (in a shared batch the other rows can round its logits differently)
    assert post(srv, "/completion", bodies[2])[1]["content"] == post(srv, "/completion", bodies[2])[1]["content"]
    assert d["content"] == "" and d["tokens_predicted"] == 0


def test_streamed_and_chat_requests_in_slots(srv):
    conn = http.client.HTTPConnection(srv.split("//")[1], timeout=120)
    conn.request("POST", "/completion", json.dumps(greedy("The expert pack", 8, stream=True)),
                 {"Content-Type": "application/json"})
    events = [json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 8
    assert "".join(e["content"] for e in events) == post(srv, "/completion", greedy("The expert pack", 8))[1]["content"]
    status, r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert status == 200 and r["usage"]["completion_tokens"] == 4


def test_a_client_that_goes_away_frees_its_slot(srv):
    for _ in range(SLOTS + 1):  # more abandoned streams than slots: each must have freed its slot
        conn = http.client.HTTPConnection(srv.split("//")[1], timeout=60)
        conn.request("POST", "/completion", json.dumps(greedy("The expert pack", 400, stream=True, ignore_eos=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.fp.readline()  # the first event: it is generating
        conn.close()
    status, r = post(srv, "/completion", greedy("The expert pack", 4))
    assert status == 200 and r["tokens_predicted"] == 4
    assert idle(srv), json.loads(get(srv, "/slots"))  # every abandoned generation ends and frees its slot


def idle(base, wait_s: float = 120) -> bool:
    """Whether every slot is idle, waiting up to wait_s for generations whose client went away (the server sees a
    closed connection when it next writes or polls it)."""
    import time
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not any(s["is_processing"] for s in json.loads(get(base, "/slots"))):
            return True
        time.sleep(0.2)
    return False


def test_slots_props_and_metrics_report_the_slots(srv):
    assert idle(srv)
    slots = json.loads(get(srv, "/slots"))
    assert [s["id"] for s in slots] == list(range(SLOTS))
    assert all(s["n_ctx"] == N_CTX // SLOTS for s in slots)
    assert json.loads(get(srv, "/props"))["total_slots"] == SLOTS
    assert "llamacpp:requests_processing 0" in get(srv, "/metrics")


def test_a_prompt_longer_than_a_slot_is_refused(srv):
    status, r = post(srv, "/completion", {"prompt": [1] * (N_CTX // SLOTS + 1), "n_predict": 1})
    assert status == 400 and "context" in r["error"]["message"]


def test_embedding_with_parallel_is_refused_in_one_line(packs):
    from expert_pack_devtools.proc import expert_pack_argv
    p = subprocess.run([*expert_pack_argv(), "serve", str(packs("qwen3moe")[1]), "--parallel", "2", "--embedding"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines() == ["expert-pack serve: error: --embedding with --parallel > 1 is not "
                                             "supported: serve embeddings with --parallel 1"]
