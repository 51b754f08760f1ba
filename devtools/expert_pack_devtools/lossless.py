"""Run a model through llama.cpp with and without an expert pack: `run` collects the logits of a prompt and
greedy decode steps (lossless checks in the tests and the GPU script); `Session` keeps a model and a context
for timed or repeated requests (benchmarks, fault tests)."""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import numpy as np

from ggml_expert_pack.packer.format import ALIGNMENT, load_manifest

ARENA_TAIL_PAD = 64 * 1024  # ggml_expert_pack/src/arena.h


def slot_stride(layer: dict) -> int:
    """The cache's bytes per slot of a manifest layer (mirrors slot_stride_for in src/arena.cpp)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    unit = 256
    for r in layer["roles"]:
        unit = math.lcm(unit, GGML_QUANT_SIZES[GGMLQuantizationType(r["type_id"])][1])
    return (layer["block_bytes"] + unit - 1) // unit * unit


def cache_mib_for_slots(pack_dir, slots: int) -> float:
    """The cache_vram_mib that gives exactly `slots` slots per layer (a partial cache also holds one all-zero
    slot for rounds, src/provider.cpp)."""
    m = load_manifest(pack_dir)
    arena_slots = slots if slots >= m["n_experts"] else slots + 1
    need = sum(slot_stride(l) * arena_slots + ARENA_TAIL_PAD for l in m["layers"])
    return (need + ALIGNMENT) / 2**20  # a little above: floor() lands on `slots`


def ram_mib_for_blocks(pack_dir, blocks: int) -> float:
    """The ram_cache_mib that gives exactly `blocks` blocks in the host-RAM tier (blocks of the largest expert
    stride, src/provider.cpp)."""
    m = load_manifest(pack_dir)
    stride = max(l["expert_stride"] for l in m["layers"])
    return (blocks * stride + 1) / 2**20  # a hair above: floor() lands on `blocks`


@dataclass
class Run:
    logits: np.ndarray                 # (prompt_len + n_decode, n_vocab)
    n_ubatch: int                      # what the context used (the pack may cap it)
    tokens: list[int] = field(default_factory=list)
    routing: list[dict] = field(default_factory=list)  # per graph compute: {layer: (n_tokens, k) expert ids}
    error: int = 0                     # llama_decode's return code, if a step failed


def load_model(model_path, provider=None, n_gpu_layers: int = 0):
    """llama_model_load_from_file with the pack attached and extra buffer types off (docs/ARCHITECTURE.md, trap 10), so that
    stock and the pack run the same kernels; raises RuntimeError with the provider's reason."""
    import llama_cpp as lc

    from .lowlevel import backend_init_quiet
    backend_init_quiet()
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = False
    mp.n_gpu_layers = n_gpu_layers
    if provider is not None:
        provider.use_in(mp)
    model = lc.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        msg = provider.last_error if provider is not None else ""
        raise RuntimeError(f"llama.cpp could not load {model_path}" + (f": {msg}" if msg else ""))
    return model


def run(model_path, provider=None, n_ubatch: int = 512, prompt_len: int = 12, n_decode: int = 32,
        n_ctx: int = 256, n_gpu_layers: int = 0, record_routing: bool = False, n_threads: int = 2) -> Run:
    """Prompt (`prompt_len` fixed tokens, one llama_decode) then `n_decode` greedy steps. Extra buffer types
    are off (docs/ARCHITECTURE.md, trap 10) so that stock and the pack run the same kernels."""
    import llama_cpp as lc
    from .lowlevel import fill_batch
    from .routing.trace import TOPK_NAME, GGMLTensor, tensor_array

    model = load_model(model_path, provider, n_gpu_layers)
    routing: list[dict] = []
    cb = None
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = n_ctx
    cp.n_ubatch = n_ubatch
    cp.n_threads = cp.n_threads_batch = n_threads
    # CPU layers compute on the CPU on both sides: on a CUDA build stock would offload a prompt's big matmuls to the
    # GPU (op_offload), which a pack turns off (vendor/patches/0004) -- other kernels, other bits. So op offload only
    # where no layer is on the CPU (n_gpu_layers -1), where it has nothing to move
    cp.op_offload = n_gpu_layers < 0
    if record_routing:
        from ggml_expert_pack.libggml import lib_dir
        ggml = ctypes.CDLL(str(lib_dir() / "libggml-base.so"))
        ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

        @lc.ggml_backend_sched_eval_callback
        def cb(t_ptr, ask, ud):
            t = ctypes.cast(t_ptr, ctypes.POINTER(GGMLTensor)).contents
            m = TOPK_NAME.match(t.name)
            if not m:
                return False
            if not ask:
                layer = int(m.group(1))
                if not routing or layer in routing[-1]:
                    routing.append({})
                routing[-1][layer] = tensor_array(ggml, t, np.int32)
            return True
        cp.cb_eval = cb
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")
    try:
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        tokens = [((i * 7919) % 1000 + 100) % n_vocab for i in range(prompt_len)]  # same ids whenever n_vocab > 1100
        out = []
        batch = lc.llama_batch_init(max(prompt_len, 1), 0, 1)
        try:
            fill_batch(batch, tokens, all_logits=True)
            rc = lc.llama_decode(ctx, batch)
            if rc == 0:
                for i in range(prompt_len):
                    out.append(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy())
                for step in range(n_decode):
                    nxt = int(np.argmax(out[-1]))
                    tokens.append(nxt)
                    fill_batch(batch, [nxt], prompt_len + step)
                    rc = lc.llama_decode(ctx, batch)
                    if rc != 0:
                        break
                    out.append(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy())
        finally:
            lc.llama_batch_free(batch)
        return Run(np.stack(out) if out else np.empty((0, n_vocab), np.float32), lc.llama_n_ubatch(ctx), tokens,
                   routing, rc)
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)
        del cb


