"""`expert-pack serve` against llama-server's request and response shapes: /apply-template, /slots, /tokenize with
pieces, prompts as token ids, mixed or several, /completion's fields against /v1/completions', logit_bias, grammars
and response_format, per-request seeds, embeddings (--embedding --pooling mean), the assistant prefill and
continue_final_message. One server (the tiny synthetic MoE and its pack) over loopback HTTP; shapes and status codes
only, never timing."""
from __future__ import annotations

import base64
import json
import struct
import urllib.error
import urllib.request

import pytest

N_CTX = 512


@pytest.fixture(scope="module")
def srv(packs, start_serve):
    args = ["-c", N_CTX, "-t", 2, "--alias", "tiny-moe", "--embedding", "--pooling", "mean"]
    with start_serve(packs("qwen3moe")[1], args, name="compat") as s:
        yield s.base
    assert "Traceback" not in s.log.read_text()


def call(base, path, body=None):
    """(status, JSON) of a POST (a GET when body is None); every answer must be JSON, errors one line."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    if status >= 400:
        assert b"\n" not in raw.strip(), raw
    return status, json.loads(raw)


def events(base, path, body) -> list[dict]:
    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def is_error(r: dict, kind="invalid_request_error") -> bool:
    return isinstance(r.get("error"), dict) and r["error"]["type"] == kind and bool(r["error"]["message"])


GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "What is the best book"}]


# --- /apply-template and the assistant prefill ------------------------------------------------------------------

def test_apply_template(srv):
    status, r = call(srv, "/apply-template", {"messages": USER})
    assert status == 200 and set(r) == {"prompt"}
    assert r["prompt"].endswith("<|im_start|>user\nWhat is the best book<|im_end|>\n<|im_start|>assistant\n")
    status, r = call(srv, "/apply-template", {"messages": USER, "add_generation_prompt": False})
    assert status == 200 and r["prompt"].endswith("What is the best book<|im_end|>\n")


def test_assistant_prefill_and_continue_final_message(srv):
    msgs = USER + [{"role": "assistant", "content": "Whill"}]
    want = "<|im_start|>user\nWhat is the best book<|im_end|>\n<|im_start|>assistant\nWhill"
    status, r = call(srv, "/apply-template", {"messages": msgs})  # a trailing assistant message is continued
    assert status == 200 and r["prompt"].endswith(want), r
    status, r2 = call(srv, "/apply-template", {"messages": msgs, "continue_final_message": True,
                                               "add_generation_prompt": False})
    assert status == 200 and r2 == r  # the explicit spelling, the same prompt
    status, r = call(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **GREEDY})
    assert status == 200 and r["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body,words", [
    ({"messages": USER + [{"role": "assistant", "content": "Hello"}], "continue_final_message": True,
      "add_generation_prompt": True}, "Cannot set both add_generation_prompt and continue_final_message to true."),
    ({"messages": USER + [{"role": "assistant", "content": "Hello"}], "continue_final_message": True},
     "Cannot set both add_generation_prompt and continue_final_message to true."),  # add_generation_prompt: true
    ({"messages": USER + [{"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}]},
     "Cannot have 2 or more assistant messages at the end of the list."),
    ({"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}],
      "continue_final_message": True, "add_generation_prompt": False},
     "Cannot continue an assistant message that contains tool calls."),
    ({"messages": [{"role": "user"}]}, "All non-assistant messages must contain 'content'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
     "Assistant message must contain either 'content' or 'tool_calls'!"),
    ({}, "'messages' is required"),
], ids=["both", "both-by-default", "two-assistants", "tool-calls", "no-content", "assistant-empty", "no-messages"])
@pytest.mark.parametrize("path", ["/apply-template", "/v1/chat/completions"])
def test_prefill_conflicts_are_refused_as_llama_server_does(srv, path, body, words):
    status, r = call(srv, path, {**body, "max_tokens": 1})
    assert status == 400 and is_error(r) and r["error"]["message"] == words, r


# --- /slots, /tokenize, /detokenize -------------------------------------------------------------------------------

def test_slots(srv):
    call(srv, "/completion", {"prompt": "Hello world", "n_predict": 3, "ignore_eos": True, **GREEDY})
    status, r = call(srv, "/slots")
    assert status == 200 and isinstance(r, list) and len(r) == 1
    s = r[0]
    assert {"id", "n_ctx", "speculative", "is_processing", "id_task", "n_prompt_tokens", "n_prompt_tokens_processed",
            "n_prompt_tokens_cache", "params", "next_token"} <= set(s)
    assert s["id"] == 0 and s["n_ctx"] == N_CTX and s["is_processing"] is False and s["speculative"] is False
    assert s["n_prompt_tokens"] == 2 and s["next_token"][0]["n_decoded"] == 3
    assert s["next_token"][0]["has_next_token"] is False and s["params"]["n_predict"] == 3
    status, r = call(srv, "/slots?fail_on_no_slot=1")  # idle: a slot is free
    assert status == 200


def test_tokenize_with_pieces_mixed_and_detokenize(srv):
    _, plain = call(srv, "/tokenize", {"content": "Hello world"})
    status, r = call(srv, "/tokenize", {"content": "Hello world", "with_pieces": True})
    assert status == 200 and [t["id"] for t in r["tokens"]] == plain["tokens"]
    assert "".join(t["piece"] for t in r["tokens"]) == "Hello world"
    status, r = call(srv, "/tokenize", {"content": "\u00e9\u00e9\u00e9\u00e9 \U0001F600", "with_pieces": True})
    assert status == 200 and all(isinstance(t["piece"], (str, list)) for t in r["tokens"])
    # a piece that is part of a character comes as its bytes, as llama-server gives it
    raw = b"".join(t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in r["tokens"])
    assert raw.decode() == "\u00e9\u00e9\u00e9\u00e9 \U0001F600"
    status, r = call(srv, "/tokenize", {"content": ["Hello", plain["tokens"][1]]})  # mixed: text and ids
    assert r["tokens"] == plain["tokens"]
    status, r = call(srv, "/tokenize", {"content": "<|im_start|>", "parse_special": False})
    assert len(r["tokens"]) > 1  # the special token's text, not the token
    _, sp = call(srv, "/tokenize", {"content": "<|im_start|>"})
    assert len(sp["tokens"]) == 1
    assert call(srv, "/tokenize", {}) == (200, {"tokens": []})
    assert call(srv, "/detokenize", {}) == (200, {"content": ""})
    status, r = call(srv, "/tokenize", {"content": 5})
    assert status == 400 and is_error(r)


# --- prompts, /completion against /v1/completions -------------------------------------------------------------------

COMPLETION_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
                   "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
                   "tokens_cached", "timings"}


def test_completion_shape_is_llama_servers(srv):
    for path in ("/completion", "/completions"):  # llama-server routes both to its own shape
        status, r = call(srv, path, {"prompt": "Hello world", "n_predict": 4, "ignore_eos": True, **GREEDY})
        assert status == 200 and COMPLETION_KEYS <= set(r), (path, set(r))
        assert r["stop"] is True and r["truncated"] is False and r["stop_type"] == "limit" and r["id_slot"] == 0
        assert r["prompt"] == "Hello world" and r["tokens_evaluated"] == 2 and r["tokens_predicted"] == 4
        assert r["tokens_cached"] == 6 and r["model"] == "tiny-moe"
        assert {"cache_n", "prompt_n", "predicted_n"} <= set(r["timings"])
    # the same prompt again: its prefix comes from the cache
    status, r = call(srv, "/completion", {"prompt": "Hello world", "n_predict": 2, "ignore_eos": True, **GREEDY})
    t = r["timings"]
    assert t["cache_n"] >= 1 and t["cache_n"] + t["prompt_n"] == r["tokens_evaluated"]
    ev = events(srv, "/completion", {"prompt": "Hello world", "n_predict": 3, "ignore_eos": True, **GREEDY})
    assert all(e["stop"] is False and e["index"] == 0 for e in ev[:-1])
    assert ev[-1]["stop"] is True and COMPLETION_KEYS <= set(ev[-1])


def test_v1_completions_shape_is_openais(srv):
    status, r = call(srv, "/v1/completions", {"prompt": "Hello world", "max_tokens": 3, **GREEDY})
    assert status == 200 and r["object"] == "text_completion" and "content" not in r
    assert r["choices"][0]["index"] == 0 and r["choices"][0]["finish_reason"] == "length"
    u = r["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] == 5
    assert set(u["prompt_tokens_details"]) == {"cached_tokens"} and "cache_n" in r["timings"]
    for body, words in (({"echo": True}, "Only no echo is supported"), ({"best_of": 2}, "Unsupported param: best_of"),
                        ({"suffix": "x"}, "Unsupported param: suffix")):
        status, r = call(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1, **body})
        assert status == 400 and r["error"]["message"] == words


def test_prompt_as_token_ids_mixed_and_several(srv):
    _, t = call(srv, "/tokenize", {"content": "Hello world"})
    ids = t["tokens"]
    base = {"n_predict": 4, "ignore_eos": True, **GREEDY}
    _, text = call(srv, "/completion", {"prompt": "Hello world", **base})
    for prompt in (ids, ["Hello", ids[1]], [ids[0], " world"], {"prompt_string": "Hello world"}):
        status, r = call(srv, "/completion", {"prompt": prompt, **base})
        assert status == 200 and r["content"] == text["content"] and r["tokens_evaluated"] == 2, prompt
    # several prompts: a list of results (llama-server's), choices by index on /v1
    status, r = call(srv, "/completion", {"prompt": ["Hello world", ids], **base})
    assert status == 200 and [x["index"] for x in r] == [0, 1] and r[0]["content"] == r[1]["content"]
    status, r = call(srv, "/v1/completions", {"prompt": ["Hello world", "Bye"], "max_tokens": 2, "ignore_eos": True,
                                              **GREEDY})
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["usage"]["completion_tokens"] == 4
    ev = events(srv, "/v1/completions", {"prompt": ["Hello world", "Bye"], "max_tokens": 2, "ignore_eos": True,
                                         **GREEDY})
    assert {e["choices"][0]["index"] for e in ev} == {0, 1} and ev[-1]["usage"]["completion_tokens"] == 4
    for bad in ([], [ids[0], 10 ** 9], [True], {"x": 1}, [{"prompt_string": "x", "multimodal_data": ["AAAA"]}]):
        status, r = call(srv, "/completion", {"prompt": bad, "n_predict": 1})
        assert status == 400 and is_error(r), (bad, r)


# --- sampling fields -----------------------------------------------------------------------------------------

def _first_token(srv, **extra) -> int:
    _, r = call(srv, "/completion", {"prompt": "Hello", "n_predict": 1, "ignore_eos": True, **GREEDY, **extra})
    _, t = call(srv, "/tokenize", {"content": r["content"]})
    return t["tokens"][0]


def test_logit_bias_both_forms(srv):
    first = _first_token(srv)
    for bias in ({str(first): -100}, {str(first): False}, [[first, -100]], [[first, False]]):
        assert _first_token(srv, logit_bias=bias) != first, bias
    forced = (first + 7) % 1000
    assert _first_token(srv, logit_bias={str(forced): 100}) == forced
    assert _first_token(srv, logit_bias=[[forced, 100]]) == forced
    # OpenAI's form on /v1 too; a text key biases its tokens; malformed entries are skipped as llama-server skips
    status, r = call(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "logit_bias": {str(forced): 100},
                                              **GREEDY})
    assert status == 200 and r["choices"][0]["text"] == call(srv, "/detokenize", {"tokens": [forced]})[1]["content"]
    status, r = call(srv, "/completion", {"prompt": "Hello", "n_predict": 1, "logit_bias": [[1, "x"], [2], "junk"]})
    assert status == 200
    status, r = call(srv, "/completion", {"prompt": "Hello", "n_predict": 1, "logit_bias": 3})
    assert status == 400 and is_error(r)


def test_grammar(srv):
    status, r = call(srv, "/completion", {"prompt": "Answer:", "n_predict": 8, **GREEDY,
                                          "grammar": 'root ::= ("yes" | "no") "."'})
    assert status == 200 and r["content"] in ("yes.", "no.") and r["stop_type"] == "eos", r
    status, r = call(srv, "/completion", {"prompt": "x", "n_predict": 2, "grammar": "root ::= ("})
    assert status == 400 and is_error(r) and "grammar" in r["error"]["message"]
    status, r = call(srv, "/completion", {"prompt": "x", "n_predict": 4, **GREEDY,
                                          "json_schema": {"type": "boolean"}})
    assert status == 200 and r["content"] in ("true", "false"), r


def test_response_format(srv):
    status, r = call(srv, "/v1/chat/completions", {"messages": USER, "max_tokens": 12, **GREEDY,
                                                   "response_format": {"type": "json_object"}})
    assert status == 200, r
    out = r["choices"][0]["message"]["content"]
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(out), dict)
    else:
        assert out.startswith("{")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    status, r = call(srv, "/v1/chat/completions", {"messages": USER, "max_tokens": 12, **GREEDY,
                                                   "response_format": {"type": "json_schema",
                                                                       "json_schema": {"name": "x", "schema": schema}}})
    assert status == 200 and json.loads(r["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False}), r
    for body, code in (({"response_format": {"type": "xml"}}, 400),
                       ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, 400)):
        status, r = call(srv, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **body})
        assert status == code and is_error(r), r


def test_seed_per_request(srv):
    body = {"prompt": "Once upon a time", "n_predict": 12, "ignore_eos": True, "temperature": 1.0, "top_k": 0,
            "top_p": 1.0, "min_p": 0.0}
    a = call(srv, "/completion", {**body, "seed": 42})[1]["content"]
    b = call(srv, "/completion", {**body, "seed": 42})[1]["content"]
    c = call(srv, "/completion", {**body, "seed": 43})[1]["content"]
    assert a == b and a != c
    x = call(srv, "/v1/completions", {**body, "max_tokens": 12, "seed": 42})[1]["choices"][0]["text"]
    assert x == a


# --- embeddings ------------------------------------------------------------------------------------------------

def test_embeddings(srv):
    status, r = call(srv, "/v1/embeddings", {"input": ["hello world", "bye"], "model": "anything"})
    assert status == 200 and r["object"] == "list" and r["model"] == "anything"
    assert [d["index"] for d in r["data"]] == [0, 1] and all(d["object"] == "embedding" for d in r["data"])
    v = r["data"][0]["embedding"]
    assert len(v) == 256 and abs(sum(x * x for x in v) - 1) < 1e-4  # Euclidean-normalized, as llama-server's
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] >= 3
    status, one = call(srv, "/v1/embeddings", {"input": "hello world"})
    assert one["data"][0]["embedding"] == pytest.approx(v, abs=1e-5)  # the same text, the same vector
    # llama-server's own shape: a list of {index, embedding: [vector]}
    status, r = call(srv, "/embedding", {"content": "hello world"})
    assert status == 200 and r[0]["index"] == 0 and r[0]["embedding"][0] == pytest.approx(v, abs=1e-5)
    status, r = call(srv, "/v1/embeddings", {"input": "hello world", "encoding_format": "base64"})
    blob = base64.b64decode(r["data"][0]["embedding"])
    assert r["data"][0]["encoding_format"] == "base64"
    assert list(struct.unpack(f"<{len(blob) // 4}f", blob)) == pytest.approx(v, abs=1e-5)
    status, r = call(srv, "/v1/embeddings", {"input": "hello world", "embd_normalize": -1})
    assert abs(sum(x * x for x in r["data"][0]["embedding"]) - 1) > 1e-3
    # generation still works after embeddings (and its cached prompt was dropped)
    status, r = call(srv, "/completion", {"prompt": "Hello world", "n_predict": 2, "ignore_eos": True})
    assert status == 200 and r["tokens_predicted"] == 2


@pytest.mark.parametrize("body,words", [
    ({}, '"input" or "content" must be provided'),
    ({"input": []}, '"input" must not be empty'),
    ({"input": "x", "encoding_format": "hex"}, "Can be either float or base64"),
    ({"input": "word " * (2 * N_CTX)}, "too large"),
    ({"input": 5}, "must be a string"),
])
def test_embeddings_bad_input(srv, body, words):
    status, r = call(srv, "/v1/embeddings", body)
    assert status == 400 and is_error(r) and words in r["error"]["message"], r
