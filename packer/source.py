"""The model to pack: one GGUF or a llama.cpp split (first shard given), its tensors and routed experts."""
from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFValueType as V

from ..ggml_types import GGMLQuantizationType, block_size
from ..gguf_file import GGUFFormatError, GGUFHeader, TensorEntry, read_header
from ..gguf_stream import split_path
from .format import EXPERT_TENSOR, ROLE_ORDER
from .llama_ops import ROPE_FULL_HEAD, allowed_types, known_name

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class SourceError(ValueError):
    """A source model that cannot be packed; the message says why in one line."""


@dataclass
class SourceTensor:
    entry: TensorEntry
    shard: int

    @property
    def name(self) -> str:
        return self.entry.name


@dataclass
class Source:
    paths: list[Path]
    headers: list[GGUFHeader]
    tensors: list[SourceTensor]                       # in file order, shard by shard
    experts: dict[int, dict[str, SourceTensor]] = field(default_factory=dict)  # layer -> role -> tensor
    n_experts: int = 0

    @property
    def meta(self) -> GGUFHeader:
        return self.headers[0]

    @property
    def arch(self) -> str:
        return self.meta.arch

    def fingerprint(self) -> str:
        """XXH3-128 over every shard's header bytes and size: identifies the source without reading its
        data (the data of every expert is covered by the per-block checksums)."""
        from ..pybind import Hasher
        h = Hasher()
        for p, hd in zip(self.paths, self.headers):
            with open(p, "rb") as f:
                h.update(f.read(hd.data_offset))
            h.update(struct.pack("<Q", hd.file_size))
        return h.digest().hex()

    @property
    def total_bytes(self) -> int:
        return sum(t.entry.nbytes for t in self.tensors)


