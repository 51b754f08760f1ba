"""Routing measurements: record the experts a model picks (trace.py) and compare the statistics with the
bands real MoE models show (stats.py). `expert-pack routing-stats MODEL` runs both."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ggml_expert_pack.gguf_file import read_header

from . import stats
from .prompts import PROMPTS
from .trace import RoutingTrace, capture

__all__ = ["PROMPTS", "RoutingTrace", "capture", "measure", "stats"]

GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT, GATING_SQRT_SOFTPLUS = 1, 2, 3, 4


def _f32(path: Path, t) -> np.ndarray:
    if t.type.name != "F32":
        raise ValueError(f"{t.name} is {t.type.name}; routers are expected in F32")
    return np.fromfile(path, dtype=np.float32, count=t.nbytes // 4, offset=t.offset).reshape(t.shape[::-1])


def router_selector(model_path: str | Path, layers: list[int]):
    """Routers of `layers` and a function that picks top-k the way the arch does (gating + selection bias)."""
    path = Path(model_path)
    h = read_header(path)
    arch = h.arch
    gating = GATING_SOFTMAX if arch == "qwen3moe" else int(h.get(f"{arch}.expert_gating_func", GATING_SOFTMAX))
    k = int(h.get(f"{arch}.expert_used_count"))
    routers, biases = [], []
    for il in layers:
        w = h.tensor(f"blk.{il}.ffn_gate_inp.weight")
        b = h.tensor(f"blk.{il}.exp_probs_b.bias")
        routers.append(_f32(path, w) if w is not None else None)
        biases.append(_f32(path, b) if b is not None else None)
    hashed = {i for i, il in enumerate(layers) if h.tensor(f"blk.{il}.ffn_gate_tid2eid.weight") is not None}

    def select(i: int, logits: np.ndarray) -> np.ndarray:
        if i in hashed:
            return np.full((logits.shape[0], k), -1)  # routed by token id, not by the router: never "predicted"
        if gating == GATING_SIGMOID:
            p = 1 / (1 + np.exp(-logits))
        elif gating == GATING_SQRT_SOFTPLUS:
            p = np.sqrt(np.logaddexp(0, logits))
        else:
            p = logits  # softmax is monotone: the top-k of the logits
        if biases[i] is not None:
            p = p + biases[i]
        return np.argsort(-p, axis=1)[:, :k]

    return routers, select


def measure(model_path: str | Path, prompts: list[str] | None = None, n_threads: int = 0) -> dict[str, float]:
    trace = capture(model_path, prompts or PROMPTS, router_inputs=True, n_threads=n_threads)
    routers, select = router_selector(model_path, trace.layers)
    return stats.compute(trace, routers, select)
