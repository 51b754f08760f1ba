"""Several generations in one batch (`serve --parallel N`, llama-server's slots).

One scheduler thread owns the llama.cpp context. Each step it admits waiting requests into free slots (sequence ids
0..N-1 of one unified KV cache, each slot limited to n_ctx / N tokens as llama-server's slots are), builds one batch
with the next token of every generating slot and as much of the admitted prompts as the batch holds, decodes it once
and samples every slot whose logits it produced, each with its own sampler chain and text stream (sampling.py,
text_stream.py: the same rules as the single-lane engine). With an expert pack, the provider serves the union of
the experts the batch's tokens route to, so a small cache thrashes when the slots' experts differ (docs: `--help`
of --parallel). A request's generator only waits for its text; cancellation is seen by the scheduler before the
next step, and the slot is freed there."""
from __future__ import annotations

import random
import threading
import time
from collections import deque

from .engine import Cancelled, Engine, Result
from .sampling import Sampler
from .text_stream import TextStream


def with_sequences(llm, n: int) -> None:
    """Re-create llm's context for n sequences in one unified KV cache (llama-cpp-python's Llama makes one)."""
    from llama_cpp import _internals
    if n <= 1:
        return
    llm._ctx.close()
    llm.context_params.n_seq_max = n
    llm.context_params.kv_unified = True
    llm._ctx = _internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=llm.verbose)
    llm._stack.callback(llm._ctx.close)


class _Job:
    def __init__(self, prompt, max_tokens, result, kw, cancelled):
        self.prompt, self.max_tokens, self.result, self.kw, self.cancelled = prompt, max_tokens, result, kw, cancelled
        self.cv = threading.Condition()
        self.out: list[str] = []       # text not yet taken by the request's generator
        self.all: list[str] = []       # all of its text
        self.done = False
        self.error: BaseException | None = None
        self.abandoned = False
        self.slot = -1
        self.todo = 0            # prompt tokens not yet in the batch
        self.pos = 0             # tokens of this sequence in the KV cache
        self.idx = -1            # batch row of this step whose logits are this slot's
        self.last = -1           # the sampled token to feed next
        self.completion: list[int] = []
        self.sampler: Sampler | None = None
        self.text: TextStream | None = None
        self.t0 = self.t_first = None

    def emit(self, piece: str) -> None:
        if piece:
            self.all.append(piece)
            with self.cv:
                self.out.append(piece)
                self.cv.notify()


class _Queue:
    """What /metrics' requests_deferred reads (the single-lane engine's TicketLock has the same property)."""

    def __init__(self, pending: deque):
        self._pending = pending

    @property
    def waiting(self) -> int:
        return len(self._pending)


