"""Weight values of the synthetic models, including the structure that makes routing realistic.

A random transformer routes every token independently and uniformly; real MoE models do not (docs/SYNTH.md).
The structure below reproduces the three effects that matter for an expert cache, each with one knob
(synth.config.RoutingConfig):

* popularity (zipf): every token embedding carries a shared direction `u`; each router has a rank-one term
  `bias_e * u`, with bias_e = -log(rank_e) in a random order per layer, so some experts win more often.
* consecutive tokens (context, window): qwen3moe's attention is built as a recency kernel -- queries and keys
  are constant vectors placed on a few RoPE frequencies, so the score depends only on the distance between
  tokens and falls off over about `window` tokens; values carry the token, so each layer adds a smoothed
  mix of the recent tokens to the residual stream. Routers see that shared context, so neighbours share
  experts.
* consecutive layers (layer_corr, drift): routers of consecutive layers are correlated, and each layer
  moves the hidden state by a bounded amount (drift), so the next layer's choice can be predicted from the
  current hidden state. The `u` share of the residual is topped up every layer so that popularity does not
  fade with depth.

Routed expert weights are drawn from a pool of quantized rows (generating and quantizing tens of GB of
floats would take far longer than writing them); everything else is generated as floats and quantized
through ggml.
"""
from __future__ import annotations

import math
import zlib
from statistics import NormalDist
from typing import Iterator

import numpy as np

from ggml_expert_pack import libggml
from ggml_expert_pack.ggml_types import GGMLQuantizationType, is_quantized

from .archs import TensorSpec
from .config import SynthConfig

KAPPA = 1.0          # energy of the shared direction u relative to the token part of an embedding
POP_SCALE = 0.5      # zipf -> router bias (calibrated with `expert-pack routing-stats`, docs/SYNTH.md)
LATER_CONTEXT = 0.25  # context gain of layers after the first, relative to the first
ROW_POOL = 4096      # distinct quantized rows per (type, row length, std) pool
CHUNK_ELEMS = 1 << 24


# 256 quantiles of N(0, 1): random bytes through this table give near-normal values ~10x faster than
# Generator.standard_normal, which dominates generation time for the large embedding/output matrices
_NORMAL_TABLE = np.array([NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)], dtype=np.float32)
_NORMAL_TABLE /= _NORMAL_TABLE.std()


def fast_normal(rng: np.random.Generator, shape: tuple[int, ...], std: float = 1.0) -> np.ndarray:
    n = int(np.prod(shape))
    return (_NORMAL_TABLE * np.float32(std))[np.frombuffer(rng.bytes(n), dtype=np.uint8)].reshape(shape)


def _seed(cfg_seed: int, *parts) -> np.random.Generator:
    key = [cfg_seed] + [zlib.crc32(str(p).encode()) for p in parts]
    return np.random.default_rng(np.random.SeedSequence(key))


def _to_bytes(x: np.ndarray, t: GGMLQuantizationType) -> np.ndarray:
    """float32 (n_rows, ne0) -> ggml bytes."""
    if t == GGMLQuantizationType.BF16:
        b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        return b.view(np.uint8).reshape(x.shape[0], -1)
    return libggml.quantize(x, t)


SILU_GLU_VAR = 0.3557  # E[(silu(g) * u)^2] for g, u ~ N(0, 1): energy of one expert's hidden unit