class StockCache:
    """Stock llama.cpp's reference (no pack) for a model file and settings, computed once and then shared: the test
    suite keeps one per run (tests/conftest.py, fixture `stock`), so that every test comparing against the same
    (model, prompt, settings) reuses one computation. The key is the file (resolved path, size, mtime) and every
    argument with the defaults filled in; results are returned with read-only logits (a test cannot alter what the
    next one compares against) and fresh token lists."""

    def __init__(self):
        self._runs: dict = {}
        self._generated: dict = {}
        self.hits = self.computed = 0

    @staticmethod
    def _file_key(model_path) -> tuple:
        import os
        p = os.path.realpath(model_path)
        st = os.stat(p)
        return p, st.st_size, st.st_mtime_ns

    def run(self, model_path, **kw) -> Run:
        """run(model_path, None, **kw), memoised."""
        import inspect
        if "provider" in kw:
            raise TypeError("StockCache.run is the run without a pack: no provider")
        bound = inspect.signature(run).bind(model_path, None, **kw)
        bound.apply_defaults()
        settings = tuple(sorted((k, v) for k, v in bound.arguments.items() if k not in ("model_path", "provider")))
        key = (self._file_key(model_path), settings)
        if key not in self._runs:
            r = run(model_path, None, **kw)
            r.logits.setflags(write=False)
            self._runs[key] = r
            self.computed += 1
        else:
            self.hits += 1
        r = self._runs[key]
        return Run(r.logits, r.n_ubatch, list(r.tokens), [dict(step) for step in r.routing], r.error)

    def generate(self, model_path, prompt: list[int], n: int, **session_kw) -> tuple[list[int], int]:
        """Session(model_path, None, **session_kw).generate(prompt, n) on a fresh session, memoised."""
        import inspect
        bound = inspect.signature(Session.__init__).bind(None, model_path, None, **session_kw)
        bound.apply_defaults()
        settings = tuple(sorted((k, v) for k, v in bound.arguments.items()
                                if k not in ("self", "model_path", "provider")))
        key = (self._file_key(model_path), settings, tuple(prompt), n)
        if key not in self._generated:
            s = Session(model_path, None, **session_kw)
            try:
                self._generated[key] = s.generate(list(prompt), n)
            finally:
                s.close()
            self.computed += 1
        else:
            self.hits += 1
        tokens, rc = self._generated[key]
        return list(tokens), rc


class Session:
    """A loaded model and one context (low-level llama.cpp), reused across requests."""

    def __init__(self, model_path, provider=None, n_ctx: int = 2048, n_ubatch: int = 512, n_gpu_layers: int = -1,
                 n_threads: int = 0):
        import os

        import llama_cpp as lc
        self.lc = lc
        import time
        t0 = time.perf_counter()
        self.model = load_model(model_path, provider, n_gpu_layers)
        self.load_s = time.perf_counter() - t0
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, n_ubatch
        cp.n_threads = cp.n_threads_batch = n_threads or os.cpu_count() or 4
        cp.op_offload = n_gpu_layers != 0  # as in run(): CPU layers stay on the CPU on both sides
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context")
        self.n_ubatch = lc.llama_n_ubatch(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)
        self.pos = 0

    def reset(self) -> None:
        """Forget the conversation (a new request)."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self.pos = 0

    def decode(self, tokens: list[int]) -> int:
        """One llama_decode of `tokens` (logits for the last one); returns its status (0 = success)."""
        from .lowlevel import fill_batch
        fill_batch(self.batch, tokens, self.pos)
        rc = self.lc.llama_decode(self.ctx, self.batch)
        self.lc.llama_synchronize(self.ctx)
        if rc == 0:
            self.pos += len(tokens)
        return rc

    def logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], int]:
        """Greedy: the prompt in one decode, then n tokens. Returns (tokens produced, status of the last decode)."""
        out: list[int] = []
        rc = self.decode(prompt)
        while rc == 0 and len(out) < n:
            out.append(int(np.argmax(self.logits())))
            rc = self.decode([out[-1]])
        return out, rc

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)