def shard_paths(first: Path, header: GGUFHeader) -> list[Path]:
    count = header.get("split.count", 0) or 0
    if count <= 1:
        return [first]
    if header.get("split.no", 0) != 0:
        raise SourceError(f"{first} is shard {header.get('split.no') + 1} of {count}; give the first shard")
    m = _SPLIT_NAME.match(first.name)
    if not m:
        raise SourceError(f"{first} declares {count} shards but is not named PREFIX-00001-of-{count:05d}.gguf")
    prefix = first.parent / m.group("prefix")
    paths = [split_path(prefix, i, count) for i in range(count)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise SourceError(f"missing shard{'s' if len(missing) > 1 else ''} of {first.name}: {', '.join(missing)}")
    return paths


# what a header parser can trip on in a damaged file; each means "not a valid GGUF", never a bug to show
_PARSE_ERRORS = (GGUFFormatError, ValueError, KeyError, IndexError, TypeError, struct.error, ZeroDivisionError,
                 OverflowError, UnicodeError, MemoryError)
GGML_MAX_NAME = 64          # ggml.h: tensor names are shorter
_I64 = 1 << 63


def read_gguf(path: str | Path) -> GGUFHeader:
    """read_header, plus what llama.cpp's gguf.cpp refuses that the fast reader does not look at: duplicate or
    empty keys, an alignment that is not a power of two, long or duplicate tensor names, dimensions past int64,
    tensor data that does not follow the infos in order. GGUFFormatError names the problem."""
    path = Path(path)
    try:
        h = read_header(path)
    except GGUFFormatError:
        raise
    except _PARSE_ERRORS as e:
        raise GGUFFormatError(f"{path}: not a valid GGUF header ({type(e).__name__}: {e})") from None
    with open(path, "rb") as f:
        n_tensors, n_kv = struct.unpack("<QQ", f.read(24)[8:24])
    if len(h.kvs) != n_kv:
        raise GGUFFormatError(f"{path}: duplicate metadata keys ({n_kv} KVs, {len(h.kvs)} distinct keys)")
    if "" in h.kvs:
        raise GGUFFormatError(f"{path}: a metadata key is empty")
    al = h.kvs.get("general.alignment")
    if al is not None and (al.type != V.UINT32 or al.value <= 0 or al.value & (al.value - 1)):
        raise GGUFFormatError(f"{path}: general.alignment must be a power of two (uint32), not {al.value!r}")
    seen = set()
    expect, prev = h.data_offset, None
    for t in h.tensors:
        if not t.name or len(t.name.encode()) >= GGML_MAX_NAME:
            raise GGUFFormatError(f"{path}: tensor name {t.name!r} is empty or {GGML_MAX_NAME} bytes or longer")
        if t.name in seen:
            raise GGUFFormatError(f"{path}: tensor {t.name!r} appears twice")
        seen.add(t.name)
        if any(d >= _I64 for d in t.shape) or math.prod(t.shape) >= _I64:
            raise GGUFFormatError(f"{path}: tensor {t.name!r} has shape {list(t.shape)}, past int64")
        if t.offset != expect:
            after = (f"after {prev.name} ({prev.type.name} {list(prev.shape)}: {prev.nbytes} bytes; a wrong type or "
                     f"shape there moves every later tensor)" if prev else "at the start of the data section")
            raise GGUFFormatError(f"{path}: tensor {t.name} data at offset {t.offset - h.data_offset} of the data "
                                  f"section, expected {expect - h.data_offset} {after}")
        expect = (t.offset + t.nbytes + h.alignment - 1) // h.alignment * h.alignment
        prev = t
    return h


def open_source(path: str | Path) -> Source:
    first = Path(path)
    if not first.exists():
        raise SourceError(f"{first}: no such file")
    if not first.is_file():
        raise SourceError(f"{first} is not a file (give the model's .gguf, or its first shard)")
    try:
        h0 = read_gguf(first)
        paths = shard_paths(first, h0)
        headers = [h0] + [read_gguf(p) for p in paths[1:]]
    except GGUFFormatError as e:
        raise SourceError(str(e)) from None
    for i, (p, h) in enumerate(zip(paths, headers)):
        if len(paths) > 1 and h.get("split.no") != i:
            raise SourceError(f"{p}: split.no is {h.get('split.no')}, expected {i}")
        need = max((t.offset + t.nbytes for t in h.tensors), default=h.data_offset)
        if h.file_size < need:
            raise SourceError(f"{p} is truncated: {h.file_size} bytes, its tensors need {need}")
    tensors = [SourceTensor(t, i) for i, h in enumerate(headers) for t in h.tensors]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise SourceError("duplicate tensor names across shards")
    declared = h0.get("split.tensors.count")
    if declared is not None and declared != len(tensors):
        raise SourceError(f"split.tensors.count is {declared} but the shards hold {len(tensors)} tensors")
    if not h0.arch:
        raise SourceError(f"{first} has no general.architecture")
    src = Source(paths, headers, tensors)
    _find_experts(src)
    check_tensor_types(tensors)
    check_hparams(h0, src.n_experts, {layer: {r: t.entry.shape for r, t in roles.items()}
                                      for layer, roles in src.experts.items()}, names)
    return src


def check_tensor_types(tensors) -> None:
    """Each tensor's type is one its op in llama.cpp can take (llama_ops), and the type's block divides the row."""
    for t in tensors:
        e = getattr(t, "entry", t)
        if not known_name(e.name):
            raise SourceError(f"tensor {e.name} is not one llama.cpp knows: it would refuse the model (it loads "
                              f"only the tensors it creates)")
        ok = allowed_types(e.name, len(e.shape))
        if ok is not None and e.type not in ok:
            want = "F32" if len(ok) == 1 and GGMLQuantizationType.F32 in ok else \
                   "I32" if len(ok) == 1 else "a float or quantized type"
            raise SourceError(f"tensor {e.name} is {e.type.name}, but llama.cpp needs {want} for it "
                              f"({'a norm, bias or scale' if want == 'F32' else 'its op'}; stock llama.cpp "
                              f"cannot run it)")
        if e.shape and e.shape[0] % block_size(e.type):
            raise SourceError(f"tensor {e.name}: rows of {e.shape[0]} elements are not a multiple of the "
                              f"{e.type.name} block ({block_size(e.type)})")


_U32_ARR = (V.UINT32, V.INT32)


def _kv(h: GGUFHeader, key: str, types: tuple, required: bool = False, array_len: int | None = None,
        elem_types: tuple = _U32_ARR):
    """A metadata value checked the way llama.cpp's loader reads it: the exact GGUF type (or, where llama.cpp
    takes a per-layer array, an array of `array_len` items of such a type). None when absent and optional."""
    kv = h.kvs.get(key)
    if kv is None:
        if required:
            raise SourceError(f"{key} is missing (llama.cpp requires it)")
        return None
    names = "/".join(t.name.lower() for t in types)
    if kv.type == V.ARRAY and array_len is not None:
        if kv.elem_type not in elem_types or kv.value is None:
            raise SourceError(f"{key} is an array of {kv.elem_type.name.lower() if kv.elem_type else '?'}, "
                              f"llama.cpp reads {'/'.join(t.name.lower() for t in elem_types)}")
        if len(kv.value) != array_len:
            raise SourceError(f"{key} has {len(kv.value)} items, expected one per block ({array_len})")
        return list(kv.value)
    if kv.type not in types:
        raise SourceError(f"{key} has type {kv.type.name.lower()}, llama.cpp reads {names}")
    return kv.value


def _check_tokens(h: GGUFHeader) -> None:
    """Token strings are distinct (llama.cpp asserts it, after naming empty tokens [EMPTY_<id>])."""
    kv = h.kvs.get("tokenizer.ggml.tokens")
    if kv is None or kv.type != V.ARRAY or kv.elem_type != V.STRING:
        return
    raw = kv.raw
    (klen,) = struct.unpack_from("<Q", raw, 0)
    p = 8 + klen + 4 + 4
    (n,) = struct.unpack_from("<Q", raw, p)
    p += 8
    seen: dict[bytes, int] = {}
    for i in range(n):
        (m,) = struct.unpack_from("<Q", raw, p)
        word = raw[p + 8:p + 8 + m] or f"[EMPTY_{i}]".encode()
        p += 8 + m
        if word in seen:
            raise SourceError(f"tokenizer.ggml.tokens: tokens {seen[word]} and {i} are both "
                              f"{word.decode(errors='replace')!r} (llama.cpp aborts on a repeated token)")
        seen[word] = i


def check_hparams(h: GGUFHeader, n_experts: int, experts: dict[int, dict[str, tuple]],
                  tensor_names=()) -> None:
    """The hyperparameters llama.cpp asserts on or divides by, in range: a model it would refuse or abort on is
    refused here, with the key in the message. `experts`: layer -> role -> shape of the routed-expert tensors;
    `tensor_names`: every tensor of the model (what needs attention heads and norm epsilons)."""
    a = h.arch
    U32, F32 = (V.UINT32,), (V.FLOAT32,)

    def u(key, required=False, lo=0, hi=(1 << 32) - 1):
        v = _kv(h, f"{a}.{key}", U32, required)
        if v is not None and not lo <= v <= hi:
            raise SourceError(f"{a}.{key} is {v}, expected {lo}..{hi}")
        return v

    n_layer = u("block_count", True, 1, 512)
    u("context_length", True, 1, (1 << 31) - 1)  # llama.cpp keeps context sizes in int32
    n_embd = u("embedding_length", True, 1)
    u("nextn_predict_layers", hi=n_layer)
    n_exp = u("expert_count", True, 1, 1024)
    if n_exp != n_experts:
        raise SourceError(f"{a}.expert_count is {n_exp} but the expert tensors hold {n_experts} experts")
    used = _kv(h, f"{a}.expert_used_count", U32, True, n_layer, U32)
    used = used if isinstance(used, list) else [used]
    if not all(isinstance(x, int) and 0 <= x <= n_exp for x in used) or max(used) == 0:
        raise SourceError(f"{a}.expert_used_count is {used if len(used) > 1 else used[0]}, expected 1..{n_exp} "
                          f"(experts per token, at most {a}.expert_count)")
    groups = u("expert_group_count") or 0
    if groups:
        if groups >= n_exp or (groups > 1 and n_exp % groups):
            raise SourceError(f"{a}.expert_group_count is {groups}: it must divide {a}.expert_count ({n_exp}) "
                              f"and be smaller")
        g_used = u("expert_group_used_count") or 0
        if groups > 1 and not 0 < g_used < groups:
            raise SourceError(f"{a}.expert_group_used_count is {g_used}, expected 1..{groups - 1}")
    n_ff = _kv(h, f"{a}.feed_forward_length", U32, False, n_layer)
    attention = any(".attn_" in name for name in tensor_names)
    heads = _kv(h, f"{a}.attention.head_count", U32, attention, n_layer)
    heads_kv = _kv(h, f"{a}.attention.head_count_kv", U32, False, n_layer)
    if isinstance(heads_kv, int) and heads and not heads_kv:
        raise SourceError(f"{a}.attention.head_count_kv is 0 (with {heads} attention heads)")
    if heads is not None and heads_kv is not None:
        hs = heads if isinstance(heads, list) else [heads] * n_layer
        kvs = heads_kv if isinstance(heads_kv, list) else [heads_kv] * n_layer
        for il, (nh, nkv) in enumerate(zip(hs, kvs)):
            if nh and nkv and (nkv > nh or nh % nkv):
                raise SourceError(f"{a}.attention.head_count_kv is {nkv} in block {il}: it must divide "
                                  f"head_count ({nh})")
    k_len = u("attention.key_length", lo=1)
    v_len = u("attention.value_length", lo=1)
    n_rot = u("rope.dimension_count")
    if k_len and n_rot and n_rot > k_len:
        raise SourceError(f"{a}.rope.dimension_count is {n_rot}, more than the head size {a}.attention.key_length "
                          f"({k_len})")
    h0 = heads[0] if isinstance(heads, list) else heads
    if a in ROPE_FULL_HEAD and h0:  # llama.cpp's graph for these asserts that the whole head is rotated
        head_k = k_len or n_embd // h0
        head_v = v_len or n_embd // h0
        rot = n_rot if n_rot is not None else head_k
        if not head_k == head_v == rot:
            raise SourceError(f"{a}: head size {head_k} (key_length), {head_v} (value_length) and "
                              f"rope.dimension_count {rot} must be equal for this architecture")
    for key, kv in h.kvs.items():
        if not key.startswith(a + "."):
            continue
        vals = [kv.value] if kv.type == V.FLOAT32 else \
            kv.value if kv.type == V.ARRAY and kv.elem_type == V.FLOAT32 and kv.value is not None else []
        for x in vals:
            if not math.isfinite(x):
                raise SourceError(f"{key} is {x}: not a finite number")
            if x <= 0 and (key.endswith("epsilon") or key.endswith(".freq_base")):
                raise SourceError(f"{key} is {x}, expected a positive number")
    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base"):
        _kv(h, f"{a}.{key}", F32)
    if any(name.endswith("_norm.weight") for name in tensor_names) and \
            f"{a}.attention.layer_norm_rms_epsilon" not in h.kvs and f"{a}.attention.layer_norm_epsilon" not in h.kvs:
        raise SourceError(f"{a}.attention.layer_norm_rms_epsilon is missing (the model has norms, llama.cpp needs "
                          f"their epsilon)")
    for key in ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask"):
        _kv(h, f"tokenizer.ggml.{key}_token_id", U32)  # llama.cpp reads token ids as uint32
    _check_tokens(h)
    ff = _kv(h, f"{a}.expert_feed_forward_length", U32)
    latent = _kv(h, f"{a}.expert_latent_length", U32)
    widths = {n_embd} | ({latent} if latent else set())
    for layer, roles in sorted(experts.items()):
        if layer >= n_layer:
            raise SourceError(f"blk.{layer} holds routed experts but {a}.block_count is {n_layer}")
        down = roles["down"]
        if "gate_up" in roles:
            gu = roles["gate_up"]
            ok = gu[0] == down[1] and gu[1] == 2 * down[0]
            d_in, d_ff = gu[0], gu[1] // 2
        else:
            g = roles.get("gate") or roles["up"]
            ok = all(roles[r] == g for r in ("gate", "up") if r in roles) and g[0] == down[1] and g[1] == down[0]
            d_in, d_ff = g[0], g[1]
        if not ok:
            raise SourceError(f"layer {layer}: expert shapes disagree ("
                              + ", ".join(f"{r} {list(s[:2])}" for r, s in roles.items()) + ")")
        if d_in not in widths:
            raise SourceError(f"layer {layer}: experts take {d_in} inputs, {a}.embedding_length is {n_embd}")
        if ff and d_ff != ff:
            raise SourceError(f"layer {layer}: experts are {d_ff} wide, {a}.expert_feed_forward_length is {ff}")
        if ff is None and isinstance(n_ff, int) and d_ff != n_ff:  # without the key, experts are n_ff wide
            raise SourceError(f"layer {layer}: experts are {d_ff} wide, but {a}.expert_feed_forward_length is "
                              f"missing and {a}.feed_forward_length is {n_ff}")


def _find_experts(src: Source) -> None:
    arch = src.arch
    declared = src.meta.get(f"{arch}.expert_count")
    for t in src.tensors:
        m = EXPERT_TENSOR.match(t.name)
        if not m:
            continue
        layer, role = int(m.group(1)), m.group(2)
        shape = t.entry.shape
        if len(shape) != 3:
            raise SourceError(f"unsupported layout: {t.name} has {len(shape)} dims, expected 3 (ne0, ne1, experts)")
        src.experts.setdefault(layer, {})[role] = t
    if not src.experts:
        raise SourceError(f"{src.paths[0].name} has no routed experts (no blk.N.ffn_*_exps tensors): nothing to pack")
    counts = {t.entry.shape[2] for roles in src.experts.values() for t in roles.values()}
    if len(counts) != 1:
        raise SourceError(f"unsupported layout: layers have different expert counts {sorted(counts)}")
    src.n_experts = counts.pop()
    if declared is not None and declared != src.n_experts:
        raise SourceError(f"unsupported layout: {arch}.expert_count is {declared} but expert tensors hold "
                          f"{src.n_experts}")
    first = None
    for layer, roles in sorted(src.experts.items()):
        names = set(roles)
        if "down" not in names or ("gate_up" in names and names & {"gate", "up"}) or not names - {"down"}:
            raise SourceError(f"unsupported layout: layer {layer} has expert roles {sorted(names, key=ROLE_ORDER.index)}")
        if first is None:
            first = (layer, names)
        elif names != first[1]:  # llama.cpp creates the same expert tensors in every MoE layer
            raise SourceError(f"layer {layer} has expert roles {sorted(names, key=ROLE_ORDER.index)}, layer "
                              f"{first[0]} {sorted(first[1], key=ROLE_ORDER.index)}: a tensor is missing or misnamed")


def shard_of(src: Source, t: SourceTensor) -> Path:
    return src.paths[t.shard]


def describe(src: Source) -> str:
    return (f"{src.arch} '{src.meta.get('general.name', '')}', {len(src.paths)} file(s), {len(src.tensors)} tensors, "
            f"{len(src.experts)} MoE layers x {src.n_experts} experts")


__all__ = ["Source", "SourceError", "SourceTensor", "describe", "open_source", "shard_of"]
