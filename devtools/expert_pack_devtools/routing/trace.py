"""Record which experts the router picks, token by token and layer by layer, from stock llama.cpp.

The graph callback (`cb_eval`) sees every named tensor: `ffn_moe_topk-<layer>` holds the selected expert
ids, `ffn_norm-<layer>` the router's input. The prompts are teacher-forced (the model reads natural text),
which is how routing statistics of real models are measured; a random model's own generations would loop.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64


class GGMLTensor(ctypes.Structure):
    """Mirror of `struct ggml_tensor` (ggml/include/ggml.h of the vendored tree)."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
TOPK_NAME = re.compile(rb"^ffn_moe_topk-(\d+)$")  # a MoE layer's selected expert ids
NORM_NAME = re.compile(rb"^ffn_norm-(\d+)$")  # its router's input


@dataclass
class RoutingTrace:
    """experts[p]: (n_tokens, n_moe_layers, k) int32 for prompt p; layers: the MoE layer ids in that order;
    router_inputs[p]: (n_tokens, n_moe_layers, n_embd) float32 when recorded."""
    model: str
    layers: list[int]
    n_expert: int
    experts: list[np.ndarray] = field(default_factory=list)
    router_inputs: list[np.ndarray] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, model=self.model, layers=np.array(self.layers), n_expert=self.n_expert,
                            **{f"experts_{i}": e for i, e in enumerate(self.experts)})

    @classmethod
    def load(cls, path: str | Path) -> "RoutingTrace":
        z = np.load(path)
        n = sum(1 for k in z.files if k.startswith("experts_"))
        return cls(str(z["model"]), [int(x) for x in z["layers"]], int(z["n_expert"]),
                   [z[f"experts_{i}"] for i in range(n)])


def tensor_array(lib: ctypes.CDLL, t: GGMLTensor, dtype) -> np.ndarray:
    """Copy a 2-D (possibly strided) tensor out of whatever backend holds it: (ne1, ne0)."""
    ne0, ne1 = t.ne[0], t.ne[1]
    itemsize = np.dtype(dtype).itemsize
    span = (ne1 - 1) * t.nb[1] + ne0 * itemsize
    buf = np.empty(span, dtype=np.uint8)
    lib.ggml_backend_tensor_get(ctypes.byref(t), buf.ctypes.data_as(ctypes.c_void_p), 0, span)
    view = np.lib.stride_tricks.as_strided(buf.view(np.uint8), shape=(ne1, ne0 * itemsize),
                                           strides=(t.nb[1], 1))
    return np.ascontiguousarray(view).view(dtype).reshape(ne1, ne0)


def capture(model_path: str | Path, prompts: list[str], router_inputs: bool = False, n_threads: int = 0,
            n_gpu_layers: int = 0) -> RoutingTrace:
    import llama_cpp as lc

    from ggml_expert_pack.gguf_file import read_header
    from ggml_expert_pack.libggml import lib_dir

    from ..lowlevel import backend_init_quiet, fill_batch
    header = read_header(model_path)
    n_expert = int(header.get(f"{header.arch}.expert_count", 0))
    if not n_expert:
        raise ValueError(f"{model_path} is not a MoE model (no {header.arch}.expert_count)")
    ggml = ctypes.CDLL(str(lib_dir() / "libggml-base.so"))
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    ggml.ggml_backend_tensor_get.restype = None

    backend_init_quiet()

    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    vocab = lc.llama_model_get_vocab(model)

    tokenized = []
    for p in prompts:
        b = p.encode()
        buf = (lc.llama_token * (len(b) + 16))()
        n = lc.llama_tokenize(vocab, b, len(b), buf, len(buf), True, False)
        if n < 0:
            raise RuntimeError("tokenization failed")
        tokenized.append(list(buf[:n]))
    n_max = max(len(t) for t in tokenized)

    current: dict[str, dict[int, np.ndarray]] = {"topk": {}, "norm": {}}

    @lc.ggml_backend_sched_eval_callback
    def on_tensor(t_ptr, ask, user_data):
        t = ctypes.cast(t_ptr, ctypes.POINTER(GGMLTensor)).contents
        name = t.name
        m = TOPK_NAME.match(name)
        if m:
            if not ask:
                current["topk"][int(m.group(1))] = tensor_array(ggml, t, np.int32)
            return True
        m = NORM_NAME.match(name) if router_inputs else None
        if m:
            if not ask:
                current["norm"][int(m.group(1))] = tensor_array(ggml, t, np.float32)
            return True
        return False

    cparams = lc.llama_context_default_params()
    cparams.n_ctx = max(n_max + 8, 64)
    cparams.n_batch = cparams.n_ubatch = max(n_max, 1)
    if n_threads:
        cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.cb_eval = on_tensor
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")

    trace = None
    try:
        for toks in tokenized:
            current["topk"].clear()
            current["norm"].clear()
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            # every token an output: otherwise the last layer only computes the last token's row
            batch = lc.llama_batch_init(len(toks), 0, 1)
            try:
                fill_batch(batch, toks, all_logits=True)
                rc = lc.llama_decode(ctx, batch)
            finally:
                lc.llama_batch_free(batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            layers = sorted(current["topk"])
            if trace is None:
                trace = RoutingTrace(str(model_path), layers, n_expert)
            trace.experts.append(np.stack([current["topk"][l] for l in layers], axis=1))
            if router_inputs:
                trace.router_inputs.append(np.stack([current["norm"][l] for l in layers], axis=1))
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return trace


TRACE_MAGIC = b"EPTRACE1"


@dataclass
class StepTrace:
    """A routing trace recorded by the runtime (config key `trace_path`, format in docs/FORMAT.md): per graph
    compute ("step") and acquired MoE layer, the router's expert ids of every token of the step.
    records: (step, layer, ids) in file order, ids of shape (n_tokens, k)."""
    path: str
    n_layers: int          # MoE layers of the pack
    n_expert: int
    k: int
    records: list[tuple[int, int, np.ndarray]] = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        """The model layers that have records, in ascending order."""
        return sorted({layer for _, layer, _ in self.records})

    def layer_records(self, layer: int) -> list[np.ndarray]:
        return [ids for _, l, ids in self.records if l == layer]

    @classmethod
    def load(cls, path: str | Path) -> "StepTrace":
        data = Path(path).read_bytes()
        if len(data) < 24 or data[:8] != TRACE_MAGIC:
            raise ValueError(f"{path}: not a routing trace recorded by the runtime (no {TRACE_MAGIC.decode()} header)")
        version, n_layers, n_expert, k = np.frombuffer(data, "<u4", 4, 8)
        if version != 1:
            raise ValueError(f"{path}: routing trace version {version}, this reader knows 1")
        t = cls(str(path), int(n_layers), int(n_expert), int(k))
        off = 24
        while off < len(data):
            if off + 16 > len(data):
                raise ValueError(f"{path}: truncated record header at byte {off}")
            step = int(np.frombuffer(data, "<u8", 1, off)[0])
            layer, n_tokens = (int(x) for x in np.frombuffer(data, "<u4", 2, off + 8))
            n = n_tokens * t.k
            if off + 16 + 4 * n > len(data):
                raise ValueError(f"{path}: truncated record at byte {off}")
            ids = np.frombuffer(data, "<i4", n, off + 16).reshape(n_tokens, t.k)
            t.records.append((step, layer, ids))
            off += 16 + 4 * n
        return t
