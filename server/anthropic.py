"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path, as llama-server
serves it: a request becomes a chat-completions body (server_chat_convert_anthropic_to_oai), its reply and stream are
Anthropic's (server_task_result_cmpl_final::to_json_anthropic, the partials' message_start, content_block_* events).

The conversion keeps llama-server's reading: `system` as a string or text blocks; content as a string or blocks
(`text`; `thinking` as the message's reasoning_content; `image` as an image part, which a text model refuses;
`tool_use` as a tool call; `tool_result` as a tool message); other block types are dropped; an assistant message
without content is skipped; `stop_sequences` are stop strings; only `max_tokens`, `temperature`, `top_p`, `top_k`,
`stream` and `chat_template_kwargs` pass through. Where llama-server would take a value of the wrong type, a 400
names it.
"""
from __future__ import annotations

import json

from .engine import RequestError, Result

DEFAULT_MAX_TOKENS = 4096  # what llama-server generates when max_tokens is missing (Anthropic requires it)
_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


def _billing_header(text: str) -> str:
    """llama-server's normalize_anthropic_billing_header: the per-request `cch=xxxxx;` stamp of an
    `x-anthropic-billing-header:` system prompt becomes `cch=fffff;`, so that the prompt cache gets past it."""
    head = "x-anthropic-billing-header:"
    if not text.startswith(head):
        return text
    i = text.find("cch=", len(head))
    if i < 0:
        return text
    j = i + 4
    if j + 5 < len(text) and text[j + 5] == ";":
        return text[:j] + "fffff" + text[j + 5:]
    return text


def _str(v, where: str, default: str = "") -> str:
    if v is None:
        return default
    if not isinstance(v, str):
        raise RequestError(f"'{where}' must be a string, got {type(v).__name__}", where.split(".")[0].split("[")[0])
    return v


def _image_part(source, where: str) -> dict | None:
    if source is None:
        source = {}
    if not isinstance(source, dict):
        raise RequestError(f"'{where}.source' must be an object", "messages")
    kind = source.get("type")
    if kind == "base64":
        media = _str(source.get("media_type"), f"{where}.source.media_type", "image/jpeg")
        data = _str(source.get("data"), f"{where}.source.data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url":
        return {"type": "image_url", "image_url": {"url": _str(source.get("url"), f"{where}.source.url")}}
    return None


def _system(system) -> str:
    if isinstance(system, str):
        return _billing_header(system)
    if not isinstance(system, list):
        raise RequestError("'system' must be a string or a list of text blocks", "system")
    out = []
    for i, block in enumerate(system):
        if not isinstance(block, dict):
            raise RequestError(f"'system[{i}]' must be a content block (an object)", "system")
        if block.get("type") == "text":
            out.append(_billing_header(_str(block.get("text"), f"system[{i}].text")))
    return "".join(out)


def _tool_result(block: dict, where: str) -> dict:
    tool_use_id = _str(block.get("tool_use_id"), f"{where}.tool_use_id")
    content = block.get("content")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": content}
    if not isinstance(content, list):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": ""}
    text, parts, images = "", [], False
    for k, c in enumerate(content):
        if not isinstance(c, dict):
            raise RequestError(f"'{where}.content[{k}]' must be a content block (an object)", "messages")
        if c.get("type") == "text":
            t = _str(c.get("text"), f"{where}.content[{k}].text")
            text += t
            parts.append({"type": "text", "text": t})
        elif c.get("type") == "image":
            images = True
            part = _image_part(c.get("source"), f"{where}.content[{k}]")
            if part is not None:
                parts.append(part)
    # text only: one string, for any template; with images: OpenAI's multimodal tool content
    return {"role": "tool", "tool_call_id": tool_use_id, "content": parts if images else text}


def _message(m: dict, where: str) -> list[dict]:
    """One Anthropic message as chat messages (none, the message, then its tool results)."""
    role = m["role"]
    content = m["content"]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"'{where}.content' must be a string or a list of content blocks", "messages")
    parts, tool_calls, results, reasoning = [], [], [], ""
    for j, block in enumerate(content):
        bw = f"{where}.content[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"'{bw}' must be a content block (an object with a string 'type')", "messages")
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _str(block.get("text"), f"{bw}.text")})
        elif kind == "thinking":
            reasoning += _str(block.get("thinking"), f"{bw}.thinking")
        elif kind == "image":
            part = _image_part(block.get("source"), bw)
            if part is not None:
                parts.append(part)
        elif kind == "tool_use":
            args = block.get("input")
            tool_calls.append({"id": _str(block.get("id"), f"{bw}.id"), "type": "function",
                               "function": {"name": _str(block.get("name"), f"{bw}.name"),
                                            "arguments": json.dumps({} if args is None else args,
                                                                    separators=(",", ":"), ensure_ascii=False)}})
        elif kind == "tool_result":
            results.append(_tool_result(block, bw))
    out = []
    if parts or tool_calls or reasoning:
        msg: dict = {"role": role, "content": parts or ""}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out + results


def to_chat(body: dict) -> dict:
    """The chat-completions body of an Anthropic Messages request. max_tokens is left out when the request has
    none (the caller applies DEFAULT_MAX_TOKENS, within the context)."""
    messages: list[dict] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system(body["system"])})
    if "messages" not in body:
        raise RequestError("'messages' is required", "messages")
    given = body["messages"]
    if not isinstance(given, list):
        raise RequestError("'messages' must be a list of messages", "messages")
    for i, m in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"'{where}' must be an object with a string 'role'", "messages")
        if "content" not in m:
            if m["role"] == "assistant":
                continue
            raise RequestError("All non-assistant messages must contain 'content'", "messages")
        messages += _message(m, where)
    out: dict = {"messages": messages}
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise RequestError("'stop_sequences' must be a list of strings", "stop_sequences")
        out["stop"] = stops
    if body.get("max_tokens") is not None:
        out["max_tokens"] = body["max_tokens"]
    for key in _PASSED:
        if key in body:
            out[key] = body[key]
    return out


def stop_reason(r: Result) -> str:
    """end_turn at an end-of-generation token or a stop sequence, max_tokens at the limit (llama-server's)."""
    return "end_turn" if r.finish_reason == "stop" else "max_tokens"


def _usage_in(n_prompt: int, r: Result) -> dict:
    return {"cache_read_input_tokens": r.timings.cache_n, "input_tokens": n_prompt - r.timings.cache_n}


def message(cid: str, model: str, n_prompt: int, r: Result) -> dict:
    """The non-streamed reply."""
    return {"id": cid, "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": r.text}] if r.text else [],
            "model": model, "stop_reason": stop_reason(r), "stop_sequence": r.stopping_word or None,
            "usage": {**_usage_in(n_prompt, r), "output_tokens": r.timings.predicted_n}}


def events(cid: str, model: str, n_prompt: int, r: Result, pieces):
    """The streamed reply as (event name, data): message_start (once the prompt is evaluated, so that its usage
    counts the cached tokens), one text block (content_block_start, a content_block_delta per piece,
    content_block_stop; none when nothing was generated), message_delta with the stop reason and output tokens,
    message_stop."""
    started = text_open = False

    def start():
        return "message_start", {"type": "message_start", "message": {
            "id": cid, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None, "usage": {**_usage_in(n_prompt, r), "output_tokens": 0}}}
    for piece in pieces:
        if not started:
            started = True
            yield start()
        if not text_open:
            text_open = True
            yield "content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}
        yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                      "delta": {"type": "text_delta", "text": piece}}
    if not started:
        yield start()
    if text_open:
        yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": stop_reason(r), "stop_sequence": r.stopping_word or None},
                            "usage": {"output_tokens": r.timings.predicted_n}}
    yield "message_stop", {"type": "message_stop"}
