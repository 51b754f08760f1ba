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

from .engine import Cancelled, Engine, RequestError, Result

STATIC = Path(__file__).parent / "static"


def _error(message: str, status: int = 400, param: str | None = None, code: str | None = None,
           kind: str | None = None) -> Response:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    if status == 404 and code is None:
        code = "not_found"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(json.dumps(body), status=status, mimetype="application/json")


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


# llama-server's defaults for what a request does not say (serve's -n, --seed, --temp, --top-k, --top-p, --min-p,
# --repeat-penalty change them); n_predict and seed -1: unlimited (to the end of the context), random
DEFAULTS = {"n_predict": -1, "seed": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0}
PUBLIC = ("/health", "/v1/health", "/")  # what --api-key leaves open, as llama-server does


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
               start_time: int | None = None) -> Flask:
    """`stats()` -> the expert-pack counters (dict), or None when no pack is used. Requests may name the model by its
    alias, its file's name or path, or any of `names`. `defaults` overrides DEFAULTS for requests that do not say;
    with `api_keys`, every endpoint but PUBLIC's needs one of them (401 otherwise); `webui=False` drops the chat
    page; every response carries `Process-Start-Time-Unix: start_time` (now, if not given)."""
    app = Flask(__name__, static_folder=None)
    app.config["JSON_SORT_KEYS"] = False
    app.config["engine"] = engine
    started = int(time.time()) if start_time is None else int(start_time)
    accepted = {engine.alias, Path(model_path).name, model_path, *names}
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
        name = _get(body, "model", str, None)
        if name is not None and name not in accepted:
            raise RequestError(f"The model '{name}' does not exist; this server serves '{engine.alias}'", "model",
                               status=404, code="model_not_found")

    def disconnected():
        probe = request.environ.get("waitress.client_disconnected")
        return probe if probe is not None else (lambda: False)

    @app.errorhandler(RequestError)
    def on_request_error(e: RequestError):
        return _error(str(e), e.status, e.param, e.code)

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

    def sse(events):
        def gen():
            try:
                for ev in events:
                    yield f"data: {json.dumps(ev)}\n\n"
            except Cancelled:
                return
            except Exception as e:  # noqa: BLE001 - the status is sent: say it in the stream, as llama-server does
                app.logger.exception("stream failed")
                err = {"message": f"internal error: {type(e).__name__}: {e}", "type": "server_error", "param": None,
                       "code": None}
                yield f"data: {json.dumps({'error': err})}\n\n"
        return Response(gen(), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- OpenAI --------------------------------------------------------------------------------------------
    @app.get("/v1/models")
    @app.get("/models")
    def models():
        return {"object": "list", "data": [{"id": engine.alias, "object": "model", "created": started,
                                            "owned_by": "expert-pack"}]}

    def prompt_tokens(body: dict, one_string_list: bool) -> list[int]:
        """'prompt' as text or token ids (checked); OpenAI also allows a list holding one string."""
        p = body.get("prompt")
        if one_string_list and isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            return engine.tokenize(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            engine.detokenize(p)  # validates the ids
            return list(p)
        raise RequestError("'prompt' must be a string, " + ("a list of one string, " if one_string_list else "")
                           + "or a list of token ids", "prompt")

    def max_tokens_of(body: dict, default):
        mt = _get(body, "max_completion_tokens", int, None, lo=0)
        if mt is None:
            mt = _get(body, "max_tokens", int, default, lo=0)
        return mt

    @app.post("/v1/completions")
    @app.post("/completions")
    def completions():
        body = _body()
        check_model(body)
        prompt = prompt_tokens(body, one_string_list=True)
        n = engine.check_budget(len(prompt), max_tokens_of(body, None), "max_tokens", default_n)
        kw = dict(_sampling(body, d, 2), stop=_stop(body))
        stream = _get(body, "stream", bool, False)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish):
            return {"id": cid, "object": "text_completion", "created": created, "model": engine.alias,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        r = Result()
        request.environ["expert_pack.usage"] = (len(prompt), r)
        pieces = engine.generate(prompt, n, r, cancelled=disconnected(), **kw)
        if not stream:
            for _ in pieces:
                pass
            out = chunk(r.text, r.finish_reason or "length")
            out["usage"] = _usage(prompt, r)
            return out

        def events():
            for piece in pieces:
                yield chunk(piece, None)
            last = chunk("", r.finish_reason or "length")
            last["usage"] = _usage(prompt, r)
            yield last
        return _sse_done(sse(events()))

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    def chat_completions():
        body = _body()
        check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
            c = m.get("content")
            if isinstance(c, list):  # content parts: keep the text ones
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in c):
                    raise RequestError(f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
                messages[i] = {**m, "content": "".join(p["text"] for p in c)}
            elif not isinstance(c, str) and c is not None:
                raise RequestError(f"messages[{i}].content must be a string", f"messages[{i}]")
        text, template_stop = engine.chat_prompt(messages)
        prompt = engine.tokenize(text, add_special=False)
        if prompt and engine.llm.token_bos() >= 0 and engine.llm._model.add_bos_token() and \
                prompt[0] != engine.llm.token_bos():
            prompt = [engine.llm.token_bos()] + prompt
        n = engine.check_budget(len(prompt), max_tokens_of(body, None), "max_tokens", default_n)
        kw = dict(_sampling(body, d, 2), stop=_stop(body) + template_stop)
        stream = _get(body, "stream", bool, False)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        r = Result()
        request.environ["expert_pack.usage"] = (len(prompt), r)
        pieces = engine.generate(prompt, n, r, cancelled=disconnected(), **kw)

        if not stream:
            for _ in pieces:
                pass
            return {"id": cid, "object": "chat.completion", "created": created, "model": engine.alias,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                                 "logprobs": None, "finish_reason": r.finish_reason or "length"}],
                    "usage": _usage(prompt, r), "timings": r.timings.as_dict()}

        def chunk(delta, finish):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.alias,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def events():
            yield chunk({"role": "assistant", "content": ""}, None)
            for piece in pieces:
                yield chunk({"content": piece}, None)
            last = chunk({}, r.finish_reason or "length")
            last["usage"] = _usage(prompt, r)
            last["timings"] = r.timings.as_dict()
            yield last
        return _sse_done(sse(events()))

    # --- llama-server ----------------------------------------------------------------------------------------
    @app.post("/completion")
    @app.post("/completions/llama")
    def llama_completion():
        body = _body()
        prompt = prompt_tokens(body, one_string_list=False)
        asked = _get(body, "n_predict", int, None, lo=-1)  # -1: to the end of the context; none: the server's -n
        n = engine.check_budget(len(prompt), None if asked is None or asked == -1 else asked, "n_predict",
                                default_n if asked is None else None)
        n_predict = d["n_predict"] if asked is None else asked
        kw = dict(_sampling(body, d), stop=_stop(body), ignore_eos=_get(body, "ignore_eos", bool, False))
        stream = _get(body, "stream", bool, False)
        r = Result()
        request.environ["expert_pack.usage"] = (len(prompt), r)
        pieces = engine.generate(prompt, n, r, cancelled=disconnected(), **kw)

        def final(content):
            return {"content": content, "stop": True, "model": engine.alias, "tokens_predicted": r.timings.predicted_n,
                    "tokens_evaluated": len(prompt), "stop_type": _stop_type(r), "stopped_eos":
                    _stop_type(r) == "eos", "stopped_word": bool(r.stopping_word), "stopped_limit":
                    r.finish_reason == "length", "stopping_word": r.stopping_word, "tokens_cached": len(prompt)
                    + r.timings.predicted_n, "generation_settings": {"n_predict": n_predict, **kw,
                                                                     "n_ctx": engine.n_ctx},
                    "timings": r.timings.as_dict()}

        if not stream:
            for _ in pieces:
                pass
            return final(r.text)

        def events():
            for piece in pieces:
                yield {"content": piece, "stop": False}
            yield final("")
        return sse(events())

    @app.post("/tokenize")
    def tokenize():
        body = _body()
        content = _get(body, "content", str, None)
        if content is None:
            raise RequestError("'content' (a string) is required", "content")
        return {"tokens": engine.tokenize(content, add_special=_get(body, "add_special", bool, False))}

    @app.post("/detokenize")
    def detokenize():
        body = _body()
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise RequestError("'tokens' must be a list of token ids", "tokens")
        return {"content": engine.detokenize(tokens)}

    @app.get("/health")
    @app.get("/v1/health")
    def health():
        return {"status": "ok"}

    @app.get("/props")
    def props():
        return {"default_generation_settings": {"n_ctx": engine.n_ctx, "model": engine.alias, "params": d},
                "total_slots": 1, "is_sleeping": False, "model_path": model_path, "model_alias": engine.alias,
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


def _usage(prompt: list[int], r: Result) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": r.timings.predicted_n,
            "total_tokens": len(prompt) + r.timings.predicted_n}


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
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.", int(engine.busy)),
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
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"
                if isinstance(value, float) else f"{name} {value}"]
    return "\n".join(out) + "\n"
