"""The generation engine behind the server: one model, one generation at a time, waiting requests served in
arrival order, every generation cancellable between tokens.

llama.cpp's context is not reentrant, so the server runs a single lane; a ticket lock (not a plain Lock, whose
wake-up order is unspecified) makes the waiting order the arrival order. The token loop is the server's own and
does no per-token work on the vocabulary in Python: sampling is one llama.cpp sampler chain per request
(sampling.py: llama-cpp-python's chain and order, so seeds give its tokens), text and stop strings are incremental
(text_stream.py), and each token is decoded through llama-cpp-python's `eval`, which keeps the token history that
the next request's prompt prefix is matched against."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .sampling import Sampler, piece_reader
from .text_stream import TextStream


class RequestError(ValueError):
    """Bad input: becomes a 4xx with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Cancelled(Exception):
    """The client went away; the generation stopped at a token boundary."""


class TicketLock:
    """A FIFO lock: acquirers are served in the order they arrived."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0
        self._serving = 0

    @property
    def waiting(self) -> int:
        with self._cv:
            return max(0, self._next - self._serving - 1)

    def acquire(self) -> None:
        with self._cv:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cv.wait()

    def release(self) -> None:
        with self._cv:
            self._serving += 1
            self._cv.notify_all()


@dataclass
class Timings:
    cache_n: int = 0      # prompt tokens reused from the previous generation's cache (not evaluated again)
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0

    def as_dict(self) -> dict:
        def per_tok(ms, n):
            return ms / n if n else 0.0

        def per_s(ms, n):
            return 1e3 * n / ms if ms > 0 else 0.0
        return {
            "cache_n": self.cache_n, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": per_tok(self.prompt_ms, self.prompt_n),
            "prompt_per_second": per_s(self.prompt_ms, self.prompt_n),
            "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": per_tok(self.predicted_ms, self.predicted_n),
            "predicted_per_second": per_s(self.predicted_ms, self.predicted_n),
        }


@dataclass
class Result:
    """Filled in while a generation streams; complete once its iterator ends."""
    text: str = ""
    finish_reason: str | None = None   # "stop" (EOS or stop string) or "length"
    stopping_word: str = ""
    timings: Timings = field(default_factory=Timings)
    n_prompt: int = 0
    max_tokens: int = 0
    params: dict = field(default_factory=dict)
    done: bool = False
    slot: int = 0         # the slot that runs it (serve --parallel)


@dataclass
class Totals:
    """Counters since start, for /metrics."""
    requests: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    last_predicted_per_second: float = 0.0
    last_prompt_per_second: float = 0.0


class Engine:
    def __init__(self, llm, alias: str):
        self.llm = llm
        self.alias = alias
        self.n_ctx = llm.n_ctx()
        self.lane = TicketLock()
        self.busy = False
        self.stopping = False  # set once by stop(): every generation, running or waiting, ends at its next token
        self.totals = Totals()
        self._totals_lock = threading.Lock()
        vocab = llm._model.vocab
        import llama_cpp
        n_vocab = llm.n_vocab()
        self._eog = np.array([t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)], dtype=np.int64)
        eog = frozenset(self._eog.tolist())
        self._is_eog = eog.__contains__
        self._piece = piece_reader(llm)
        self.n_tasks = 0              # generations started (/slots' id_task)
        self.last: Result | None = None  # the running or last generation (/slots)
        self.n_parallel = 1
        # the context was made with embeddings on (serve --embedding): they are switched on for an embedding
        # request only, so that generations get their logits (as llama-server switches them per batch)
        self.embedding = bool(llm.context_params.embeddings)
        if self.embedding:
            llama_cpp.llama_set_embeddings(llm.ctx, False)

    def stop(self) -> None:
        """The server is stopping: cancel the running generation and every waiting one."""
        self.stopping = True

    # ---------------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

    def check_ids(self, tokens: list, param: str) -> None:
        n_vocab = self.llm.n_vocab()
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < n_vocab:
                raise RequestError(f"token {t!r} is not a token id of this model (0..{n_vocab - 1})", param)

    def tokenize_mixed(self, value, param: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama-server's tokenize_mixed: a string, or a list of strings and token ids (only a leading string gets
        the BOS)."""
        if isinstance(value, str):
            return self.tokenize(value, add_special, parse_special)
        if not isinstance(value, list):
            raise RequestError(f"'{param}' must be a string or a list of strings and token ids", param)
        out: list[int] = []
        for i, p in enumerate(value):
            if isinstance(p, str):
                out += self.tokenize(p, add_special and i == 0, parse_special)
            elif isinstance(p, int) and not isinstance(p, bool):
                self.check_ids([p], param)
                out.append(p)
            else:
                raise RequestError(f"'{param}[{i}]' must be a string or a token id, got {type(p).__name__}", param)
        return out

    def piece(self, token: int) -> bytes:
        """A token's text as llama-server's common_token_to_piece (special tokens rendered)."""
        import ctypes
        import llama_cpp
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.llm._model.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.llm._model.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int], param: str = "tokens") -> str:
        self.check_ids(tokens, param)
        return self.llm.detokenize(tokens).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final: bool = False) -> tuple[str, list[str]]:
        """Render OpenAI messages with the model's own chat template (tokenizer.chat_template). `continue_final`:
        the last message is continued (llama-server's assistant prefill): the others are rendered with the
        generation prompt, then the last one's content follows, open."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        template = self.llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        eos = self.llm._model.token_get_text(self.llm.token_eos()) if self.llm.token_eos() >= 0 else ""
        bos = self.llm._model.token_get_text(self.llm.token_bos()) if self.llm.token_bos() >= 0 else ""
        head, tail = (messages[:-1], messages[-1].get("content") or "") if continue_final else (messages, "")
        fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                  add_generation_prompt=add_generation_prompt or continue_final)
        try:
            r = fmt(messages=head)
        except Exception as e:  # a template error is the request's fault (odd roles, missing content)
            raise RequestError(f"chat template could not render these messages: {e}", "messages") from e
        stop = r.stop if isinstance(r.stop, list) else ([r.stop] if r.stop else [])
        return r.prompt + tail, stop

    def check_grammar(self, text: str, param: str) -> None:
        """Refuse a GBNF grammar llama.cpp cannot parse (a NULL sampler would crash the generation)."""
        import llama_cpp
        sampler = llama_cpp.llama_sampler_init_grammar(self.llm._model.vocab, text.encode("utf-8"), b"root")
        if not sampler:
            raise RequestError(f"'{param}': failed to parse the grammar (GBNF, with a 'root' rule)", param)
        llama_cpp.llama_sampler_free(sampler)

    def check_budget(self, n_prompt: int, max_tokens: int | None, param: str, default: int | None = None) -> int:
        """The number of tokens to generate: max_tokens; when None, the server's `default` (cut to the rest of the
        context, as the request did not ask for it), or the rest of the context when that is None too."""
        room = self.n_ctx - n_prompt
        if n_prompt == 0:
            raise RequestError("the prompt is empty", "prompt")
        if room <= 0:
            raise RequestError(f"the prompt has {n_prompt} tokens, the context holds {self.n_ctx}; "
                               "shorten it or start the server with a larger -c", "prompt",
                               code="context_length_exceeded")
        if max_tokens is None:
            return room if default is None else min(default, room)
        if max_tokens > room:
            raise RequestError(f"{param}={max_tokens} plus the prompt's {n_prompt} tokens exceeds the "
                               f"context of {self.n_ctx} tokens", param, code="context_length_exceeded")
        return max_tokens

    # ---------------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_tokens: int, result: Result, *, temperature: float = 0.8,
                 top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: list[str] | None = None, ignore_eos: bool = False,
                 logit_bias: dict[int, float] | None = None, grammar: str | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Yield text pieces; fill `result`. Waits for the lane first (in arrival order). `logit_bias`: token id ->
        bias added to its logit (-inf bans it); `grammar`: GBNF text (checked with check_grammar first)."""
        client_gone = cancelled

        def cancelled() -> bool:
            return self.stopping or client_gone()
        self.lane.acquire()
        try:
            if cancelled():
                raise Cancelled()
            self.busy = True
            self.n_tasks += 1
            result.n_prompt, result.max_tokens = len(prompt), max_tokens
            result.params = {"n_predict": max_tokens, "seed": seed, "temperature": temperature, "top_k": top_k,
                             "top_p": top_p, "min_p": min_p, "repeat_penalty": repeat_penalty, "stop": stop or [],
                             "ignore_eos": ignore_eos, "grammar": grammar or ""}
            self.last = result
            yield from self._generate_locked(prompt, max_tokens, result, temperature, top_p, top_k, min_p,
                                             repeat_penalty, seed, stop, ignore_eos, logit_bias, grammar, cancelled)
        except (Cancelled, GeneratorExit):  # GeneratorExit: the WSGI server closed the stream (client gone)
            with self._totals_lock:
                self.totals.cancelled += 1
            raise
        finally:
            result.done = True
            self.busy = False
            self.lane.release()

    def _generate_locked(self, prompt, max_tokens, result, temperature, top_p, top_k, min_p, repeat_penalty, seed,
                         stop, ignore_eos, logit_bias, grammar, cancelled):
        """The token loop: one C sampler chain for the request (server/sampling.py), one decode per token through
        llama-cpp-python's `eval` (which keeps its token history for the next request's prefix reuse), text with
        stop strings from server/text_stream.py; cancellation is checked between tokens."""
        import random

        import llama_cpp
        llm = self.llm
        t = result.timings
        if seed is None:  # as create_completion: the next seed of the model's own sequence
            seed = random.Random(llm._seed).randint(0, 2**32)
        llm.set_seed(seed)
        llama_cpp.llama_perf_context_reset(llm.ctx)
        t0 = time.perf_counter()
        t.cache_n = self._prime(prompt)
        llm.n_tokens = len(prompt) - 1  # the last prompt token is evaluated alone (see _prime)
        sampler = Sampler(llm, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed, logit_bias=logit_bias,
                          ban=self._eog.tolist() if ignore_eos else (), grammar=grammar)
        text = TextStream(stop)
        piece, is_eog, ctx = self._piece, self._is_eog, llm.ctx
        pieces: list[str] = []
        completion: list[int] = []
        t_first = None
        result.finish_reason = "length"
        try:
            llm.eval(prompt[-1:])
            while len(completion) < max_tokens:
                if cancelled():
                    raise Cancelled()
                token = sampler.sample(ctx)
                if t_first is None:
                    t_first = time.perf_counter()
                completion.append(token)
                if is_eog(token):
                    result.finish_reason = "stop"
                    break
                out = text.push(piece(token))
                if out:
                    pieces.append(out)
                    yield out
                if text.stopped_by:
                    result.finish_reason = "stop"
                    break
                if len(completion) < max_tokens:
                    llm.eval([token])
            if not text.stopped_by:
                out = text.finish()
                if out:
                    pieces.append(out)
                    yield out
        finally:
            sampler.close()
            t1 = time.perf_counter()
            result.text = "".join(pieces)
            result.stopping_word = text.stopped_by
            # prompt: tokens actually evaluated (a reused prefix costs nothing), up to the first sample
            t.prompt_n = len(prompt) - t.cache_n
            t.prompt_ms = 1e3 * ((t_first if t_first is not None else t1) - t0)
            t.predicted_n = len(completion)
            t.predicted_ms = 1e3 * (t1 - t_first) if t_first is not None else 0.0
            self._count(t)

    def _count(self, t: Timings) -> None:
        """Add a finished generation's timings to the totals /metrics reports."""
        with self._totals_lock:
            tot = self.totals
            tot.requests += 1
            tot.prompt_tokens += t.prompt_n
            tot.prompt_seconds += t.prompt_ms / 1e3
            tot.predicted_tokens += t.predicted_n
            tot.predicted_seconds += t.predicted_ms / 1e3
            d = t.as_dict()
            tot.last_prompt_per_second = d["prompt_per_second"]
            tot.last_predicted_per_second = d["predicted_per_second"]

    def _prime(self, prompt: list[int]) -> int:
        """Evaluate all of the prompt but its last token, reusing the longest cached prefix; returns how many
        tokens that reused. llama-cpp-python then evaluates the last token alone, as it does when the prompt was
        cached: the first token's logits are computed the same way whether or not the prompt was cached, so that a
        request with a seed gives the same text again (a batch of several tokens rounds differently)."""
        llm = self.llm
        cached = llm._input_ids[:llm.n_tokens].tolist()
        m = 0
        for a, b in zip(cached, prompt):
            if a != b:
                break
            m += 1
        reused = min(m, len(prompt) - 1)
        if m >= len(prompt) - 1:
            return reused
        if m > 0 and llm._ctx.kv_cache_seq_rm(-1, m, -1):
            llm.n_tokens = m
        else:
            llm.reset()
            llm._ctx.kv_cache_clear()
            m = 0
        llm.eval(prompt[m:-1])
        return m

    # ---------------------------------------------------------------------------------------------------
    def embed(self, inputs: list[list[int]], normalize: int = 2) -> list[list[list[float]]]:
        """Each input's embedding: one pooled vector, or one per token where the context pools none. Runs in
        the lane like a generation (embeddings on for it only; the cached prompt is dropped). `normalize` as
        llama-server's embd_normalize: -1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, >2 p-norm."""
        import llama_cpp
        llm = self.llm
        pooled = llm.pooling_type() != llama_cpp.LLAMA_POOLING_TYPE_NONE
        n_embd = llm.n_embd()
        out = []
        self.lane.acquire()
        try:
            if self.stopping:
                raise Cancelled()
            self.busy = True
            llama_cpp.llama_set_embeddings(llm.ctx, True)
            for tokens in inputs:
                llm._ctx.kv_cache_clear()
                llm._batch.reset()
                llm._batch.add_sequence(tokens, 0, True)
                llm._ctx.decode(llm._batch)
                if pooled:
                    ptr = llama_cpp.llama_get_embeddings_seq(llm.ctx, 0)
                    vecs = [np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)]
                else:
                    ptr = llama_cpp.llama_get_embeddings(llm.ctx)
                    vecs = list(np.ctypeslib.as_array(ptr, shape=(len(tokens), n_embd)).astype(np.float64))
                out.append([_normalized(v, normalize).tolist() for v in vecs])
        finally:
            llama_cpp.llama_set_embeddings(llm.ctx, False)
            llm._batch.reset()
            llm._ctx.kv_cache_clear()
            llm.reset()
            self.busy = False
            self.lane.release()
        return out


def _normalized(v: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize."""
    if norm < 0:
        return v
    if norm == 0:
        s = np.abs(v).max() / 32760.0
    elif norm == 1:
        s = np.abs(v).sum()
    elif norm == 2:
        s = np.sqrt((v * v).sum())
    else:
        s = (np.abs(v) ** norm).sum() ** (1.0 / norm)
    return v / s if s > 0 else np.zeros_like(v)
