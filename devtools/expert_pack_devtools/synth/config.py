"""Configuration of a synthetic MoE model: shape, tensor types, seed and routing realism."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ggml_expert_pack.ggml_types import parse_type

ARCHS = ("qwen3moe", "deepseek4", "kimi-k3")
EXPERT_ROLES = ("gate", "up", "down")


@dataclass
class RoutingConfig:
    """How realistic the router's choices are (docs/SYNTH.md gives the bands real models show).

    zipf        strength of expert popularity within a layer (0 = none; the Zipf exponent measured on top
                of a random router's own unevenness is higher, see docs/SYNTH.md)
    context     weight of the recent-token context in the router input (consecutive tokens share experts)
    window      width, in tokens, of that context (attention with a recency kernel; qwen3moe only)
    layer_corr  correlation between consecutive layers' routers (0..1)
    drift       size of each layer's update to the hidden state relative to the token embedding; smaller
                means the next layer's experts are easier to predict from the current hidden state
    """
    preset: str = "realistic"
    zipf: float = 0.35
    context: float = 2.6
    window: float = 2.0
    layer_corr: float = 0.3
    drift: float = 0.35

    # calibrated with `expert-pack routing-stats` on the "routing" shape (docs/SYNTH.md)
    PRESETS = {
        "uniform":   dict(zipf=0.0, context=0.0, window=2.0, layer_corr=0.0, drift=0.35),
        "realistic": dict(zipf=0.35, context=2.6, window=2.0, layer_corr=0.3, drift=0.35),
        "skewed":    dict(zipf=1.0, context=3.0, window=3.0, layer_corr=0.5, drift=0.35),
    }

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "RoutingConfig":
        if name not in cls.PRESETS:
            raise ValueError(f"unknown routing preset {name!r}; choose one of {', '.join(cls.PRESETS)}")
        vals = dict(cls.PRESETS[name])
        vals.update({k: v for k, v in overrides.items() if v is not None})
        return cls(preset=name, **vals)


@dataclass
class SynthConfig:
    arch: str = "qwen3moe"
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 0                 # 0: n_embd // n_head
    n_expert: int = 16
    n_expert_used: int = 4
    n_ff_exp: int = 256               # routed expert FFN width
    n_ff: int = 512                   # dense FFN width (dense leading layers)
    n_dense_lead: int = 0             # kimi-k3: leading dense layers
    n_expert_shared: int = 1          # deepseek4, kimi-k3
    n_hash_layers: int = 0            # deepseek4: first layers routed by token id (tid2eid)
    n_mtp_layers: int = 0             # deepseek4: multi-token-prediction layers appended after the trunk
    n_expert_latent: int = 0          # kimi-k3: routed experts run in this latent width (0: n_embd, no latent)
    n_ctx_train: int = 4096
    # tensor types: routed experts per role, optionally per layer; everything else
    expert_type: str = "q4_k"
    expert_types: dict = field(default_factory=dict)        # role -> type, overrides expert_type
    layer_expert_types: dict = field(default_factory=dict)  # "layer" -> type or {role: type}
    weight_type: str = "f16"          # attention / shared experts / dense FFN matrices
    embd_type: str = "q8_0"           # token_embd and output
    seed: int = 42
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    vocab: str = ""                   # vocab GGUF; "" = the packaged qwen2 vocab
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.routing, dict):
            self.routing = RoutingConfig(**self.routing)
        if self.arch not in ARCHS:
            raise ValueError(f"unsupported arch {self.arch!r}; supported: {', '.join(ARCHS)}")
        if not self.head_dim:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
            self.head_dim = self.n_embd // self.n_head
        for k in ("n_layer", "n_embd", "n_head", "n_expert", "n_expert_used", "n_ff_exp"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be > 0")
        if self.n_expert_used > self.n_expert:
            raise ValueError(f"n_expert_used {self.n_expert_used} > n_expert {self.n_expert}")
        if self.n_head % max(self.n_head_kv, 1):
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.arch != "kimi-k3" and self.n_dense_lead:
            raise ValueError("n_dense_lead is only supported for kimi-k3")
        if self.n_dense_lead >= self.n_layer:
            raise ValueError("n_dense_lead must leave at least one MoE layer")
        if self.arch != "kimi-k3" and self.n_expert_latent:
            raise ValueError("n_expert_latent is a kimi-k3 feature")
        if self.arch != "deepseek4" and (self.n_hash_layers or self.n_mtp_layers):
            raise ValueError("n_hash_layers / n_mtp_layers are deepseek4 features")
        for role in self.expert_types:
            if role not in EXPERT_ROLES:
                raise ValueError(f"expert_types: unknown role {role!r} (roles: {', '.join(EXPERT_ROLES)})")
        # validate every type name early
        for t in [self.expert_type, self.weight_type, self.embd_type, *self.expert_types.values()]:
            parse_type(t)
        for layer, spec in self.layer_expert_types.items():
            int(layer)
            for t in (spec.values() if isinstance(spec, dict) else [spec]):
                parse_type(t)

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + self.n_mtp_layers

    def expert_type_for(self, layer: int, role: str):
        spec = self.layer_expert_types.get(str(layer), self.layer_expert_types.get(layer))
        if isinstance(spec, dict) and role in spec:
            return parse_type(spec[role])
        if isinstance(spec, str):
            return parse_type(spec)
        return parse_type(self.expert_types.get(role, self.expert_type))

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.n_dense_lead

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "SynthConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | Path) -> "SynthConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))


# Named shapes used by tests, docs and benchmarks.
SHAPES: dict[str, dict] = {
    # seconds to generate; used by the test-suite
    "tiny":      dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_expert=16, n_expert_used=4, n_ff_exp=256),
    # the benchmark model (docs/BENCHMARKS.md, "The benchmark model"): 30B-A3B-shaped qwen3moe, ~17 GB with Q4_K experts
    "30b-a3b":   dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                      n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx_train=40960,
                      expert_type="q4_k", weight_type="q8_0", embd_type="q8_0"),
    # routing studies: the benchmark's expert geometry (128 experts, top-8) with a small hidden size
    "routing":   dict(arch="qwen3moe", n_layer=12, n_embd=512, n_head=8, n_head_kv=4, head_dim=64,
                      n_expert=128, n_expert_used=8, n_ff_exp=256, expert_type="q4_k"),
}