class BatchEngine(Engine):
    def __init__(self, llm, alias: str, n_parallel: int):
        import llama_cpp
        super().__init__(llm, alias)
        if self.embedding:
            raise ValueError("--embedding with --parallel > 1 is not supported; serve embeddings with --parallel 1")
        self.n_parallel = n_parallel
        self.n_ctx = llm.n_ctx() // n_parallel  # each slot's context, as llama-server's slots
        self.jobs: list[_Job | None] = [None] * n_parallel
        self.slot_last: list[Result | None] = [None] * n_parallel   # each slot's running or last generation
        self._pending: deque[_Job] = deque()
        self.lane = _Queue(self._pending)
        self._cv = threading.Condition()
        self._batch = llama_cpp.llama_batch_init(llm.n_batch, 0, n_parallel)
        self._mem = llama_cpp.llama_get_memory(llm.ctx)
        self._thread = threading.Thread(target=self._run, name="expert-pack-slots", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return any(j is not None for j in self.jobs)

    @property
    def n_processing(self) -> int:
        return sum(j is not None for j in self.jobs)

    @busy.setter
    def busy(self, value) -> None:  # Engine.__init__ sets it; here it is derived from the slots
        pass

    def stop(self) -> None:
        super().stop()
        with self._cv:
            self._cv.notify_all()

    # ---------------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_tokens: int, result: Result, *, temperature: float = 0.8,
                 top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: list[str] | None = None, ignore_eos: bool = False,
                 logit_bias: dict[int, float] | None = None, grammar: str | None = None,
                 cancelled=lambda: False):
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
                  seed=seed, stop=stop, ignore_eos=ignore_eos, logit_bias=logit_bias, grammar=grammar)
        result.n_prompt, result.max_tokens = len(prompt), max_tokens
        result.params = {"n_predict": max_tokens, "seed": seed, "temperature": temperature, "top_k": top_k,
                         "top_p": top_p, "min_p": min_p, "repeat_penalty": repeat_penalty, "stop": stop or [],
                         "ignore_eos": ignore_eos, "grammar": grammar or ""}
        job = _Job(prompt, max_tokens, result, kw, cancelled)
        with self._cv:
            self._pending.append(job)
            self._cv.notify_all()
        try:
            while True:
                with job.cv:
                    while not job.out and not job.done:
                        job.cv.wait()
                    pieces, job.out = job.out, []
                    done = job.done
                yield from pieces
                if done:
                    break
            if job.error is not None:
                raise job.error
        except (Cancelled, GeneratorExit):
            with self._totals_lock:
                self.totals.cancelled += 1
            raise
        finally:
            job.abandoned = True
            with self._cv:
                self._cv.notify_all()

    # ---------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self.busy:
                    self._cv.wait()
            try:
                self._admit()
                self._step()
            except Exception as e:  # a failed decode: every running generation fails with it
                for j in self.jobs:
                    if j is not None:
                        self._finish(j, RuntimeError(str(e)))

    def _gone(self, job: _Job) -> bool:
        return self.stopping or job.abandoned or job.cancelled()

    def _admit(self) -> None:
        import llama_cpp
        llm = self.llm
        for i in range(self.n_parallel):
            if self.jobs[i] is not None:
                continue
            with self._cv:
                if not self._pending:
                    return
                job = self._pending.popleft()
            if self._gone(job):
                self._finish(job, Cancelled())
                continue
            kw = job.kw
            seed = kw["seed"]
            if seed is None:  # as the single lane: the next seed of the model's own sequence
                seed = random.Random(llm._seed).randint(0, 2**32)
            llm.set_seed(seed)
            job.sampler = Sampler(llm, temperature=kw["temperature"], top_p=kw["top_p"], top_k=kw["top_k"],
                                  min_p=kw["min_p"], repeat_penalty=kw["repeat_penalty"], seed=seed,
                                  logit_bias=kw["logit_bias"], ban=self._eog.tolist() if kw["ignore_eos"] else (),
                                  grammar=kw["grammar"])
            job.text = TextStream(kw["stop"])
            job.slot, job.todo, job.pos = i, len(job.prompt), 0
            job.result.slot = i
            job.result.finish_reason = "length"
            job.t0 = time.perf_counter()
            llama_cpp.llama_memory_seq_rm(self._mem, i, -1, -1)
            self.jobs[i] = job
            self.slot_last[i] = job.result
            self.n_tasks += 1
            self.last = job.result

    def _step(self) -> None:
        import llama_cpp
        b, cap = self._batch, self.llm.n_batch
        n = 0

        def add(token: int, job: _Job, logits: bool) -> None:
            nonlocal n
            b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, job.pos, 1, logits
            b.seq_id[n][0] = job.slot
            job.pos += 1
            n += 1
        for job in self.jobs:
            if job is not None and self._gone(job):
                self._finish(job, Cancelled())
        for job in self.jobs:  # the next token of every generating slot first: decode never waits for prompts
            if job is not None and job.todo == 0 and job.last >= 0:
                job.idx = n
                add(job.last, job, True)
        for job in self.jobs:
            if job is not None and job.todo > 0 and n < cap:
                k = min(job.todo, cap - n)
                start = len(job.prompt) - job.todo
                for t in job.prompt[start:start + k]:
                    add(t, job, False)
                job.todo -= k
                if job.todo == 0:
                    b.logits[n - 1] = True
                    job.idx = n - 1
        if n == 0:
            return
        b.n_tokens = n
        rc = llama_cpp.llama_decode(self.llm.ctx, b)
        if rc != 0:
            ep = getattr(self.llm, "_expert_pack", None)
            why = f": expert pack: {ep.last_error}" if ep is not None and ep.last_error else ""
            raise RuntimeError(f"llama_decode returned {rc}{why}")
        for job in self.jobs:
            if job is None or job.idx < 0:
                continue
            idx, job.idx = job.idx, -1
            self._sample(job, idx)

    def _sample(self, job: _Job, idx: int) -> None:
        if len(job.completion) >= job.max_tokens:  # max_tokens 0: the prompt is evaluated, nothing generated
            self._finish(job)
            return
        token = job.sampler.sample(self.llm.ctx, idx)
        if job.t_first is None:
            job.t_first = time.perf_counter()
        job.completion.append(token)
        if self._is_eog(token):
            job.result.finish_reason = "stop"
            self._finish(job)
            return
        job.emit(job.text.push(self._piece(token)))
        if job.text.stopped_by:
            job.result.finish_reason = "stop"
            self._finish(job)
        elif len(job.completion) >= job.max_tokens:
            self._finish(job)
        else:
            job.last = token

    def _finish(self, job: _Job, error: BaseException | None = None) -> None:
        t1 = time.perf_counter()
        if job.text is not None and error is None and not job.text.stopped_by:
            job.emit(job.text.finish())
        if job.sampler is not None:
            job.sampler.close()
        r, t = job.result, job.result.timings
        r.stopping_word = job.text.stopped_by if job.text is not None else ""
        t.prompt_n = len(job.prompt)
        t.prompt_ms = 1e3 * ((job.t_first or t1) - (job.t0 or t1))
        t.predicted_n = len(job.completion)
        t.predicted_ms = 1e3 * (t1 - job.t_first) if job.t_first is not None else 0.0
        if job.slot >= 0:
            self.jobs[job.slot] = None
        if job.t0 is not None:
            self._count(t)
        with job.cv:
            r.text = "".join(job.all)
            job.error = error
            job.done = True
            r.done = True
            job.cv.notify_all()
