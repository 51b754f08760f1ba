"""The HTTP API: OpenAI's /v1 endpoints and llama-server's own, over one Engine.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status
(but a missing or wrong API key's 401, which is llama-server's body word for word);
a bad request never takes the server down: a body that is not UTF-8 JSON (415 for another Content-Type, 400 for
bad bytes, bad syntax, nesting too deep to parse, or a lone UTF-16 surrogate, which no text can hold) is refused
before any handler sees it. Streams are Server-Sent Events; a client that goes away is noticed
between tokens (waitress's `client_disconnected`) and its generation stops.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

from flask import Flask, Response, request

from . import anthropic, responses
from .engine import Cancelled, Engine, RequestError, Result

STATIC = Path(__file__).parent / "static"


def _error(message: str, status: int = 400, param: str | None = None, code: str | None = None,
           kind: str | None = None) -> Response:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    if status == 404 and code is None:
        code = "not_found"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(json.dumps(body), status=status, mimetype="application/json")


def _llama_error(message: str, status: int, kind: str) -> Response:
    """llama-server's own error body (format_error_response), for the refusals that copy its words."""
    body = {"error": {"code": status, "message": message, "type": kind}}
    return Response(json.dumps(body), status=status, mimetype="application/json")


class LlamaError(Exception):
    """A refusal in llama-server's words and body (e.g. 501 not_supported_error)."""

    def __init__(self, message: str, status: int = 501, kind: str = "not_supported_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


# --- request parsing: strict types, the parameter named in every complaint -----------------------------------

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way a JSON text can carry a UTF-16 surrogate


def _check_content_type() -> None:
    """JSON bodies only. A missing Content-Type counts as JSON (as llama-server takes it), and so does
    application/x-www-form-urlencoded: it is what `curl -d` and urllib send when no type is given, and the
    llama-server habit `curl URL -d '{"prompt": ...}'` must keep working (the body is still parsed as JSON)."""
    header = request.headers.get("Content-Type", "").strip()
    if not header:
        return
    from werkzeug.http import parse_options_header
    mimetype, options = parse_options_header(header)
    if mimetype.lower() == "application/x-www-form-urlencoded":
        return
    if mimetype.lower() != "application/json":
        raise RequestError(f"Content-Type {mimetype or header!r} is not JSON: send the body as application/json",
                           status=415, code="unsupported_media_type")
    charset = options.get("charset")
    if charset and charset.lower().replace("-", "").replace("_", "") != "utf8":
        raise RequestError(f"charset {charset!r}: JSON bodies must be UTF-8", status=415,
                           code="unsupported_media_type")


def _lone_surrogate(body) -> str | None:
    """The place (e.g. 'messages[0].content') of the first string holding an unpaired UTF-16 surrogate, or None.
    Iterative: the body may nest as deep as the parser allows."""
    todo = [(body, "")]
    while todo:
        v, where = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                todo.append((k, where or "body"))
                todo.append((x, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            todo.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _body() -> dict:
    _check_content_type()
    raw = request.get_data(cache=True)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}") \
            from None
    try:
        body = json.loads(text.removeprefix("\ufeff") or "{}", parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer too long to convert
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the request body nests too deeply to parse") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(body)
        if where is not None:
            raise RequestError(f"'{where}' holds an unpaired UTF-16 surrogate (a \\uD800-\\uDFFF escape without "
                               "its pair), which is not text", where)
    return body


def _get(body: dict, key: str, types, default=None, *, lo=None, hi=None, nullable=True):
    v = body.get(key, default)
    if v is None:
        if not nullable and key in body:
            raise RequestError(f"'{key}' must not be null", key)
        return default
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in (types if isinstance(types, tuple)
                                                                           else (types,)))
    if not ok:
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise RequestError(f"'{key}' must be {names}, got {type(v).__name__}", key)
    if lo is not None and v < lo:
        raise RequestError(f"'{key}' must be >= {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise RequestError(f"'{key}' must be <= {hi}, got {v}", key)
    return v


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        return [s] if s else []
    if isinstance(s, list) and all(isinstance(x, str) for x in s) and len(s) <= 16:
        return [x for x in s if x]
    raise RequestError("'stop' must be a string or a list of at most 16 strings", "stop")


def _logit_bias(engine: Engine, body: dict) -> dict[int, float] | None:
    """llama-server's logit_bias: an object {"token id" or "text": bias} (OpenAI's form) or a list of [token id or
    text, bias] pairs; a bias of false bans the token; a text's tokens all get the bias; ids out of the vocabulary
    and malformed entries are skipped, as llama-server skips them."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if isinstance(lb, dict):
        pairs = list(lb.items())
    elif isinstance(lb, list):
        pairs = [tuple(el) for el in lb if isinstance(el, list) and len(el) == 2]
    else:
        raise RequestError("'logit_bias' must be an object {token: bias} or a list of [token, bias] pairs",
                           "logit_bias")
    n_vocab = engine.llm.n_vocab()
    out: dict[int, float] = {}
    for key, v in pairs:
        if v is False:
            bias = float("-inf")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            bias = float(v)
        else:
            continue
        if isinstance(key, str) and re.fullmatch(r"[+-]?\d+", key.strip() or "x") and isinstance(lb, dict):
            ids = [int(key)]
        elif isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str):
            ids = engine.tokenize(key, add_special=False)
        else:
            continue
        for t in ids:
            if 0 <= t < n_vocab:
                out[t] = bias
    return out or None


def _grammar(engine: Engine, body: dict, chat: bool) -> str | None:
    """GBNF text from 'grammar', 'json_schema' or (chat) 'response_format', as llama-server reads them: json_schema
    wins over grammar on /completion, both at once is refused on chat; response_format {"type": "json_object"}
    (any object, or its 'schema') or {"type": "json_schema", "json_schema": {"schema": ...}}."""
    from llama_cpp.llama_grammar import LlamaGrammar
    grammar = _get(body, "grammar", str, None) or None
    schema = body.get("json_schema")
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise RequestError("'json_schema' must be a JSON schema (an object)", "json_schema")
    if chat:
        if schema is not None and grammar is not None:
            raise RequestError("Cannot use both json_schema and grammar", "grammar")
        rf = body.get("response_format")
        if rf is not None:
            if not isinstance(rf, dict):
                raise RequestError("'response_format' must be an object", "response_format")
            kind = rf.get("type") or ""
            if kind == "json_object":
                if "schema" in rf or not schema:
                    schema = rf.get("schema") or {}
            elif kind == "json_schema":
                wrapper = rf.get("json_schema") or {}
                schema = wrapper.get("schema", {}) if isinstance(wrapper, dict) else {}
            elif kind != "text":
                raise RequestError('response_format type must be one of "text" or "json_object", but got: '
                                   + str(kind), "response_format")
            if not isinstance(schema, (dict, bool)):
                raise RequestError("'response_format': the schema must be an object", "response_format")
    elif grammar is not None:
        schema = None  # llama-server's /completion: json_schema only counts without a grammar
    if schema is not None:
        if schema == {}:
            schema = {"type": "object"}  # an empty schema means any object
        try:
            grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)._grammar
        except Exception as e:  # noqa: BLE001 - the converter raises several kinds on a schema it cannot take
            raise RequestError(f'"json_schema": {e}', "response_format" if chat else "json_schema") from None
    if grammar is not None:
        engine.check_grammar(grammar, "grammar")
    return grammar


# llama-server's defaults for what a request does not say (serve's -n, --seed, --temp, --top-k, --top-p, --min-p,
# --repeat-penalty change them); n_predict and seed -1: unlimited (to the end of the context), random
DEFAULTS = {"n_predict": -1, "seed": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0}
PUBLIC = ("/health", "/v1/health", "/")  # what --api-key leaves open, as llama-server does
# content parts a model without a multimodal projector refuses, in llama-server's words (the kind of input)
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}


def _sampling(body: dict, d: dict, temperature_hi: float | None = None) -> dict:
    """The sampling fields of a request, each defaulting to the server's."""
    penalty = float(_get(body, "repeat_penalty", (int, float), d["repeat_penalty"], lo=0))
    if penalty <= 0:
        raise RequestError(f"'repeat_penalty' must be > 0, got {body['repeat_penalty']}", "repeat_penalty")
    seed = _get(body, "seed", int, d["seed"])
    return dict(temperature=float(_get(body, "temperature", (int, float), d["temperature"], lo=0,
                                          hi=temperature_hi if "temperature" in body else None)),
                top_p=float(_get(body, "top_p", (int, float), d["top_p"], lo=0, hi=1)),
                top_k=int(_get(body, "top_k", int, d["top_k"], lo=0)),
                min_p=float(_get(body, "min_p", (int, float), d["min_p"], lo=0, hi=1)),
                repeat_penalty=penalty, seed=None if seed < 0 else seed)


def create_app(engine: Engine, *, model_path: str = "", stats=None, names: tuple[str, ...] = (),
               defaults: dict | None = None, api_keys: tuple[str, ...] = (), webui: bool = True,
               start_time: int | None = None, slots: bool = True) -> Flask:
    """`stats()` -> the expert-pack counters (dict), or None when no pack is used. A request's `model` may name
    anything: the loaded model serves it, as llama-server does (`names`, the alias and the file are kept for
    compatibility). `defaults` overrides DEFAULTS for requests that do not say;
    with `api_keys`, every endpoint but PUBLIC's needs one of them (401 otherwise); `webui=False` drops the chat
    page; `slots=False` answers /slots with llama-server's 501; every response carries
    `Process-Start-Time-Unix: start_time` (now, if not given). Embeddings are served when the engine's context was
    made with them (serve --embedding), else llama-server's 501."""
    app = Flask(__name__, static_folder=None)
    app.config["JSON_SORT_KEYS"] = False
    app.config["engine"] = engine
    started = int(time.time()) if start_time is None else int(start_time)
    d = {**DEFAULTS, **(defaults or {})}
    default_n = None if d["n_predict"] < 0 else d["n_predict"]

    @app.before_request
    def check_api_key():
        if not api_keys or request.path in PUBLIC:
            return None
        key = request.headers.get("Authorization") or request.headers.get("X-Api-Key") or ""
        key = key.removeprefix("Bearer ")
        if key in api_keys:
            return None
        # llama-server's body, word for word
        body = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
        return Response(json.dumps(body), status=401, mimetype="application/json")

    @app.after_request
    def start_time_header(resp: Response) -> Response:
        resp.headers["Process-Start-Time-Unix"] = str(started)
        return resp

    def check_model(body: dict) -> None:
        # llama-server serves whatever model a request names with the one it has loaded (no 404)
        _get(body, "model", str, None)

    def disconnected():
        probe = request.environ.get("waitress.client_disconnected")
        return probe if probe is not None else (lambda: False)

    @app.errorhandler(RequestError)
    def on_request_error(e: RequestError):
        return _error(str(e), e.status, e.param, e.code)

    @app.errorhandler(LlamaError)
    def on_llama_error(e: LlamaError):
        return _llama_error(str(e), e.status, e.kind)

    @app.errorhandler(Cancelled)
    def on_cancelled(e: Cancelled):
        if engine.stopping:
            return _error("the server is stopping", 503, code="unavailable", kind="unavailable_error")
        # the client of a non-streamed request went away: nobody reads this reply, and it is no error of the
        # server's (nginx's 499, "client closed request"); no traceback either
        return _error("the client disconnected", 499, code="cancelled")

    @app.errorhandler(404)
    def on_404(e):
        return _error(f"no such endpoint: {request.method} {request.path}", 404)

    @app.errorhandler(405)
    def on_405(e):
        return _error(f"{request.method} is not allowed on {request.path}", 405)

    @app.errorhandler(Exception)
    def on_exception(e):
        from werkzeug.exceptions import HTTPException
        if isinstance(e, HTTPException):
            return _error(e.description or e.name, e.code or 500)
        app.logger.exception("request failed")
        return _error(f"internal error: {type(e).__name__}: {e}", 500)

    def sse(events, named: bool = False, error_event: str | None = None):
        """A stream of `data:` events; `named`: the events are (name, data) pairs, sent with an `event:` line
        (Anthropic's and the Responses API's). A failure after the status is sent is said in the stream, as
        llama-server does: `data: {"error"}`, or with `error_event`, that event with {"type", "error"}."""
        def gen():
            try:
                for ev in events:
                    if named:
                        yield f"event: {ev[0]}\ndata: {json.dumps(ev[1])}\n\n"
                    else:
                        yield f"data: {json.dumps(ev)}\n\n"
            except Cancelled:
                return
            except Exception as e:  # noqa: BLE001 - the status is sent: say it in the stream, as llama-server does
                app.logger.exception("stream failed")
                err = {"message": f"internal error: {type(e).__name__}: {e}", "type": "server_error", "param": None,
                       "code": None}
                if error_event:
                    yield f"event: {error_event}\ndata: {json.dumps({'type': 'error', 'error': err})}\n\n"
                else:
                    yield f"data: {json.dumps({'error': err})}\n\n"
        return Response(gen(), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- OpenAI --------------------------------------------------------------------------------------------
    @app.get("/v1/models")
    @app.get("/models")
    def models():
        return {"object": "list", "data": [{"id": engine.alias, "object": "model", "created": started,
                                            "owned_by": "expert-pack"}]}

    def prompts_of(body: dict, key: str = "prompt") -> list[list[int]]:
        """llama-server's tokenize_input_prompts: a string, a list of token ids, a list of strings and token ids
        (mixed), {"prompt_string": ...}, or a list of those (several prompts)."""
        p = body.get(key)
        if p is None:
            raise RequestError(f'"{key}" is required', key)

        def one(x, where):
            if isinstance(x, dict):
                if "multimodal_data" in x:
                    raise RequestError("Multimodal data provided, but model does not support multimodal requests.",
                                       key)
                if "prompt_string" not in x:
                    raise RequestError(f"'{where}' must be a string, a list of tokens, a JSON object containing a "
                                       "prompt string, or a list of mixed strings & tokens", key)
                x = x["prompt_string"]
            return engine.tokenize_mixed(x, key)
        if isinstance(p, list) and not any(isinstance(x, int) and not isinstance(x, bool) for x in p):
            if not p:
                raise RequestError(f'"{key}" must not be empty', key)
            return [one(x, f"{key}[{i}]") for i, x in enumerate(p)]
        return [one(p, key)]

    def max_tokens_of(body: dict, default):
        mt = _get(body, "max_completion_tokens", int, None, lo=0)
        if mt is None:
            mt = _get(body, "max_tokens", int, default, lo=0)
        return mt

    def extras(body: dict, chat: bool = False) -> dict:
        """logit_bias and the grammar (grammar, json_schema, response_format) of a request."""
        return dict(logit_bias=_logit_bias(engine, body), grammar=_grammar(engine, body, chat))

    def run_all(prompts, budgets, kw):
        """One generation per prompt, in turn (one lane): (index, prompt, Result, pieces iterator), made lazily
        (a stream runs them after the request context is gone: what they need of it is taken now)."""
        environ, gone = request.environ, disconnected()
        n_prompt = sum(len(p) for p in prompts)

        def gen():
            for i, (prompt, n) in enumerate(zip(prompts, budgets)):
                r = Result()
                environ["expert_pack.usage"] = (n_prompt, r)
                yield i, prompt, r, engine.generate(prompt, n, r, cancelled=gone, **kw)
        return gen()

    @app.post("/v1/completions")
    def completions():
        body = _body()
        check_model(body)
        if _get(body, "echo", bool, False):
            raise RequestError("Only no echo is supported", "echo")
        for name in ("best_of", "suffix"):
            if name in body:
                raise RequestError(f"Unsupported param: {name}", name)
        prompts = prompts_of(body)
        n_asked = _get(body, "n_predict", int, None, lo=-1)  # llama-server's n_predict wins over max_tokens
        asked = max_tokens_of(body, None) if n_asked is None else (None if n_asked == -1 else n_asked)
        budgets = [engine.check_budget(len(p), asked, "max_tokens", default_n) for p in prompts]
        kw = dict(_sampling(body, d, 2), stop=_stop(body), ignore_eos=_get(body, "ignore_eos", bool, False),
                  **extras(body))
        stream = _get(body, "stream", bool, False)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(i, text, finish):
            return {"id": cid, "object": "text_completion", "created": created, "model": engine.alias,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}

        runs = run_all(prompts, budgets, kw)
        if not stream:
            choices, results = [], []
            for i, prompt, r, pieces in runs:
                for _ in pieces:
                    pass
                choices.append(chunk(i, r.text, _finish(r))["choices"][0])
                results.append((prompt, r))
            out = chunk(0, "", None)
            out["choices"] = choices
            out["usage"] = _usage_all(results)
            out["timings"] = results[-1][1].timings.as_dict()
            return out

        def events():
            results = []
            for i, prompt, r, pieces in runs:
                for piece in pieces:
                    yield chunk(i, piece, None)
                results.append((prompt, r))
                last = chunk(i, "", _finish(r))
                last["timings"] = r.timings.as_dict()
                if i == len(prompts) - 1:
                    last["usage"] = _usage_all(results)
                yield last
        return _sse_done(sse(events()))

    def chat_request(body: dict, allow_empty: bool = False) -> tuple[str, list[str]]:
        """The prompt text and the template's stop strings of a chat request, as llama-server's
        oaicompat_chat_params_parse reads messages, add_generation_prompt and continue_final_message (a trailing
        assistant message is continued: the assistant prefill). `allow_empty`: no messages is a prompt too (the
        template's generation prompt), as llama-server takes the converted Anthropic and Responses requests."""
        messages = body.get("messages")
        if messages is None:
            raise RequestError("'messages' is required", "messages")
        if not isinstance(messages, list) or not (messages or allow_empty):
            raise RequestError("'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
            if m["role"] != "assistant" and "content" not in m:
                raise RequestError("All non-assistant messages must contain 'content'", f"messages[{i}]")
            if m["role"] == "assistant" and "content" not in m and "tool_calls" not in m:
                raise RequestError("Assistant message must contain either 'content' or 'tool_calls'!",
                                   f"messages[{i}]")
            c = m.get("content")
            if isinstance(c, list):  # content parts: keep the text ones
                media = next((p["type"] for p in c if isinstance(p, dict) and isinstance(p.get("type"), str)
                              and p["type"] in MEDIA_PARTS), None)
                if media is not None:  # llama-server's words and status (a model without a projector)
                    raise RequestError(f"{MEDIA_PARTS[media]} input is not supported - hint: if this is unexpected, "
                                       "you may need to provide the mmproj", f"messages[{i}]", status=500)
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in c):
                    raise RequestError(f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
                messages[i] = {**m, "content": "".join(p["text"] for p in c)}
            elif not isinstance(c, str) and c is not None:
                raise RequestError(f"messages[{i}].content must be a string", f"messages[{i}]")
        add_gen = _get(body, "add_generation_prompt", bool, True)
        cfm = body.get("continue_final_message")
        cont = cfm is True or cfm in ("content", "reasoning_content")
        # llama-server's prefill_assistant (on by default)
        if not cont and messages and messages[-1]["role"] == "assistant":
            if len(messages) >= 2 and messages[-2]["role"] == "assistant":
                raise RequestError("Cannot have 2 or more assistant messages at the end of the list.", "messages")
            cont, add_gen = True, False
        if cont and add_gen:
            raise RequestError("Cannot set both add_generation_prompt and continue_final_message to true.",
                               "continue_final_message")
        if cont and not messages:
            raise RequestError("continue_final_message: there is no message to continue", "continue_final_message")
        if cont and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
            raise RequestError("Cannot continue an assistant message that contains tool calls.",
                               "continue_final_message")
        return engine.chat_prompt(messages, add_generation_prompt=add_gen, continue_final=cont)

    def chat_tokens(body: dict, allow_empty: bool = False) -> tuple[list[int], list[str]]:
        """A chat request's prompt tokens (the BOS added where the model wants one and the template left it out)
        and the template's stop strings."""
        text, template_stop = chat_request(body, allow_empty)
        prompt = engine.tokenize(text, add_special=False)
        if prompt and engine.llm.token_bos() >= 0 and engine.llm._model.add_bos_token() and \
                prompt[0] != engine.llm.token_bos():
            prompt = [engine.llm.token_bos()] + prompt
        return prompt, template_stop

    def chat_generation(body: dict, allow_empty: bool = False, default: int | None = default_n,
                        budget_param: str = "max_tokens"):
        """Start a chat request's generation (the chat path every chat-like endpoint shares: template, budget,
        sampling, stop strings, grammar): (prompt tokens, Result, pieces iterator). `default`: the tokens to generate
        when the request does not say (within the context); `budget_param`: the field a budget error names."""
        prompt, template_stop = chat_tokens(body, allow_empty)
        n = engine.check_budget(len(prompt), max_tokens_of(body, None), budget_param, default)
        kw = dict(_sampling(body, d, 2), stop=_stop(body) + template_stop, **extras(body, chat=True))
        r = Result()
        request.environ["expert_pack.usage"] = (len(prompt), r)
        return prompt, r, engine.generate(prompt, n, r, cancelled=disconnected(), **kw)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    def chat_completions():
        body = _body()
        check_model(body)
        stream = _get(body, "stream", bool, False)
        prompt, r, pieces = chat_generation(body)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if not stream:
            for _ in pieces:
                pass
            return {"id": cid, "object": "chat.completion", "created": created, "model": engine.alias,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                                 "logprobs": None, "finish_reason": _finish(r)}],
                    "usage": _usage(prompt, r), "timings": r.timings.as_dict()}

        def chunk(delta, finish):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.alias,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def events():
            yield chunk({"role": "assistant", "content": ""}, None)
            for piece in pieces:
                yield chunk({"content": piece}, None)
            last = chunk({}, _finish(r))
            last["usage"] = _usage(prompt, r)
            last["timings"] = r.timings.as_dict()
            yield last
        return _sse_done(sse(events()))

    @app.post("/apply-template")
    def apply_template():
        body = _body()
        text, _ = chat_request(body)
        return {"prompt": text}

    # --- token counting: the prompt a request would have, without generating (llama-server's
    # handle_count_tokens; "object" on the OpenAI ones) ----------------------------------------------------------
    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    def chat_input_tokens():
        body = _body()
        return {"input_tokens": len(chat_tokens(body)[0]), "object": "response.input_tokens"}

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    def responses_input_tokens():
        body = _body()
        return {"input_tokens": len(chat_tokens(responses.to_chat(body), allow_empty=True)[0]),
                "object": "response.input_tokens"}

    @app.post("/v1/messages/count_tokens")
    def anthropic_count_tokens():
        body = _body()
        return {"input_tokens": len(chat_tokens(anthropic.to_chat(body), allow_empty=True)[0])}

    # --- Anthropic's Messages API and OpenAI's Responses API, over the chat path -------------------------------
    @app.post("/v1/messages")
    def anthropic_messages():
        body = _body()
        check_model(body)
        chat = anthropic.to_chat(body)
        stream = _get(chat, "stream", bool, False)
        # no max_tokens: llama-server's 4096, within the context and the server's -n
        default = anthropic.DEFAULT_MAX_TOKENS if default_n is None else min(default_n, anthropic.DEFAULT_MAX_TOKENS)
        prompt, r, pieces = chat_generation(chat, allow_empty=True, default=default)
        cid = f"chatcmpl-{_random_id()}"  # llama-server's id for every chat-like reply
        if not stream:
            for _ in pieces:
                pass
            return anthropic.message(cid, engine.alias, len(prompt), r)
        return sse(anthropic.events(cid, engine.alias, len(prompt), r, pieces), named=True, error_event="error")

    @app.post("/v1/responses")
    @app.post("/responses")
    def responses_create():
        body = _body()
        check_model(body)
        chat = responses.to_chat(body)
        stream = _get(chat, "stream", bool, False)
        prompt, r, pieces = chat_generation(chat, allow_empty=True, budget_param="max_output_tokens"
                                            if body.get("max_output_tokens") is not None else "max_tokens")
        rid, mid, created = f"resp_{_random_id()}", f"msg_{_random_id()}", int(time.time())
        if not stream:
            for _ in pieces:
                pass
            return responses.response(rid, mid, engine.alias, len(prompt), r, created)
        return sse(responses.events(rid, mid, engine.alias, len(prompt), r, pieces, created), named=True)

    # --- llama-server ----------------------------------------------------------------------------------------
    @app.post("/completion")
    @app.post("/completions")
    @app.post("/completions/llama")
    def llama_completion():
        body = _body()
        prompts = prompts_of(body)
        asked = _get(body, "n_predict", int, None, lo=-1)  # -1: to the end of the context; none: the server's -n
        budgets = [engine.check_budget(len(p), None if asked is None or asked == -1 else asked, "n_predict",
                                       default_n if asked is None else None) for p in prompts]
        n_predict = d["n_predict"] if asked is None else asked
        kw = dict(_sampling(body, d), stop=_stop(body), ignore_eos=_get(body, "ignore_eos", bool, False),
                  **extras(body))
        settings = {"n_predict": n_predict, **{k: v for k, v in kw.items() if k not in ("logit_bias", "grammar")},
                    "logit_bias": [[t, b if b != float("-inf") else False] for t, b in (kw["logit_bias"] or {}).items()],
                    "grammar": kw["grammar"] or "", "n_ctx": engine.n_ctx}
        stream = _get(body, "stream", bool, False)

        def final(i, prompt, r, content):
            st = _stop_type(r)
            return {"index": i, "content": content, "tokens": [], "id_slot": r.slot, "stop": True, "model": engine.alias,
                    "tokens_predicted": r.timings.predicted_n, "tokens_evaluated": len(prompt),
                    "generation_settings": settings, "prompt": engine.llm.detokenize(prompt).decode("utf-8", "replace"),
                    "has_new_line": "\n" in r.text, "truncated": False, "stop_type": st,
                    "stopped_eos": st == "eos", "stopped_word": st == "word", "stopped_limit": st == "limit",
                    "stopping_word": r.stopping_word, "tokens_cached": len(prompt) + r.timings.predicted_n,
                    "timings": r.timings.as_dict()}

        runs = run_all(prompts, budgets, kw)
        if not stream:
            out = []
            for i, prompt, r, pieces in runs:
                for _ in pieces:
                    pass
                out.append(final(i, prompt, r, r.text))
            return out[0] if len(out) == 1 else Response(json.dumps(out), mimetype="application/json")

        def events():
            for i, prompt, r, pieces in runs:
                for piece in pieces:
                    yield {"index": i, "content": piece, "tokens": [], "stop": False, "id_slot": r.slot,
                           "tokens_predicted": r.timings.predicted_n, "tokens_evaluated": len(prompt)}
                yield final(i, prompt, r, "")
        return sse(events())

    @app.post("/tokenize")
    def tokenize():
        body = _body()
        if "content" not in body:
            return {"tokens": []}  # llama-server's answer to no content
        add_special = _get(body, "add_special", bool, False)
        parse_special = _get(body, "parse_special", bool, True)
        tokens = engine.tokenize_mixed(body["content"], "content", add_special, parse_special)
        if not _get(body, "with_pieces", bool, False):
            return {"tokens": tokens}
        out = []
        for t in tokens:
            raw = engine.piece(t)
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return {"tokens": out}

    @app.post("/detokenize")
    def detokenize():
        body = _body()
        tokens = body.get("tokens", [])
        if not isinstance(tokens, list):
            raise RequestError("'tokens' must be a list of token ids", "tokens")
        return {"content": engine.detokenize(tokens)}

    @app.get("/slots")
    def get_slots():
        if not slots:
            raise LlamaError("This server does not support slots endpoint. Start it with `--slots`")
        lasts = getattr(engine, "slot_last", None) or [engine.last]
        free = [r is None or r.done for r in lasts]
        if request.args.get("fail_on_no_slot") and not any(free):
            raise LlamaError("no slot available", 503, "unavailable_error")
        out = []
        for i, r in enumerate(lasts):
            slot = {"id": i, "n_ctx": engine.n_ctx, "speculative": False,
                    "is_processing": not free[i] if len(lasts) > 1 else engine.busy}
            if r is not None:
                n = r.timings.predicted_n
                slot.update({"id_task": engine.n_tasks - 1, "n_prompt_tokens": r.n_prompt,
                             "n_prompt_tokens_processed": r.timings.prompt_n,
                             "n_prompt_tokens_cache": r.timings.cache_n,
                             "params": {k: v for k, v in r.params.items()},
                             "next_token": [{"has_next_token": not r.done, "has_new_line": "\n" in r.text,
                                             "n_remain": max(0, r.max_tokens - n), "n_decoded": n}]})
            out.append(slot)
        return Response(json.dumps(out), mimetype="application/json")

    # --- embeddings ------------------------------------------------------------------------------------------
    def embeddings(oai: bool):
        import llama_cpp
        if not engine.embedding:
            raise LlamaError("This server does not support embeddings. Start it with `--embeddings`")
        pooled = engine.llm.pooling_type() != llama_cpp.LLAMA_POOLING_TYPE_NONE
        if oai and not pooled:
            raise RequestError("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        body = _body()
        if "input" in body:
            key = "input"
        elif "content" in body:
            key, oai = "content", False  # "content" is not OpenAI's: llama-server answers its own shape
        else:
            raise RequestError('"input" or "content" must be provided')
        fmt = _get(body, "encoding_format", str, "float")
        if fmt not in ("float", "base64"):
            raise RequestError("The format to return the embeddings in. Can be either float or base64",
                               "encoding_format")
        norm = _get(body, "embd_normalize", int, 2)
        inputs = prompts_of(body, key)
        n_ubatch = engine.llm.context_params.n_ubatch
        for tokens in inputs:
            if not tokens:
                raise RequestError("Input content cannot be empty", key)
            if len(tokens) > min(n_ubatch, engine.llm.n_batch):
                raise RequestError(f"input ({len(tokens)} tokens) is too large to process. increase the physical "
                                   f"batch size (current batch size: {min(n_ubatch, engine.llm.n_batch)})", key)
            if len(tokens) > engine.n_ctx:
                raise RequestError(f"input ({len(tokens)} tokens) is larger than the max context size "
                                   f"({engine.n_ctx} tokens). skipping", key, code="context_length_exceeded")
        vectors = engine.embed(inputs, norm)
        if not oai:
            return Response(json.dumps([{"index": i, "embedding": v} for i, v in enumerate(vectors)]),
                            mimetype="application/json")
        import base64
        import struct
        data = []
        for i, v in enumerate(vectors):
            if fmt == "base64":
                blob = base64.b64encode(struct.pack(f"<{len(v[0])}f", *v[0])).decode()
                data.append({"embedding": blob, "index": i, "object": "embedding", "encoding_format": "base64"})
            else:
                data.append({"embedding": v[0], "index": i, "object": "embedding"})
        n = sum(len(t) for t in inputs)
        return {"model": body.get("model") if isinstance(body.get("model"), str) else engine.alias,
                "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n}, "data": data}

    @app.post("/embedding")
    @app.post("/embeddings")
    def llama_embeddings():
        return embeddings(False)

    @app.post("/v1/embeddings")
    def oai_embeddings():
        return embeddings(True)

    @app.get("/health")
    @app.get("/v1/health")
    def health():
        return {"status": "ok"}

    @app.get("/props")
    def props():
        return {"default_generation_settings": {"n_ctx": engine.n_ctx, "model": engine.alias, "params": d},
                "total_slots": engine.n_parallel, "is_sleeping": False, "model_path": model_path, "model_alias": engine.alias,
                "chat_template": engine.llm.metadata.get("tokenizer.chat_template", ""),
                "expert_pack": stats is not None and stats() is not None}

    @app.get("/metrics")
    def metrics():
        return Response(metrics_text(engine, stats() if stats else None),
                        mimetype="text/plain; version=0.0.4")

    # --- chat page -------------------------------------------------------------------------------------------
    if webui:
        @app.get("/")
        def index():
            return Response((STATIC / "index.html").read_text(), mimetype="text/html")

    return app


def _random_id() -> str:
    """llama-server's random_string: 32 letters and digits (the ids of Anthropic and Responses replies)."""
    import secrets
    import string
    alnum = string.digits + string.ascii_uppercase + string.ascii_lowercase
    return "".join(secrets.choice(alnum) for _ in range(32))


def _usage(prompt: list[int], r: Result) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": r.timings.predicted_n,
            "total_tokens": len(prompt) + r.timings.predicted_n,
            "prompt_tokens_details": {"cached_tokens": r.timings.cache_n}}


def _usage_all(results: list[tuple[list[int], Result]]) -> dict:
    """The usage of several prompts' generations together."""
    n_prompt = sum(len(p) for p, _ in results)
    n_gen = sum(r.timings.predicted_n for _, r in results)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": sum(r.timings.cache_n for _, r in results)}}


def _finish(r: Result) -> str:
    return r.finish_reason or "length"


def _stop_type(r: Result) -> str:
    if r.finish_reason == "length":
        return "limit"
    if r.stopping_word:
        return "word"
    return "eos" if r.finish_reason == "stop" else "none"


def _sse_done(resp: Response) -> Response:
    """OpenAI streams end with `data: [DONE]`."""
    inner = resp.response

    def gen():
        yield from inner
        yield "data: [DONE]\n\n"
    resp.response = gen()
    return resp


def metrics_text(engine: Engine, pack: dict | None) -> str:
    """Prometheus text exposition: llama-server's names for the serving figures, expert_pack_* for the pack."""
    t = engine.totals
    rows = [
        ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", t.prompt_tokens),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt process time.", t.prompt_seconds),
        ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
         t.predicted_tokens),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time.", t.predicted_seconds),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         t.predicted_tokens / t.predicted_seconds if t.predicted_seconds else 0.0),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.", getattr(engine, "n_processing", int(engine.busy))),
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", engine.lane.waiting),
        ("llamacpp:n_requests_total", "counter", "Completed or cancelled generations.", t.requests),
        ("llamacpp:n_requests_cancelled_total", "counter", "Generations stopped by a disconnect.", t.cancelled),
    ]
    if pack is not None:
        help_ = {"cache_hits": "Selected experts found in the cache.",
                 "cache_misses": "Selected experts read from the pack.",
                 "cache_evictions": "Experts evicted from the cache.",
                 "pack_read_bytes": "Bytes read from the pack.",
                 "h2d_bytes": "Bytes copied host to device.",
                 "fallback_count": "Experts not served from the cache path.",
                 "io_errors": "Failed pack reads.", "steps": "Graph steps that used the pack.",
                 "ram_hits": "Cache misses served from the host-RAM tier (no pack read).",
                 "ram_misses": "Cache misses read from the pack (every miss when the RAM tier is off).",
                 "ram_evictions": "Expert blocks evicted from the host-RAM tier.",
                 "ram_spills": "Experts the device cache evicted, copied back into the host-RAM tier.",
                 "prefetch_issued": "Next-layer prefetch reads queued.",
                 "prefetch_used": "Prefetched experts a cache miss then took from the RAM tier.",
                 "prefetch_wasted": "Prefetched experts dropped before any use.",
                 "prefetch_cancelled": "Prefetch reads dropped before they started.",
                 "predicted": "Experts predicted for the next layer.",
                 "predicted_correct": "Predicted experts that the next layer selected."}
        for k, h in help_.items():
            if k in pack:
                rows.append((f"expert_pack_{k}_total", "counter", h, pack[k]))
        for k, h in (("acquire_ms", "Time in the acquire op (lookups, reads, copies)."),
                     ("read_ms", "Time spent reading the pack."),
                     ("copy_wait_ms", "Time waiting for staging buffers and copies."),
                     ("prefetch_wait_ms", "Time the graph's expert ops waited for running prefetch reads.")):
            if k in pack:
                rows.append((f"expert_pack_{k[:-3]}_seconds_total", "counter", h, float(pack[k]) / 1e3))
        for k, h in (("ram_blocks", "Expert blocks the host-RAM tier holds (0: off)."),
                     ("ram_bytes", "Bytes of the host-RAM tier (pinned on a GPU).")):
            if k in pack:
                rows.append((f"expert_pack_{k}", "gauge", h, pack[k]))
        hits, misses = pack.get("cache_hits", 0), pack.get("cache_misses", 0)
        rows.append(("expert_pack_hit_ratio", "gauge", "cache_hits / (cache_hits + cache_misses).",
                     hits / (hits + misses) if hits + misses else 0.0))
        # each device's own cache (llama.cpp's layer split gives every device the layers it runs), label `device`
        devices = pack.get("devices") or []
        for k, kind, h in (("cache_hits", "counter", "Selected experts found in this device's cache."),
                           ("cache_misses", "counter", "Selected experts loaded into this device's cache."),
                           ("cache_evictions", "counter", "Experts evicted from this device's cache."),
                           ("h2d_bytes", "counter", "Bytes copied into this device's cache."),
                           ("slots_per_layer", "gauge", "Expert slots per layer on this device."),
                           ("cache_bytes", "gauge", "Bytes of this device's expert cache.")):
            if devices:
                name = f"expert_pack_device_{k}" + ("_total" if kind == "counter" else "")
                rows.append((name, kind, h, [(d["device"], d.get(k, 0)) for d in devices]))
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        samples = value if isinstance(value, list) else [(None, value)]
        for label, v in samples:
            full = name if label is None else f'{name}{{device="{_label(label)}"}}'
            out.append(f"{full} {float(v):g}" if isinstance(v, float) else f"{full} {v}")
    return "\n".join(out) + "\n"


def _label(text: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