class WeightFactory:
    def __init__(self, cfg: SynthConfig, n_vocab: int):
        self.cfg = cfg
        self.n_vocab = n_vocab
        r = cfg.routing
        d = cfg.n_embd
        rng = _seed(cfg.seed, "u")
        u = rng.standard_normal(d)
        self.u = (u / np.linalg.norm(u)).astype(np.float32)
        # Energy bookkeeping, in units of d (an RMS-normalised vector x has |x|^2 = d):
        #   embedding h0 = KAPPA*sqrt(d)*u + eps, |eps|^2 = d
        #   every layer adds ~ (context^2 + drift^2) * d in directions orthogonal to u, and the attention
        #   tops u up by the same relative amount (qwen3moe), so u.x stays at `ux` for every layer's x.
        self.ux = KAPPA / math.sqrt(1 + KAPPA ** 2) * math.sqrt(d)
        # energy each layer adds (units of d); cumulative sums give the residual's energy entering a layer
        added = [self.context_gain(l) ** 2 + r.drift ** 2 for l in range(cfg.n_layer_all)]
        self._energy_before = np.concatenate([[0.0], np.cumsum(added)])
        self._pools: dict = {}
        self._routers: list[np.ndarray] | None = None

    def context_gain(self, layer: int) -> float:
        """Context energy (relative to a token's) that a layer's attention adds. The first layer adds the full
        amount, later layers a quarter: the residual stream carries it on, and layers that keep adding
        context would both pile up stickiness with depth and make consecutive layers less alike."""
        return self.cfg.routing.context * (1.0 if layer == 0 else LATER_CONTEXT)

    def u_amplitude(self, layer: int) -> float:
        """Expected amplitude of u in the residual stream entering `layer` (qwen3moe)."""
        return KAPPA * math.sqrt(self.cfg.n_embd * (1 + self._energy_before[layer]))

    # ---- routing structure ---------------------------------------------------------------------------
    def routers(self) -> list[np.ndarray]:
        """(n_expert, n_embd) float32 per layer: correlated noise orthogonal to u + popularity along u."""
        if self._routers is not None:
            return self._routers
        cfg, r = self.cfg, self.cfg.routing
        d, E = cfg.n_embd, cfg.n_expert
        noise_std = 1.0 / math.sqrt(1 + KAPPA ** 2)   # std of a logit's noise term over tokens
        out, prev = [], None
        for il in range(cfg.n_layer_all):
            rng = _seed(cfg.seed, "router", il)
            g = rng.standard_normal((E, d)).astype(np.float32)
            noise = g if prev is None else r.layer_corr * prev + math.sqrt(1 - r.layer_corr ** 2) * g
            prev = noise
            w = noise - np.outer(noise @ self.u, self.u)
            w *= 1.0 / math.sqrt(d)
            bias = -np.log((rng.permutation(E) + 1).astype(np.float64))
            bias -= bias.mean()
            w += np.outer(POP_SCALE * r.zipf * noise_std * bias / self.ux, self.u)
            out.append(w.astype(np.float32))
        self._routers = out
        return out

    BETA = 16.0  # attention score range; the kernel is exp(BETA * cos(distance * theta))

    def _recency_heads(self, n_heads: int) -> np.ndarray:
        """(n_heads, head_dim) unit vectors on RoPE frequencies that make a kernel of ~window tokens;
        heads get windows from window/2 to 2*window (several time scales)."""
        cfg = self.cfg
        hd = cfg.head_dim
        theta = 1e6 ** (-2.0 * np.arange(hd // 2) / hd)
        out = np.zeros((n_heads, hd), dtype=np.float32)
        for h in range(n_heads):
            w = cfg.routing.window * (2.0 ** (2.0 * h / max(n_heads - 1, 1) - 1.0))
            target = 1.0 / (w * math.sqrt(self.BETA))
            # two incommensurate frequencies around the target: the kernel does not come back after a period
            for i in {int(np.argmin(np.abs(theta - target * f))) for f in (1.0, 1.618)}:
                out[h, i] = 1.0
            out[h] /= np.linalg.norm(out[h])
        return out

    # ---- tensor data ---------------------------------------------------------------------------------
    def chunks(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        kind = spec.init
        if kind == "expert":
            yield from self._experts(spec)
        elif kind == "tid2eid":
            yield self._tid2eid(spec)
        elif kind == "embd":
            yield from self._rows(spec, self._embd_rows)
        elif kind == "normal" and spec.shape[0] * int(np.prod(spec.shape[1:])) > CHUNK_ELEMS:
            yield from self._rows(spec, lambda rng, r0, r1: fast_normal(rng, (r1 - r0, spec.shape[0]), spec.std))
        else:
            ne0 = spec.shape[0]
            n_rows = int(np.prod(spec.shape[1:])) if len(spec.shape) > 1 else 1
            yield from self._encode(self._dense(spec, ne0, n_rows), spec.type)

    def _encode(self, x: np.ndarray, t: GGMLQuantizationType) -> Iterator[np.ndarray]:
        if t == GGMLQuantizationType.F32:
            yield np.ascontiguousarray(x, dtype=np.float32)
            return
        step = max(1, CHUNK_ELEMS // x.shape[1])
        for i in range(0, x.shape[0], step):
            yield _to_bytes(x[i:i + step], t)

    def _dense(self, spec: TensorSpec, ne0: int, n_rows: int) -> np.ndarray:
        """float32 (n_rows, ne0), numpy order (a row is one ne0 vector)."""
        cfg, kind = self.cfg, spec.init
        structured = cfg.arch == "qwen3moe"
        rng = _seed(cfg.seed, spec.name)
        if kind == "ones":
            return np.ones((n_rows, ne0), np.float32)
        if kind == "zeros":
            return np.zeros((n_rows, ne0), np.float32)
        if kind == "neg_uniform":
            return -rng.uniform(0.5, 2.0, (n_rows, ne0)).astype(np.float32)
        if kind == "probs_b":
            return (0.01 * rng.standard_normal((n_rows, ne0))).astype(np.float32)
        if kind == "router":
            return self.routers()[spec.layer]
        if kind == "qk_norm":
            # after the RMS norm a unit query on the chosen frequencies has norm sqrt(hd) * gain
            return np.full((n_rows, ne0), math.sqrt(self.BETA / math.sqrt(cfg.head_dim)), np.float32)
        if kind in ("attn_q", "attn_k") and structured:
            heads = self._recency_heads(cfg.n_head_kv)
            if kind == "attn_q":  # the query heads of a GQA group share their kv head's kernel
                heads = np.repeat(heads, cfg.n_head // cfg.n_head_kv, axis=0)
            w = np.outer(heads.reshape(-1), self.u)  # q = (u.x) q0: the same direction for every token
            return (w + 0.01 * rng.standard_normal(w.shape) / math.sqrt(ne0)).astype(np.float32)
        if kind == "attn_v" and structured:
            w = rng.standard_normal((n_rows, ne0)).astype(np.float32) / math.sqrt(ne0)
            w -= np.outer(w @ self.u, self.u)   # values carry the tokens, not the shared direction...
            w[::cfg.head_dim] = self.u          # ...except dim 0 of each kv head: u.x, which tops u up
            return w
        if kind == "attn_out" and structured:
            hd, nh = cfg.head_dim, cfg.n_head
            # a one-sided Gaussian kernel of width w averages ~1.77*w independent values
            n_eff = 1.77 * max(cfg.routing.window, 0.5)
            w = rng.standard_normal((n_rows, ne0)).astype(np.float32)
            w *= self.context_gain(spec.layer) * math.sqrt(2 * n_eff / ne0)
            w[:, ::hd] = 0.0
            l = spec.layer
            top_up = self.u_amplitude(l + 1) - self.u_amplitude(l)
            w[:, ::hd] += np.outer(self.u, np.full(nh, top_up / (nh * self.ux), np.float32))
            return w
        if kind == "ffn_out":
            return (rng.standard_normal((n_rows, ne0)) * spec.std * cfg.routing.drift).astype(np.float32)
        if kind in ("normal", "attn_out", "attn_q", "attn_k", "attn_v"):
            return (rng.standard_normal((n_rows, ne0)) * spec.std).astype(np.float32)
        raise ValueError(f"no initializer {kind!r} for {spec.name}")

    def _embd_rows(self, rng: np.random.Generator, r0: int, r1: int) -> np.ndarray:
        d = self.cfg.n_embd
        return fast_normal(rng, (r1 - r0, d)) + (KAPPA * math.sqrt(d)) * self.u[None, :]

    def _rows(self, spec: TensorSpec, fn) -> Iterator[np.ndarray]:
        ne0, n_rows = spec.shape[0], int(np.prod(spec.shape[1:]))
        step = max(1, CHUNK_ELEMS // ne0)
        for r0 in range(0, n_rows, step):
            x = fn(_seed(self.cfg.seed, spec.name, r0), r0, min(n_rows, r0 + step))
            yield x if spec.type == GGMLQuantizationType.F32 else _to_bytes(x, spec.type)

    def _tid2eid(self, spec: TensorSpec) -> np.ndarray:
        """(n_vocab, k) int32: each token's fixed experts, drawn by popularity, distinct within a token."""
        cfg = self.cfg
        rng = _seed(cfg.seed, spec.name)
        E, k = cfg.n_expert, cfg.n_expert_used
        p = (rng.permutation(E) + 1).astype(np.float64) ** -cfg.routing.zipf
        # Gumbel top-k == k distinct experts drawn with probability ~p
        g = np.log(p / p.sum())[None, :] - np.log(-np.log(rng.uniform(size=(self.n_vocab, E))))
        return np.argsort(-g, axis=1)[:, :k].astype(np.int32)

    def _pool(self, t: GGMLQuantizationType, ne0: int, std: float) -> np.ndarray:
        key = (t, ne0, round(std, 9))
        if key not in self._pools:
            rng = _seed(self.cfg.seed, "pool", int(t), ne0, std)
            self._pools[key] = _to_bytes(fast_normal(rng, (ROW_POOL, ne0), std), t)
        return self._pools[key]

    def expert_std(self, spec: TensorSpec) -> float:
        if spec.expert_role != "down":
            return spec.std
        # the weighted sum of k experts (weights ~1/k) should add ~drift^2 * d of energy
        k = self.cfg.n_expert_used
        return self.cfg.routing.drift * math.sqrt(k / SILU_GLU_VAR) / math.sqrt(spec.shape[0])

    def _experts(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        ne0, n_out, n_exp = spec.shape
        std, t = self.expert_std(spec), spec.type
        small_float = not is_quantized(t) and n_out * ne0 * n_exp <= (1 << 24)
        pool = None if small_float else self._pool(t, ne0, std)
        for e in range(n_exp):
            rng = _seed(self.cfg.seed, spec.name, e)
            if pool is None:
                x = fast_normal(rng, (n_out, ne0), std)
                yield x if t == GGMLQuantizationType.F32 else _to_bytes(x, t)
            else:
                yield pool[rng.integers(0, pool.shape[0], n_out)]
