"""`expert-pack serve`'s other API families, against llama-server's shapes: Anthropic's Messages API (/v1/messages,
streamed with Anthropic's events, /v1/messages/count_tokens) and OpenAI's Responses API (/v1/responses, streamed with
its events, /v1/responses/input_tokens; also through the openai client), both over the chat path, and
/v1/chat/completions/input_tokens. One server (the tiny synthetic MoE and its pack) over loopback HTTP; shapes,
status codes and bad input only, never timing."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

N_CTX = 512
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def srv(packs, start_serve):
    with start_serve(packs("qwen3moe")[1], ["-c", N_CTX, "-t", 2, "--alias", "tiny-moe"], name="apis") as s:
        yield s.base
    assert "Traceback" not in s.log.read_text()


def call(base, path, body=None, raw: bytes | None = None):
    """(status, JSON) of a POST; every answer must be JSON, an error one line."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        out, status = e.read(), e.code
    if status >= 400:
        assert b"\n" not in out.strip(), out
    return status, json.loads(out)


def stream(base, path, body) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed reply; each event's `event:` line names its data's type, and the
    stream has nothing else (no `data: [DONE]`)."""
    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = r.read().decode()
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name, frame
        out.append((name, data))
    return out


def is_error(r: dict, words: str, kind: str = "invalid_request_error") -> bool:
    e = r.get("error")
    return isinstance(e, dict) and e["type"] == kind and words in e["message"]


# --- Anthropic's Messages API --------------------------------------------------------------------------------

def test_messages_shape(srv):
    status, r = call(srv, "/v1/messages", {"model": "claude-x", "max_tokens": 6, "messages": USER, **GREEDY})
    assert status == 200, r
    assert set(r) == {"id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"}
    assert r["id"].startswith("chatcmpl-") and r["type"] == "message" and r["role"] == "assistant"
    assert r["model"] == "tiny-moe"  # the loaded model serves any name
    assert len(r["content"]) == 1 and set(r["content"][0]) == {"type", "text"} and r["content"][0]["type"] == "text"
    assert r["content"][0]["text"]
    assert r["stop_reason"] == "max_tokens" and r["stop_sequence"] is None
    u = r["usage"]
    assert set(u) == {"cache_read_input_tokens", "input_tokens", "output_tokens"}
    assert all(isinstance(v, int) for v in u.values()) and u["output_tokens"] == 6
    # the prompt's tokens, split into those read from the cache and the rest: together count_tokens' count
    _, c = call(srv, "/v1/messages/count_tokens", {"model": "claude-x", "messages": USER})
    assert c == {"input_tokens": u["input_tokens"] + u["cache_read_input_tokens"]}


def test_messages_streamed_equals_unstreamed(srv):
    body = {"max_tokens": 8, "messages": USER, **GREEDY}
    _, r = call(srv, "/v1/messages", body)
    ev = stream(srv, "/v1/messages", body)
    names = [n for n, _ in ev]
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * (len(ev) - 5) + \
        ["content_block_stop", "message_delta", "message_stop"]
    start = ev[0][1]["message"]
    assert start["id"].startswith("chatcmpl-") and start["type"] == "message" and start["role"] == "assistant"
    assert start["content"] == [] and start["stop_reason"] is None and start["stop_sequence"] is None
    assert start["model"] == "tiny-moe" and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == \
        r["usage"]["input_tokens"] + r["usage"]["cache_read_input_tokens"]
    assert ev[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [d for n, d in ev if n == "content_block_delta"]
    assert len(deltas) > 1 and all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == r["content"][0]["text"]
    assert ev[-3][1] == {"type": "content_block_stop", "index": 0}
    assert ev[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                         "usage": {"output_tokens": 8}}
    assert ev[-1][1] == {"type": "message_stop"}
    assert not any("timings" in d for _, d in ev)  # Anthropic's shape has none


def test_messages_system_and_content_blocks(srv):
    def count(**body):
        status, r = call(srv, "/v1/messages/count_tokens", body)
        assert status == 200 and set(r) == {"input_tokens"}, r
        return r["input_tokens"]
    plain = count(messages=[{"role": "user", "content": "What is the answer?"}])
    blocks = [{"type": "text", "text": "What is"}, {"type": "text", "text": " the answer?"}]
    assert count(messages=[{"role": "user", "content": blocks}]) == plain  # text blocks are the text joined
    with_system = count(system="You are terse.", messages=[{"role": "user", "content": blocks}])
    assert with_system != plain
    assert count(system=[{"type": "text", "text": "You are"}, {"type": "text", "text": " terse."}],
                 messages=[{"role": "user", "content": blocks}]) == with_system
    # a system prompt as generated: the same whatever was given
    status, r = call(srv, "/v1/messages", {"system": "You are terse.", "max_tokens": 2, "messages": USER})
    assert status == 200 and r["type"] == "message" and r["usage"]["output_tokens"] == 2
    # blocks of other types count for nothing (llama-server drops them)
    assert count(messages=[{"role": "user", "content": blocks + [{"type": "document", "source": {}}]}]) == plain


def test_messages_sampling_and_conversation(srv):
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"},
                    {"role": "user", "content": "How are you?"}]
    for extra in ({"temperature": 0.5}, {"top_p": 0.9}, {"top_k": 40}, {"metadata": {"user_id": "u1"}},
                  {"thinking": {"type": "enabled", "budget_tokens": 50}}, {"tool_choice": {"type": "auto"}}):
        status, r = call(srv, "/v1/messages", {"max_tokens": 3, "messages": conversation, **extra})
        assert status == 200 and r["type"] == "message" and r["usage"]["output_tokens"] == 3, (extra, r)
    # max_tokens may be left out (llama-server's 4096, here within the context)
    status, r = call(srv, "/v1/messages", {"messages": USER, "stop_sequences": ["e"]})
    assert status == 200 and r["type"] == "message"
    # an empty conversation is a prompt too (the template's generation prompt), as llama-server takes it
    status, r = call(srv, "/v1/messages", {"max_tokens": 2, "messages": []})
    assert status == 200 and r["type"] == "message" and r["usage"]["output_tokens"] == 2


def test_messages_stop_sequences(srv):
    _, r = call(srv, "/v1/messages", {"max_tokens": 12, "messages": USER, **GREEDY})
    text = r["content"][0]["text"]
    k = len(text) // 2
    stop = text[k:k + 3]
    want = text[:text.index(stop)]
    body = {"max_tokens": 12, "messages": USER, "stop_sequences": [stop, "never-there"], **GREEDY}
    status, r = call(srv, "/v1/messages", body)
    assert status == 200
    assert r["stop_reason"] == "end_turn" and r["stop_sequence"] == stop
    assert (r["content"][0]["text"] if r["content"] else "") == want
    ev = stream(srv, "/v1/messages", body)
    assert ev[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": stop}
    assert "".join(d["delta"]["text"] for n, d in ev if n == "content_block_delta") == want


def test_messages_prefill_tools_and_thinking(srv):
    # a trailing assistant message is continued (Anthropic's prefill)
    status, r = call(srv, "/v1/messages", {"max_tokens": 2, "messages": USER + [
        {"role": "assistant", "content": "The best book is"}]})
    assert status == 200 and r["usage"]["output_tokens"] == 2
    tool_use = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should look it up."},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"location": "Paris"}}]}
    for result in ({"type": "tool_result", "tool_use_id": "t1", "content": "Sunny, 25°C"},
                   {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": "City not found"},
                   {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "Sunny"}]}):
        msgs = [{"role": "user", "content": "What's the weather?"}, tool_use,
                {"role": "user", "content": [{"type": "text", "text": "Here:"}, result]}]
        status, r = call(srv, "/v1/messages", {"max_tokens": 2, "messages": msgs, "tools": [
            {"name": "get_weather", "description": "The weather", "input_schema": {"type": "object"}}]})
        assert status == 200 and r["type"] == "message" and r["content"][0]["type"] == "text", r
    # an assistant message that ends in a tool call cannot be continued, as llama-server refuses it
    status, r = call(srv, "/v1/messages", {"max_tokens": 2, "messages": USER + [tool_use]})
    assert status == 400 and is_error(r, "Cannot continue an assistant message that contains tool calls."), r


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
NO_IMAGES = "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [IMAGE, {"type": "text",
                                                                                           "text": "What?"}]}]}),
    ("/v1/messages", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "Read it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "File:"}, IMAGE]}]}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [IMAGE]}]}),
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}),
    ("/v1/responses", {"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]}),
], ids=["anthropic", "anthropic-tool-result", "count-tokens", "chat", "responses"])
def test_images_are_refused_as_llama_server_does(srv, path, body):
    # a model without a multimodal projector: llama-server's words and status
    status, r = call(srv, path, body)
    assert status == 500 and is_error(r, NO_IMAGES, "server_error"), r


@pytest.mark.parametrize("body,words,param", [
    ({"max_tokens": 5}, "'messages' is required", "messages"),
    ({"messages": "hi"}, "'messages' must be a list", "messages"),
    ({"messages": [5]}, "'messages[0]' must be an object with a string 'role'", "messages"),
    ({"messages": [{"content": "x"}]}, "'messages[0]' must be an object with a string 'role'", "messages"),
    ({"messages": [{"role": "user"}]}, "All non-assistant messages must contain 'content'", "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "'messages[0].content' must be a string or a list", "messages"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "'messages[0].content[0]' must be a content block",
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "'messages[0].content[0].text' must be a string", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]},
     "'messages[0].content[0].source' must be an object", "messages"),
    ({"system": 5, "messages": USER}, "'system' must be a string or a list of text blocks", "system"),
    ({"system": [{"type": "text", "text": 1}], "messages": USER}, "'system[0].text' must be a string", "system"),
    ({"messages": USER, "stop_sequences": "x"}, "'stop_sequences' must be a list of strings", "stop_sequences"),
    ({"messages": USER, "max_tokens": "5"}, "'max_tokens' must be int", "max_tokens"),
    ({"messages": USER, "max_tokens": -1}, "'max_tokens' must be >= 0", "max_tokens"),
    ({"messages": USER, "max_tokens": 100000}, "exceeds the context", "max_tokens"),
    ({"messages": USER, "temperature": "hot"}, "'temperature' must be int/float", "temperature"),
    ({"messages": USER, "top_p": 2}, "'top_p' must be <= 1", "top_p"),
    ({"messages": USER, "top_k": 1.5}, "'top_k' must be int", "top_k"),
    ({"messages": USER, "stream": "yes"}, "'stream' must be bool", "stream"),
    ({"messages": USER, "model": 3}, "'model' must be str", "model"),
    ({"messages": USER + [{"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}]},
     "Cannot have 2 or more assistant messages at the end of the list.", "messages"),
], ids=["no-messages", "messages-str", "message-int", "no-role", "no-content", "content-int", "block-str",
        "text-int", "source-str", "system-int", "system-text-int", "stop-str", "max-tokens-str", "max-tokens-neg",
        "max-tokens-huge", "temperature-str", "top-p-2", "top-k-float", "stream-str", "model-int",
        "two-assistants"])
def test_messages_bad_input(srv, body, words, param):
    status, r = call(srv, "/v1/messages", body)
    assert status == 400 and is_error(r, words) and r["error"]["param"] == param, r


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                                  "/v1/responses/input_tokens", "/v1/chat/completions/input_tokens"])
@pytest.mark.parametrize("raw,words", [
    (b"{bad", "not valid JSON"), (b"[1]", "must be a JSON object"), (b"\xff", "not valid UTF-8")])
def test_bad_bodies(srv, path, raw, words):
    status, r = call(srv, path, raw=raw)
    assert status == 400 and is_error(r, words), r


def test_count_tokens_needs_no_max_tokens_and_checks_messages(srv):
    status, r = call(srv, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hello"}]})
    assert status == 200 and set(r) == {"input_tokens"} and r["input_tokens"] > 0
    status, r = call(srv, "/v1/messages/count_tokens", {})
    assert status == 400 and is_error(r, "'messages' is required")


# --- OpenAI's Responses API ----------------------------------------------------------------------------------

def client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


RESP_INPUT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


def test_responses_with_the_openai_client(srv):
    c = client(srv)
    r = c.responses.create(model="gpt-4.1", input=RESP_INPUT, max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.model == "tiny-moe"
    assert len(r.output) == 1 and r.output[0].id.startswith("msg_") and r.output[0].type == "message"
    assert r.output[0].role == "assistant" and r.output[0].status == "completed"
    assert r.output[0].content[0].type == "output_text" and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    _, n = call(srv, "/v1/responses/input_tokens", {"input": RESP_INPUT})
    assert n == {"input_tokens": r.usage.input_tokens, "object": "response.input_tokens"}

    gathered, resp_id, msg_id, types, completed = "", "", "", [], None
    for ev in c.responses.create(model="gpt-4.1", input=RESP_INPUT, max_output_tokens=8, temperature=0,
                                 stream=True):
        types.append(ev.type)
        if ev.type == "response.created":
            resp_id = ev.response.id
        elif ev.type == "response.in_progress":
            assert ev.response.id == resp_id
        elif ev.type == "response.output_item.added":
            msg_id = ev.item.id
        elif ev.type in ("response.content_part.added", "response.output_text.delta", "response.output_text.done",
                         "response.content_part.done"):
            assert ev.item_id == msg_id
        elif ev.type == "response.output_item.done":
            assert ev.item.id == msg_id
        if ev.type == "response.output_text.delta":
            gathered += ev.delta
        if ev.type == "response.completed":
            completed = ev.response
    assert resp_id.startswith("resp_") and msg_id.startswith("msg_")
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert completed.id == resp_id and completed.output[0].id == msg_id
    assert gathered == completed.output_text == r.output_text  # greedy: streamed as unstreamed
    assert completed.usage.output_tokens == 8


def test_responses_stream_shape(srv):
    ev = stream(srv, "/v1/responses", {"input": "Hello", "max_output_tokens": 4, **GREEDY})
    data = dict(ev)
    rid = data["response.created"]["response"]["id"]
    assert data["response.created"]["response"] == {"id": rid, "object": "response", "status": "in_progress"}
    item = data["response.output_item.added"]["item"]
    assert item == {"content": [], "id": item["id"], "role": "assistant", "status": "in_progress", "type": "message"}
    text = "".join(d["delta"] for n, d in ev if n == "response.output_text.delta")
    assert data["response.output_text.done"] == {"type": "response.output_text.done", "item_id": item["id"],
                                                 "text": text}
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    assert data["response.content_part.done"]["part"] == part
    assert data["response.output_item.done"]["item"] == {"type": "message", "status": "completed", "id": item["id"],
                                                         "content": [part], "role": "assistant"}
    done = data["response.completed"]
    assert done["response"]["status"] == "completed" and done["response"]["output"] == [
        data["response.output_item.done"]["item"]]
    u = done["response"]["usage"]
    assert set(u) == {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details"}
    assert u["output_tokens"] == 4 and set(u["input_tokens_details"]) == {"cached_tokens"}
    assert {"prompt_per_second", "predicted_per_second"} <= set(done["timings"])  # llama-server adds them


def test_responses_input_forms(srv):
    def count(**body):
        status, r = call(srv, "/v1/responses/input_tokens", body)
        assert status == 200 and r["object"] == "response.input_tokens", r
        return r["input_tokens"]
    plain = count(input="What is the answer?")
    assert count(input=[{"role": "user", "content": "What is the answer?"}]) == plain
    assert count(input=[{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What is"}, {"type": "input_text", "text": " the answer?"}]}]) == plain
    assert count(input="What is the answer?", instructions="Be terse.") == count(input=[
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is the answer?"}]) != plain
    # a whole conversation: an assistant's output message (joined to the one before), a tool call and its output,
    # a reasoning item
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Think."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "42"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "43"}]},
             {"role": "developer", "content": "And?"}]
    assert count(input=items) > plain
    status, r = call(srv, "/v1/responses", {"input": items, "max_output_tokens": 2, "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}]})
    assert status == 200 and r["object"] == "response" and r["usage"]["output_tokens"] == 2, r
    status, r = call(srv, "/responses", {"input": [], "max_output_tokens": 2})  # also without /v1, as there
    assert status == 200 and r["usage"]["output_tokens"] == 2
    # fields of the chat path pass through (stop, seed, ...): a seed gives the same text again
    body = {"input": "Hi", "max_output_tokens": 6, "temperature": 1.0, "seed": 11}
    texts = [call(srv, "/v1/responses", body)[1]["output"][0]["content"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1]
    status, r = call(srv, "/v1/responses", {**body, "stop": [texts[0][:2]]})
    assert status == 200 and r["usage"]["output_tokens"] < 6 and r["output"] == []  # stopped at its start


@pytest.mark.parametrize("body,words,param", [
    ({}, "'input' is required", "input"),
    ({"input": 5}, "'input' must be a string or array of objects", "input"),
    ({"input": [5]}, "'input[0]' must be an object", "input"),
    ({"input": [{"type": "weird"}]}, "Cannot determine type of 'item'", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "'input_file' is not supported by llamacpp at this moment", "input"),
    ({"input": [{"role": "user", "content": [{"type": "audio"}]}]},
     "'type' must be one of 'input_text', 'input_image', or 'input_file'", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "'Input text' requires 'text'", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "'input[0].content[0].text' must be a string", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "'image_url' is required", "input"),
    ({"input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}]},
     "'Output text' requires 'text'", "input"),
    ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "item['content'] is empty", "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": "x"}]}]},
     "Output of tool call missing 'type' field", "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "llama.cpp does not support 'previous_response_id'.",
     "previous_response_id"),
    ({"input": "x", "instructions": 3}, "'instructions' must be a string", "instructions"),
    ({"input": "x", "max_output_tokens": -1}, "'max_output_tokens' must be an integer >= 0", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "8"}, "'max_output_tokens' must be an integer >= 0", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens=100000 plus the prompt's", "max_output_tokens"),
    ({"input": "x", "tools": {}}, "'tools' must be an array of objects", "tools"),
    ({"input": "x", "temperature": "hot"}, "'temperature' must be int/float", "temperature"),
    ({"input": "x", "stream": 1}, "'stream' must be bool", "stream"),
], ids=["no-input", "input-int", "item-int", "item-unknown", "input-file", "part-unknown", "text-missing",
        "text-int", "image-url-missing", "output-text-missing", "reasoning-empty", "tool-output-untyped",
        "previous-response", "instructions-int", "max-output-neg", "max-output-str", "max-output-huge",
        "tools-object", "temperature-str", "stream-int"])
def test_responses_bad_input(srv, body, words, param):
    status, r = call(srv, "/v1/responses", body)
    assert status == 400 and is_error(r, words) and r["error"]["param"] == param, r
    if "max_output_tokens=" not in words and param not in ("temperature", "stream"):  # checked when generating
        status, r = call(srv, "/v1/responses/input_tokens", body)
        assert status == 400 and is_error(r, words), r


# --- /v1/chat/completions/input_tokens ---------------------------------------------------------------------------

def test_chat_input_tokens(srv):
    status, r = call(srv, "/v1/chat/completions", {"messages": USER, "max_tokens": 1})
    assert status == 200
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        status, n = call(srv, path, {"messages": USER})
        assert (status, n) == (200, {"input_tokens": r["usage"]["prompt_tokens"], "object": "response.input_tokens"})
    status, n = call(srv, "/v1/chat/completions/input_tokens", {"messages": 5})
    assert status == 400 and is_error(n, "'messages' must be a non-empty list")
