"""Per-architecture GGUF metadata and tensor lists of the synthetic models.

Each list mirrors the arch's `load_arch_tensors` in the vendored llama.cpp (src/models/<arch>.cpp); the
loader checks every name and shape, and the tests load every arch, so a drift shows up at once.
Shapes are in ggml order (ne0 first).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gguf import GGUFValueType

from ggml_expert_pack.ggml_types import GGMLQuantizationType, parse_type
from ggml_expert_pack.gguf_stream import KV, kv_arr, kv_bool, kv_f32, kv_str, kv_u32

from .config import SynthConfig

F32 = GGMLQuantizationType.F32
I32 = GGMLQuantizationType.I32


@dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    init: str                      # how weights.py fills it (see weights.INIT_KINDS)
    layer: int = -1
    expert_role: str | None = None  # gate / up / down for routed experts
    std: float = 0.0
    extra: dict = field(default_factory=dict)


def _norm(name: str, n: int, layer: int = -1) -> TensorSpec:
    return TensorSpec(name, (n,), F32, "ones", layer)


def _mat(name: str, shape: tuple[int, ...], t, layer: int = -1, init: str = "normal", **extra) -> TensorSpec:
    # std: 1/sqrt(fan_in) keeps activations O(1) through a layer
    return TensorSpec(name, shape, parse_type(t), init, layer, std=shape[0] ** -0.5, extra=extra)


def _experts(cfg: SynthConfig, il: int, n_in: int, n_ff: int) -> list[TensorSpec]:
    out = []
    for role, shape in (("gate", (n_in, n_ff, cfg.n_expert)), ("up", (n_in, n_ff, cfg.n_expert)),
                        ("down", (n_ff, n_in, cfg.n_expert))):
        out.append(TensorSpec(f"blk.{il}.ffn_{role}_exps.weight", shape, cfg.expert_type_for(il, role), "expert",
                              il, expert_role=role, std=shape[0] ** -0.5))
    return out


def _router(cfg: SynthConfig, il: int) -> TensorSpec:
    return TensorSpec(f"blk.{il}.ffn_gate_inp.weight", (cfg.n_embd, cfg.n_expert), F32, "router", il)


def _common_kvs(cfg: SynthConfig, arch: str) -> list[KV]:
    return [
        kv_str("general.architecture", arch),
        kv_str("general.name", cfg.name or f"synthetic-{arch}"),
        kv_str("general.source.synthetic_config", cfg.to_json()),
        kv_u32(f"{arch}.context_length", cfg.n_ctx_train),
        kv_u32(f"{arch}.embedding_length", cfg.n_embd),
        kv_u32(f"{arch}.block_count", cfg.n_layer_all),
        kv_u32(f"{arch}.expert_count", cfg.n_expert),
        kv_u32(f"{arch}.expert_used_count", cfg.n_expert_used),
        kv_u32(f"{arch}.expert_feed_forward_length", cfg.n_ff_exp),
        kv_f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
    ]


# --------------------------------------------------------------------------------------------------------
# qwen3moe (src/models/qwen3moe.cpp)

def qwen3moe_kvs(cfg: SynthConfig) -> list[KV]:
    a = "qwen3moe"
    return _common_kvs(cfg, a) + [
        kv_u32(f"{a}.feed_forward_length", cfg.n_ff),
        kv_u32(f"{a}.attention.head_count", cfg.n_head),
        kv_u32(f"{a}.attention.head_count_kv", cfg.n_head_kv),
        kv_u32(f"{a}.attention.key_length", cfg.head_dim),
        kv_u32(f"{a}.attention.value_length", cfg.head_dim),
        kv_u32(f"{a}.rope.dimension_count", cfg.head_dim),
        kv_f32(f"{a}.rope.freq_base", 1e6),
    ]


def qwen3moe_tensors(cfg: SynthConfig, n_vocab: int) -> list[TensorSpec]:
    d, hd, wt = cfg.n_embd, cfg.head_dim, cfg.weight_type
    out = [
        TensorSpec("token_embd.weight", (d, n_vocab), parse_type(cfg.embd_type), "embd"),
        _norm("output_norm.weight", d),
        _mat("output.weight", (d, n_vocab), cfg.embd_type),
    ]
    for il in range(cfg.n_layer):
        b = f"blk.{il}"
        out += [
            _norm(f"{b}.attn_norm.weight", d, il),
            _mat(f"{b}.attn_q.weight", (d, hd * cfg.n_head), wt, il, init="attn_q"),
            _mat(f"{b}.attn_k.weight", (d, hd * cfg.n_head_kv), wt, il, init="attn_k"),
            _mat(f"{b}.attn_v.weight", (d, hd * cfg.n_head_kv), wt, il, init="attn_v"),
            _mat(f"{b}.attn_output.weight", (hd * cfg.n_head, d), wt, il, init="attn_out"),
            TensorSpec(f"{b}.attn_q_norm.weight", (hd,), F32, "qk_norm", il),
            TensorSpec(f"{b}.attn_k_norm.weight", (hd,), F32, "qk_norm", il),
            _norm(f"{b}.ffn_norm.weight", d, il),
            _router(cfg, il),
        ] + _experts(cfg, il, d, cfg.n_ff_exp)
    return out


# --------------------------------------------------------------------------------------------------------
# deepseek4 (src/models/deepseek4.cpp): hyper-connections, compressed attention, hash-routed first layers,
# shared experts, swiglu clamp, MTP layers after the trunk

DS4_Q_LORA = 64
DS4_O_GROUPS = 4
DS4_O_LORA = 32
DS4_HC = 4
DS4_INDEXER_HEADS = 8
DS4_INDEXER_DIM = 64


def _ds4_compress_ratio(cfg: SynthConfig, il: int) -> int:
    # DeepSeek-V4 alternates compressed-sparse (4) and heavily-compressed (128) attention after two
    # uncompressed layers; MTP layers are uncompressed
    if il < 2 or il >= cfg.n_layer:
        return 0
    return 4 if il % 2 == 0 else 128


def deepseek4_kvs(cfg: SynthConfig) -> list[KV]:
    a = "deepseek4"
    n_all = cfg.n_layer_all
    kvs = _common_kvs(cfg, a) + [
        kv_u32(f"{a}.attention.head_count", cfg.n_head),
        kv_u32(f"{a}.attention.head_count_kv", 1),
        kv_u32(f"{a}.attention.key_length", cfg.head_dim),
        kv_u32(f"{a}.attention.value_length", cfg.head_dim),
        kv_u32(f"{a}.rope.dimension_count", cfg.head_dim // 2),
        kv_f32(f"{a}.rope.freq_base", 10000.0),
        kv_u32(f"{a}.attention.q_lora_rank", DS4_Q_LORA),
        kv_u32(f"{a}.attention.sliding_window", 128),
        kv_u32(f"{a}.expert_shared_count", cfg.n_expert_shared),
        kv_f32(f"{a}.expert_weights_scale", 1.5),
        kv_bool(f"{a}.expert_weights_norm", True),
        kv_u32(f"{a}.expert_gating_func", 4),  # sqrtsoftplus
        kv_arr(f"{a}.swiglu_clamp_exp", GGUFValueType.FLOAT32, [10.0] * n_all),
        kv_arr(f"{a}.swiglu_clamp_shexp", GGUFValueType.FLOAT32, [10.0] * n_all),
        kv_u32(f"{a}.attention.indexer.head_count", DS4_INDEXER_HEADS),
        kv_u32(f"{a}.attention.indexer.key_length", DS4_INDEXER_DIM),
        kv_u32(f"{a}.attention.indexer.top_k", 512),
        kv_u32(f"{a}.attention.output_group_count", DS4_O_GROUPS),
        kv_u32(f"{a}.attention.output_lora_rank", DS4_O_LORA),
        kv_arr(f"{a}.attention.compress_ratios", GGUFValueType.UINT32,
               [_ds4_compress_ratio(cfg, il) for il in range(n_all)]),
        kv_f32(f"{a}.attention.compress_rope_freq_base", 160000.0),
        kv_u32(f"{a}.hyper_connection.count", DS4_HC),
        kv_u32(f"{a}.hyper_connection.sinkhorn_iterations", 2),
        kv_f32(f"{a}.hyper_connection.epsilon", 1e-6),
        kv_u32(f"{a}.hash_layer_count", cfg.n_hash_layers),
        kv_u32(f"{a}.embedding_length_out", cfg.n_embd * DS4_HC),
    ]
    if cfg.n_mtp_layers:
        kvs.append(kv_u32(f"{a}.nextn_predict_layers", cfg.n_mtp_layers))
    return kvs


def deepseek4_tensors(cfg: SynthConfig, n_vocab: int) -> list[TensorSpec]:
    d, hd, wt, nh = cfg.n_embd, cfg.head_dim, cfg.weight_type, cfg.n_head
    hc_dim, hc_mix = DS4_HC * d, (2 + DS4_HC) * DS4_HC
    if (nh * hd) % DS4_O_GROUPS:
        raise ValueError(f"deepseek4: n_head*head_dim must be a multiple of {DS4_O_GROUPS}")
    out = [
        TensorSpec("token_embd.weight", (d, n_vocab), parse_type(cfg.embd_type), "embd"),
        _norm("output_norm.weight", d),
        _mat("output.weight", (d, n_vocab), cfg.embd_type),
        TensorSpec("output_hc_fn.weight", (hc_dim, DS4_HC), F32, "normal", std=0.1 * hc_dim ** -0.5),
        TensorSpec("output_hc_base.weight", (DS4_HC,), F32, "zeros"),
        TensorSpec("output_hc_scale.weight", (1,), F32, "ones"),
    ]
    n_shexp = cfg.n_ff_exp * cfg.n_expert_shared
    for il in range(cfg.n_layer_all):
        b = f"blk.{il}"
        out += [
            _norm(f"{b}.attn_norm.weight", d, il),
            TensorSpec(f"{b}.attn_sinks.weight", (nh,), F32, "zeros", il),
            _mat(f"{b}.attn_q_a.weight", (d, DS4_Q_LORA), wt, il),
            _norm(f"{b}.attn_q_a_norm.weight", DS4_Q_LORA, il),
            _mat(f"{b}.attn_q_b.weight", (DS4_Q_LORA, nh * hd), wt, il),
            _mat(f"{b}.attn_kv.weight", (d, hd), wt, il),
            _norm(f"{b}.attn_kv_a_norm.weight", hd, il),
            # stored 2-D; the loader reshapes it to {n_head*hd/o_groups, o_lora_rank, o_groups}
            _mat(f"{b}.attn_output_a.weight", (nh * hd // DS4_O_GROUPS, DS4_O_LORA * DS4_O_GROUPS), wt, il),
            _mat(f"{b}.attn_output_b.weight", (DS4_O_GROUPS * DS4_O_LORA, d), wt, il, init="attn_out"),
            TensorSpec(f"{b}.hc_attn_fn.weight", (hc_dim, hc_mix), F32, "normal", il, std=0.1 * hc_dim ** -0.5),
            TensorSpec(f"{b}.hc_attn_base.weight", (hc_mix,), F32, "zeros", il),
            TensorSpec(f"{b}.hc_attn_scale.weight", (3,), F32, "ones", il),
            TensorSpec(f"{b}.hc_ffn_fn.weight", (hc_dim, hc_mix), F32, "normal", il, std=0.1 * hc_dim ** -0.5),
            TensorSpec(f"{b}.hc_ffn_base.weight", (hc_mix,), F32, "zeros", il),
            TensorSpec(f"{b}.hc_ffn_scale.weight", (3,), F32, "ones", il),
        ]
        ratio = _ds4_compress_ratio(cfg, il)
        if ratio:
            coff = 2 if ratio == 4 else 1
            out += [
                _mat(f"{b}.attn_compressor_kv.weight", (d, coff * hd), wt, il),
                _mat(f"{b}.attn_compressor_gate.weight", (d, coff * hd), wt, il),
                TensorSpec(f"{b}.attn_compressor_ape.weight", (coff * hd, ratio), F32, "normal", il, std=0.02),
                _norm(f"{b}.attn_compressor_norm.weight", hd, il),
            ]
            if ratio == 4:
                idim = DS4_INDEXER_DIM
                out += [
                    _mat(f"{b}.indexer.proj.weight", (d, DS4_INDEXER_HEADS), wt, il),
                    _mat(f"{b}.indexer.attn_q_b.weight", (DS4_Q_LORA, DS4_INDEXER_HEADS * idim), wt, il),
                    _mat(f"{b}.indexer_compressor_kv.weight", (d, 2 * idim), wt, il),
                    _mat(f"{b}.indexer_compressor_gate.weight", (d, 2 * idim), wt, il),
                    TensorSpec(f"{b}.indexer_compressor_ape.weight", (2 * idim, ratio), F32, "normal", il, std=0.02),
                    _norm(f"{b}.indexer_compressor_norm.weight", idim, il),
                ]
        out.append(_router(cfg, il))
        if il < cfg.n_hash_layers:
            out.append(TensorSpec(f"{b}.ffn_gate_tid2eid.weight", (cfg.n_expert_used, n_vocab), I32, "tid2eid", il))
        else:
            out.append(TensorSpec(f"{b}.exp_probs_b.bias", (cfg.n_expert,), F32, "probs_b", il))
        out.append(_norm(f"{b}.ffn_norm.weight", d, il))
        out += _experts(cfg, il, d, cfg.n_ff_exp)
        out += [
            _mat(f"{b}.ffn_gate_shexp.weight", (d, n_shexp), wt, il),
            _mat(f"{b}.ffn_down_shexp.weight", (n_shexp, d), wt, il, init="ffn_out"),
            _mat(f"{b}.ffn_up_shexp.weight", (d, n_shexp), wt, il),
        ]
        if il >= cfg.n_layer:  # MTP block
            out += [
                _mat(f"{b}.nextn.eh_proj.weight", (2 * d, d), wt, il),
                _norm(f"{b}.nextn.enorm.weight", d, il),
                _norm(f"{b}.nextn.hnorm.weight", d, il),
            ]
    return out


# --------------------------------------------------------------------------------------------------------
# kimi-k3 (src/models/kimi-k3.cpp): hybrid KDA (linear) + MLA attention, dense leading layers, latent
# experts, shared experts, cross-layer attention residuals, situ activation

K3_KDA_HEAD_DIM = 32
K3_KV_LORA = 64
K3_Q_LORA = 64
K3_NOPE = 32
K3_ROPE = 16
K3_V_HEAD = 32
K3_CONV = 4
K3_FULL_ATTN_EVERY = 4  # layer i uses MLA when i % 4 == 0, KDA otherwise


def _k3_is_mla(il: int) -> bool:
    return il % K3_FULL_ATTN_EVERY == 0


def kimi_k3_kvs(cfg: SynthConfig) -> list[KV]:
    a = "kimi-k3"
    return _common_kvs(cfg, a) + [
        kv_u32(f"{a}.feed_forward_length", cfg.n_ff),
        kv_u32(f"{a}.attention.head_count", cfg.n_head),
        kv_arr(f"{a}.attention.head_count_kv", GGUFValueType.UINT32,
               [1 if _k3_is_mla(il) else 0 for il in range(cfg.n_layer)]),
        kv_u32(f"{a}.attention.key_length", K3_KV_LORA + K3_ROPE),
        kv_u32(f"{a}.attention.value_length", K3_KV_LORA),
        kv_u32(f"{a}.attention.key_length_mla", K3_NOPE + K3_ROPE),
        kv_u32(f"{a}.attention.value_length_mla", K3_V_HEAD),
        kv_u32(f"{a}.attention.q_lora_rank", K3_Q_LORA),
        kv_u32(f"{a}.attention.kv_lora_rank", K3_KV_LORA),
        kv_u32(f"{a}.rope.dimension_count", K3_ROPE),
        kv_u32(f"{a}.ssm.conv_kernel", K3_CONV),
        kv_u32(f"{a}.kda.head_dim", K3_KDA_HEAD_DIM),
        kv_f32(f"{a}.kda.gate_lower_bound", -5.0),
        kv_u32(f"{a}.expert_shared_count", cfg.n_expert_shared),
        kv_u32(f"{a}.leading_dense_block_count", cfg.n_dense_lead),
        kv_f32(f"{a}.expert_weights_scale", 2.5),
        kv_bool(f"{a}.expert_weights_norm", True),
        kv_u32(f"{a}.expert_gating_func", 2),  # sigmoid
        kv_u32(f"{a}.attn_res.block_size", 4),
        kv_f32(f"{a}.activation.situ_beta", 4.0),
        kv_f32(f"{a}.activation.situ_linear_beta", 25.0),
    ] + ([kv_u32(f"{a}.expert_latent_length", cfg.n_expert_latent)] if cfg.n_expert_latent else [])


def kimi_k3_tensors(cfg: SynthConfig, n_vocab: int) -> list[TensorSpec]:
    d, wt, nh = cfg.n_embd, cfg.weight_type, cfg.n_head
    latent = cfg.n_expert_latent or d
    out = [
        TensorSpec("token_embd.weight", (d, n_vocab), parse_type(cfg.embd_type), "embd"),
        _norm("output_norm.weight", d),
        _mat("output.weight", (d, n_vocab), cfg.embd_type),
        TensorSpec("output_res_score.weight", (d,), F32, "normal", std=0.1),
    ]
    for il in range(cfg.n_layer):
        b = f"blk.{il}"
        out += [
            _norm(f"{b}.attn_norm.weight", d, il),
            _norm(f"{b}.ffn_norm.weight", d, il),
            TensorSpec(f"{b}.attn_res_score.weight", (d,), F32, "normal", il, std=0.1),
            TensorSpec(f"{b}.ffn_res_score.weight", (d,), F32, "normal", il, std=0.1),
        ]
        if not _k3_is_mla(il):
            d_inner = K3_KDA_HEAD_DIM * nh
            out += [TensorSpec(f"{b}.ssm_conv1d_{x}.weight", (K3_CONV, 1, d_inner, 1), F32, "normal", il, std=0.3)
                    for x in ("q", "k", "v")]
            out += [
                _mat(f"{b}.attn_q.weight", (d, d_inner), wt, il),
                _mat(f"{b}.attn_k.weight", (d, d_inner), wt, il),
                _mat(f"{b}.attn_v.weight", (d, d_inner), wt, il),
                _mat(f"{b}.ssm_f_a.weight", (d, K3_KDA_HEAD_DIM), wt, il),
                _mat(f"{b}.ssm_f_b.weight", (K3_KDA_HEAD_DIM, d_inner), wt, il),
                _mat(f"{b}.ssm_beta.weight", (d, nh), wt, il),
                TensorSpec(f"{b}.ssm_a", (nh,), F32, "neg_uniform", il),
                TensorSpec(f"{b}.ssm_dt.bias", (d_inner,), F32, "zeros", il),
                _mat(f"{b}.ssm_g.weight", (d, d_inner), wt, il),
                _norm(f"{b}.ssm_norm.weight", K3_KDA_HEAD_DIM, il),
                _mat(f"{b}.attn_output.weight", (d_inner, d), wt, il, init="attn_out"),
            ]
        else:
            out += [
                _norm(f"{b}.attn_q_a_norm.weight", K3_Q_LORA, il),
                _norm(f"{b}.attn_kv_a_norm.weight", K3_KV_LORA, il),
                _mat(f"{b}.attn_q_a.weight", (d, K3_Q_LORA), wt, il),
                _mat(f"{b}.attn_q_b.weight", (K3_Q_LORA, nh * (K3_NOPE + K3_ROPE)), wt, il),
                _mat(f"{b}.attn_kv_a_mqa.weight", (d, K3_KV_LORA + K3_ROPE), wt, il),
                # the absorbed MLA form (what the converter writes; the graph needs it)
                _mat(f"{b}.attn_k_b.weight", (K3_NOPE, K3_KV_LORA, nh), wt, il),
                _mat(f"{b}.attn_v_b.weight", (K3_KV_LORA, K3_V_HEAD, nh), wt, il),
                _mat(f"{b}.attn_gate.weight", (d, nh * K3_V_HEAD), wt, il),
                _mat(f"{b}.attn_output.weight", (nh * K3_V_HEAD, d), wt, il, init="attn_out"),
            ]
        if not cfg.is_moe_layer(il):
            out += [
                _mat(f"{b}.ffn_gate.weight", (d, cfg.n_ff), wt, il),
                _mat(f"{b}.ffn_down.weight", (cfg.n_ff, d), wt, il, init="ffn_out"),
                _mat(f"{b}.ffn_up.weight", (d, cfg.n_ff), wt, il),
            ]
            continue
        out += [
            _router(cfg, il),
            TensorSpec(f"{b}.exp_probs_b.bias", (cfg.n_expert,), F32, "probs_b", il),
        ] + _experts(cfg, il, latent, cfg.n_ff_exp)
        if cfg.n_expert_latent:
            out += [
                _mat(f"{b}.ffn_routed_down.weight", (d, latent), wt, il),
                _mat(f"{b}.ffn_routed_up.weight", (latent, d), wt, il),
                _norm(f"{b}.ffn_routed_norm.weight", latent, il),
            ]
        n_shexp = cfg.n_ff_exp * max(cfg.n_expert_shared, 1)
        if cfg.n_expert_shared:
            out += [
                _mat(f"{b}.ffn_gate_shexp.weight", (d, n_shexp), wt, il),
                _mat(f"{b}.ffn_down_shexp.weight", (n_shexp, d), wt, il, init="ffn_out"),
                _mat(f"{b}.ffn_up_shexp.weight", (d, n_shexp), wt, il),
            ]
    return out


ARCH_KVS = {"qwen3moe": qwen3moe_kvs, "deepseek4": deepseek4_kvs, "kimi-k3": kimi_k3_kvs}
ARCH_TENSORS = {"qwen3moe": qwen3moe_tensors, "deepseek4": deepseek4_tensors, "kimi-k3": kimi_k3_tensors}
