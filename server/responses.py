"""OpenAI's Responses API (`POST /v1/responses`, `/v1/responses/input_tokens`) over the chat path, as llama-server
serves it: a request becomes a chat-completions body (server_chat_convert_responses_to_chatcmpl), its reply and
stream are the Responses API's (to_json_oaicompat_resp and its stream events).

`input` is a string (one user message) or a list of items: messages (`role` user, system or developer with a string
or `input_text`/`input_image` parts; assistant with `output_text` parts, joined to a preceding assistant message),
`function_call`, `function_call_output` and `reasoning` items; `instructions` is a system message first;
`max_output_tokens` is max_tokens; every other field goes to the chat path as it is (temperature, top_p, stop,
seed, ...). `previous_response_id` is refused (no response is stored), as llama-server refuses it.
"""
from __future__ import annotations

from .engine import RequestError, Result

_INPUT_ROLES = ("user", "system", "developer")


def _is_str(item: dict, key: str) -> bool:
    return isinstance(item.get(key), str)


def _input_parts(parts: list, where: str) -> list[dict]:
    out = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict):
            raise RequestError(f"'{where}.content[{j}]' must be a content part (an object)", "input")
        kind = p.get("type")
        if kind == "input_text":
            if "text" not in p:
                raise RequestError("'Input text' requires 'text'", "input")
            if not _is_str(p, "text"):
                raise RequestError(f"'{where}.content[{j}].text' must be a string", "input")
            out.append({"text": p["text"], "type": "text"})
        elif kind == "input_image":
            if "image_url" not in p:
                raise RequestError("'image_url' is required", "input")
            out.append({"image_url": {"url": p["image_url"]}, "type": "image_url"})
        elif kind == "input_file":
            raise RequestError("'input_file' is not supported by llamacpp at this moment", "input")
        else:
            raise RequestError("'type' must be one of 'input_text', 'input_image', or 'input_file'", "input")
    return out


def _output_parts(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    out = []
    for j, p in enumerate(content if isinstance(content, list) else []):
        if not isinstance(p, dict):
            raise RequestError(f"'{where}.content[{j}]' must be a content part (an object)", "input")
        kind = p.get("type")
        if kind in ("output_text", "input_text"):
            if not _is_str(p, "text"):
                raise RequestError("'Output text' requires 'text'", "input")
            out.append({"text": p["text"], "type": "text"})
        elif kind == "refusal":
            if not _is_str(p, "refusal"):
                raise RequestError("'Refusal' requires 'refusal'", "input")
            out.append({"refusal": p["refusal"], "type": "refusal"})
        else:
            raise RequestError("'type' must be one of 'output_text' or 'refusal'", "input")
    return out


def _items(items: list) -> list[dict]:
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{where}' must be an object (a message or an item)", "input")
        merge = bool(messages) and messages[-1].get("role") == "assistant"
        role, kind, content = item.get("role"), item.get("type"), item.get("content")
        if role in _INPUT_ROLES and isinstance(content, (str, list)):
            parts = [{"text": content, "type": "text"}] if isinstance(content, str) else _input_parts(content, where)
            messages.append({"role": role, "content": parts})
        elif role == "assistant" and kind in ("message", None) and isinstance(content, (str, list, type(None))):
            parts = _output_parts(content, where)
            if merge:
                prev = messages[-1]
                if not isinstance(prev.get("content"), list):
                    prev["content"] = [] if not prev.get("content") else [{"text": prev["content"], "type": "text"}]
                prev["content"] += parts
            else:
                messages.append({"role": "assistant", "content": parts})
        elif kind == "function_call" and all(_is_str(item, k) for k in ("arguments", "call_id", "name")):
            call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"],
                    "type": "function"}
            if merge:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and _is_str(item, "call_id") and isinstance(item.get("output"),
                                                                                        (str, list)):
            output = item["output"]
            if isinstance(output, list):
                converted = []
                for p in output:
                    if not isinstance(p, dict) or "type" not in p:
                        raise RequestError("Output of tool call missing 'type' field", "input")
                    if p["type"] == "input_text":
                        converted.append({**p, "type": "text"})
                    elif p["type"] == "input_image":
                        if "image_url" not in p:
                            raise RequestError("'image_url' is required", "input")
                        converted.append({**p, "type": "image_url", "image_url": {"url": p["image_url"]}})
                    else:
                        raise RequestError("Output of tool call should be 'Input text' or 'Input image'", "input")
                output = converted
            messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
        elif kind == "reasoning" and isinstance(item.get("summary"), list):
            c = item.get("content")
            if not isinstance(c, list):
                raise RequestError("item['content'] is not an array", "input")
            if not c:
                raise RequestError("item['content'] is empty", "input")
            if not isinstance(c[0], dict) or not _is_str(c[0], "text"):
                raise RequestError("item['content']['text'] is not a string", "input")
            if merge:
                messages[-1]["reasoning_content"] = c[0]["text"]
            else:
                messages.append({"role": "assistant", "content": "", "reasoning_content": c[0]["text"]})
        else:
            raise RequestError(f"Cannot determine type of 'item' ({where})", "input")
    return messages


def to_chat(body: dict) -> dict:
    """The chat-completions body of a Responses request."""
    if "input" not in body:
        raise RequestError("'input' is required", "input")
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise RequestError("'previous_response_id' must be a string", "previous_response_id")
    if prev:
        raise RequestError("llama.cpp does not support 'previous_response_id'.", "previous_response_id")
    out = {k: v for k, v in body.items()
           if k not in ("input", "instructions", "max_output_tokens", "tools", "reasoning", "previous_response_id")}
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError(f"'instructions' must be a string, got {type(instructions).__name__}", "instructions")
        messages.append({"role": "system", "content": instructions})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += _items(given)
    else:
        raise RequestError("'input' must be a string or array of objects", "input")
    out["messages"] = messages
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be an array of objects", "tools")
    mot = body.get("max_output_tokens")
    if mot is not None:
        if not isinstance(mot, int) or isinstance(mot, bool) or mot < 0:
            raise RequestError(f"'max_output_tokens' must be an integer >= 0, got {mot!r}", "max_output_tokens")
        out["max_tokens"] = mot
    return out


def _usage(n_prompt: int, r: Result) -> dict:
    n = r.timings.predicted_n
    return {"input_tokens": n_prompt, "output_tokens": n, "total_tokens": n_prompt + n,
            "input_tokens_details": {"cached_tokens": r.timings.cache_n}}


def _part(text: str) -> dict:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _message(mid: str, text: str) -> dict:
    return {"content": [_part(text)], "id": mid, "role": "assistant", "status": "completed", "type": "message"}


def response(rid: str, mid: str, model: str, n_prompt: int, r: Result, created: int) -> dict:
    """The non-streamed reply: one output message (none when nothing was generated)."""
    return {"completed_at": created, "created_at": created, "id": rid, "model": model, "object": "response",
            "output": [_message(mid, r.text)] if r.text else [], "status": "completed",
            "usage": _usage(n_prompt, r)}


def events(rid: str, mid: str, model: str, n_prompt: int, r: Result, pieces, created: int):
    """The streamed reply as (event name, data): response.created and response.in_progress, the message's
    response.output_item.added and response.content_part.added, a response.output_text.delta per piece, then
    response.output_text.done, response.content_part.done, response.output_item.done (none of the message's when
    nothing was generated) and response.completed with the usage (and timings, as llama-server adds them)."""
    stub = {"id": rid, "object": "response", "status": "in_progress"}
    yield "response.created", {"type": "response.created", "response": stub}
    yield "response.in_progress", {"type": "response.in_progress", "response": stub}
    opened = False
    for piece in pieces:
        if not opened:
            opened = True
            yield "response.output_item.added", {"type": "response.output_item.added", "item": {
                "content": [], "id": mid, "role": "assistant", "status": "in_progress", "type": "message"}}
            yield "response.content_part.added", {"type": "response.content_part.added", "item_id": mid,
                                                  "part": {"type": "output_text", "text": ""}}
        yield "response.output_text.delta", {"type": "response.output_text.delta", "item_id": mid, "delta": piece}
    output = []
    if r.text:
        yield "response.output_text.done", {"type": "response.output_text.done", "item_id": mid, "text": r.text}
        yield "response.content_part.done", {"type": "response.content_part.done", "item_id": mid,
                                             "part": _part(r.text)}
        item = {"type": "message", "status": "completed", "id": mid, "content": [_part(r.text)], "role": "assistant"}
        yield "response.output_item.done", {"type": "response.output_item.done", "item": item}
        output.append(item)
    yield "response.completed", {"type": "response.completed", "response": {
        "id": rid, "object": "response", "created_at": created, "status": "completed", "model": model,
        "output": output, "usage": _usage(n_prompt, r)}, "timings": r.timings.as_dict()}
