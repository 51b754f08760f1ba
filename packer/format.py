"""Expert Pack v1: constants, the pack header, the layout planner and the fingerprints (docs/FORMAT.md).

A pack directory holds three files:
  experts.pack   a 4096-byte header, then every routed expert as one 4096-aligned block
  manifest.json  authoritative description: source, layers, roles, types, shapes, offsets, checksums
  trunk.gguf     the source's metadata and every tensor that is not a routed expert
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..ggml_types import GGMLQuantizationType, nbytes, parse_type

MAGIC = b"GGEXPACK"
VERSION = 1
HEADER_SIZE = 4096
ALIGNMENT = 4096            # every block offset and read length (O_DIRECT)
ROLE_ALIGNMENT = 256        # role offsets inside a block
CHECKSUM_ALGO = "xxh3-128"
PACK_FILE, MANIFEST_FILE, TRUNK_FILE = "experts.pack", "manifest.json", "trunk.gguf"
PER_LAYER_STRIDE_THRESHOLD = 0.03  # per-layer strides only when they save more than 3% of the pack
TRUNK_KV_PACK_ID = "expert_pack.pack_id"
TRUNK_KV_SOURCE = "expert_pack.source_fingerprint"

ROLE_ORDER = ("gate", "up", "gate_up", "down")
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")

# header: magic, version, header_size, alignment, n_layers, n_experts, flags, data_start, data_size,
#         expert_stride (0 when strides differ per layer), pack_id, manifest_digest, source_fingerprint,
#         checksum algorithm id; then a checksum of those bytes; zero padding to HEADER_SIZE
_HEADER = struct.Struct("<8sIIIIII QQQ 16s16s16s I")
_HEADER_CHECK = struct.Struct("<16s")
FLAG_UNIFORM_STRIDE = 1
ALGO_XXH3_128 = 1


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def xxh3_hex(data) -> str:
    from ..pybind import xxh3_128
    return xxh3_128(data).hex()


@dataclass
class PackHeader:
    n_layers: int
    n_experts: int
    flags: int
    data_start: int
    data_size: int
    expert_stride: int
    pack_id: bytes
    manifest_digest: bytes
    source_fingerprint: bytes
    version: int = VERSION
    header_size: int = HEADER_SIZE
    alignment: int = ALIGNMENT
    checksum_algo: int = ALGO_XXH3_128

    def pack(self) -> bytes:
        body = _HEADER.pack(MAGIC, self.version, self.header_size, self.alignment, self.n_layers, self.n_experts,
                            self.flags, self.data_start, self.data_size, self.expert_stride, self.pack_id,
                            self.manifest_digest, self.source_fingerprint, self.checksum_algo)
        from ..pybind import xxh3_128
        raw = body + _HEADER_CHECK.pack(xxh3_128(body))
        return raw + b"\0" * (HEADER_SIZE - len(raw))

    @classmethod
    def unpack(cls, raw: bytes) -> "PackHeader":
        if len(raw) < HEADER_SIZE:
            raise ValueError(f"pack header is truncated ({len(raw)} of {HEADER_SIZE} bytes)")
        f = _HEADER.unpack_from(raw)
        if f[0] != MAGIC:
            raise ValueError(f"not an expert pack (magic {f[0]!r}, expected {MAGIC!r})")
        if f[1] != VERSION:
            raise ValueError(f"unsupported expert pack version {f[1]} (this build reads {VERSION})")
        from ..pybind import xxh3_128
        (check,) = _HEADER_CHECK.unpack_from(raw, _HEADER.size)
        if xxh3_128(raw[:_HEADER.size]) != check:
            raise ValueError("pack header checksum mismatch (the header is corrupt)")
        reserved = raw[_HEADER.size + _HEADER_CHECK.size:HEADER_SIZE]
        if any(reserved):
            first = next(i for i, b in enumerate(reserved) if b) + _HEADER.size + _HEADER_CHECK.size
            raise ValueError(f"pack header: reserved byte {first} is not zero (the header is corrupt)")
        h = cls(version=f[1], header_size=f[2], alignment=f[3], n_layers=f[4], n_experts=f[5], flags=f[6],
                data_start=f[7], data_size=f[8], expert_stride=f[9], pack_id=f[10], manifest_digest=f[11],
                source_fingerprint=f[12], checksum_algo=f[13])
        # fields a reader computes offsets from: checked here so that nobody does arithmetic on them unchecked
        if (h.header_size, h.alignment, h.data_start) != (HEADER_SIZE, ALIGNMENT, HEADER_SIZE):
            raise ValueError(f"pack header: header_size {h.header_size}, alignment {h.alignment}, data_start "
                             f"{h.data_start}; this build reads {HEADER_SIZE}, {ALIGNMENT}, {HEADER_SIZE}")
        if h.checksum_algo != ALGO_XXH3_128:
            raise ValueError(f"pack header: unknown checksum algorithm {h.checksum_algo}")
        if h.flags & ~FLAG_UNIFORM_STRIDE:
            raise ValueError(f"pack header: unknown flags {h.flags:#x}")
        return h


# --------------------------------------------------------------------------------------------------------
# layout

@dataclass
class RoleLayout:
    role: str
    tensor: str
    type: GGMLQuantizationType
    shape: tuple[int, int, int]     # ggml order: (ne0, ne1, n_experts); one expert is ne0 x ne1
    offset: int                     # inside the expert block
    bytes: int                      # of one expert

    def to_json(self) -> dict:
        return {"role": self.role, "tensor": self.tensor, "type": self.type.name, "type_id": int(self.type),
                "shape": list(self.shape), "offset": self.offset, "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: dict) -> "RoleLayout":
        t = parse_type(d["type"])
        if int(t) != d["type_id"]:
            raise ValueError(f"{d['tensor']}: type {d['type']} does not match type_id {d['type_id']}")
        return cls(d["role"], d["tensor"], t, tuple(d["shape"]), d["offset"], d["bytes"])


@dataclass
class LayerLayout:
    layer: int                      # the model's block index (dense layers have no entry)
    offset: int                     # file offset of expert 0's block
    expert_stride: int              # bytes from one expert's block to the next (multiple of ALIGNMENT)
    block_bytes: int                # data bytes of one block (roles + inner padding); the rest is zero
    roles: list[RoleLayout]

    @property
    def read_bytes(self) -> int:
        """What a reader fetches per expert: the block rounded up to the alignment."""
        return align_up(self.block_bytes, ALIGNMENT)

    def expert_offset(self, expert: int) -> int:
        return self.offset + expert * self.expert_stride

    def to_json(self) -> dict:
        return {"layer": self.layer, "offset": self.offset, "expert_stride": self.expert_stride,
                "block_bytes": self.block_bytes, "roles": [r.to_json() for r in self.roles]}


def plan_block(roles: list[tuple[str, str, GGMLQuantizationType, tuple[int, int, int]]]) -> tuple[list[RoleLayout], int]:
    """Place one layer's roles (role, tensor name, type, shape) in an expert block: gate, up, down order."""
    out, off = [], 0
    for role, name, t, shape in sorted(roles, key=lambda r: ROLE_ORDER.index(r[0])):
        b = nbytes(t, shape[:2])
        off = align_up(off, ROLE_ALIGNMENT)
        out.append(RoleLayout(role, name, t, shape, off, b))
        off += b
    return out, off


def plan_layers(blocks: list[tuple[int, list[RoleLayout], int]], n_experts: int, data_start: int = HEADER_SIZE,
                force_uniform: bool | None = None) -> tuple[list[LayerLayout], bool]:
    """Offsets of every layer. One stride for all (the reference formula: data_start + (layer_index *
    n_experts + expert) * stride) unless per-layer strides save more than PER_LAYER_STRIDE_THRESHOLD."""
    strides = [align_up(b, ALIGNMENT) for _, _, b in blocks]
    uniform_size = max(strides) * n_experts * len(blocks)
    per_layer_size = sum(strides) * n_experts
    uniform = (uniform_size - per_layer_size) <= PER_LAYER_STRIDE_THRESHOLD * uniform_size
    if force_uniform is not None:
        uniform = force_uniform
    layers, off = [], data_start
    for (layer, roles, block_bytes), stride in zip(blocks, strides):
        s = max(strides) if uniform else stride
        layers.append(LayerLayout(layer, off, s, block_bytes, roles))
        off += s * n_experts
    return layers, uniform


def layout_identity(source_fingerprint: str, n_experts: int, layers: list[LayerLayout]) -> dict:
    """What pack_id covers: the source and where every byte of every expert is."""
    return {"format": "expert-pack", "version": VERSION, "source_fingerprint": source_fingerprint,
            "n_experts": n_experts, "alignment": ALIGNMENT, "layers": [l.to_json() for l in layers]}


def pack_id(identity: dict) -> str:
    return xxh3_hex(canonical_json(identity))


def manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_digest"}
    return xxh3_hex(canonical_json(body))


class ManifestError(ValueError):
    """A manifest that cannot be read or does not describe a pack; the message says why in one line."""


MAX_MANIFEST_BYTES = 1 << 30  # a manifest of a 1000-layer, 1024-expert model is ~100 MB
_U63 = 1 << 63                # offsets and sizes must fit the C++ reader's int64
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def check_pack_dir(pack_dir: str | Path) -> Path:
    """The pack directory, or a ManifestError saying what the path is instead."""
    d = Path(pack_dir)
    if not d.exists():
        raise ManifestError(f"{d}: no such directory")
    if not d.is_dir():
        raise ManifestError(f"{d} is a file, not a pack directory (give the directory `expert-pack build -o` wrote)")
    return d


def load_manifest(pack_dir: str | Path, validate: bool = True) -> dict:
    """Read DIR/manifest.json. With `validate` (the default), every field a reader uses is checked for presence,
    type and range (validate_manifest) before anything computes with it."""
    d = check_pack_dir(pack_dir)
    path = d / MANIFEST_FILE
    if not path.exists():
        raise ManifestError(f"{d} is not an expert pack directory (no {MANIFEST_FILE})")
    if not path.is_file():
        raise ManifestError(f"{path} is not a file")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: {size} bytes, larger than any manifest ({MAX_MANIFEST_BYTES} at most)")
    try:
        m = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ManifestError(f"{path}: not a manifest (JSON nested too deeply)") from None
    except ValueError as e:  # NaN / Infinity literals
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise ManifestError(f"{path}: not an expert-pack manifest (a JSON {_json_kind(m)}, not an object)")
    if m.get("format") != "expert-pack":
        raise ManifestError(f"{path}: not an expert-pack manifest (format {_short(m.get('format'))})")
    if m.get("version") != VERSION or isinstance(m.get("version"), bool):
        raise ManifestError(f"{path}: manifest version {_short(m.get('version'))}, this build reads {VERSION}")
    if validate:
        validate_manifest(m)
    return m


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _json_kind(v) -> str:
    return {list: "array", str: "string", dict: "object", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _short(v, n: int = 40) -> str:
    r = json.dumps(v) if not isinstance(v, float) or v == v else "NaN"
    return r if len(r) <= n else r[:n] + "..."


class _Fields:
    """Typed access to one JSON object of the manifest, naming the field in every error."""

    def __init__(self, obj, where: str):
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest.json: {where} is a {_json_kind(obj)}, expected an object")
        self.obj, self.where = obj, where

    def _get(self, key: str):
        if key not in self.obj:
            raise ManifestError(f"manifest.json: {self.where}.{key} is missing")
        return self.obj[key]

    def _bad(self, key: str, what: str):
        return ManifestError(f"manifest.json: {self.where}.{key} is {_short(self.obj[key])}, expected {what}")

    def int(self, key: str, lo: int = 0, hi: int = _U63 - 1) -> int:
        v = self._get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self._bad(key, f"an integer in [{lo}, {hi}]")
        return v

    def str(self, key: str, pattern: re.Pattern | None = None, what: str = "a string") -> str:
        v = self._get(key)
        if not isinstance(v, str) or (pattern is not None and not pattern.match(v)):
            raise self._bad(key, what)
        return v

    def hex32(self, key: str) -> str:
        return self.str(key, _HEX32, "32 lowercase hex digits")

    def bool(self, key: str) -> bool:
        v = self._get(key)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def list(self, key: str, min_len: int = 0) -> list:
        v = self._get(key)
        if not isinstance(v, list) or len(v) < min_len:
            raise self._bad(key, f"an array of at least {min_len} item(s)" if min_len else "an array")
        return v

    def obj_(self, key: str) -> "_Fields":
        return _Fields(self._get(key), f"{self.where}.{key}")

    def const(self, key: str, value) -> None:
        v = self._get(key)
        if v != value or type(v) is not type(value):
            raise self._bad(key, json.dumps(value))


def validate_manifest(m: dict) -> None:
    """Presence, type and range of every field a reader uses (docs/FORMAT.md); ManifestError naming the first bad
    field. Layout rules that relate fields to each other (offsets, strides, sizes) are verify's check_structure."""
    top = _Fields(m, "manifest")
    top.const("format", "expert-pack")
    top.const("version", VERSION)
    top.hex32("pack_id")
    top.hex32("manifest_digest")
    n_exp = top.int("n_experts", 1, 1 << 16)
    src = top.obj_("source")
    src.hex32("fingerprint")
    src.str("arch")
    src.str("name")
    files = src.list("files", 1)
    sizes = src.list("sizes")
    for i, f in enumerate(files):
        if not isinstance(f, str) or not _FILE_NAME.match(f):
            raise ManifestError(f"manifest.json: source.files[{i}] is {_short(f)}, expected a file name")
    if len(sizes) != len(files) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _U63
                                           for x in sizes):
        raise ManifestError(f"manifest.json: source.sizes is not one size per source file")
    names = src.list("tensor_names")
    if not all(isinstance(x, str) for x in names):
        raise ManifestError("manifest.json: source.tensor_names holds a non-string")
    pack = top.obj_("pack")
    pack.str("file", _FILE_NAME, "a file name inside the pack directory")
    pack.int("size", HEADER_SIZE)
    pack.const("header_size", HEADER_SIZE)
    pack.const("data_start", HEADER_SIZE)
    pack.int("data_size", 1)
    pack.const("alignment", ALIGNMENT)
    pack.bool("uniform_stride")
    pack.int("expert_stride")
    pack.const("checksum", CHECKSUM_ALGO)
    trunk = top.obj_("trunk")
    trunk.str("file", _FILE_NAME, "a file name inside the pack directory")
    trunk.int("size", 1)
    trunk.hex32("checksum")
    trunk.int("n_tensors")
    if "header_size" in trunk.obj or "header_checksum" in trunk.obj:  # optional: packs of earlier builds lack them
        trunk.int("header_size", 24, trunk.obj["size"] if isinstance(trunk.obj.get("size"), int) else _U63 - 1)
        trunk.hex32("header_checksum")
    layers = top.list("layers", 1)
    prev = -1
    for i, lj in enumerate(layers):
        lf = _Fields(lj, f"layers[{i}]")
        layer = lf.int("layer", 0, MAX_LAYER)
        if layer <= prev:
            raise ManifestError(f"manifest.json: layers[{i}].layer is {layer}: layers must be listed in increasing "
                                f"order, once each")
        prev = layer
        lf.int("offset", HEADER_SIZE)
        lf.int("expert_stride", ALIGNMENT)
        lf.int("block_bytes", 1)
        roles = lf.list("roles", 1)
        seen = []
        for j, rj in enumerate(roles):
            rf = _Fields(rj, f"layers[{i}].roles[{j}]")
            role = rf.str("role", _ROLE_NAME, f"one of {', '.join(ROLE_ORDER)}")
            if role in seen:
                raise ManifestError(f"manifest.json: layers[{i}] has role {role} twice")
            seen.append(role)
            want = f"blk.{layer}.ffn_{role}_exps.weight"
            if rf.str("tensor") != want:
                raise ManifestError(f"manifest.json: layers[{i}].roles[{j}].tensor is {_short(rj['tensor'])}, "
                                    f"expected {want!r}")
            tname = rf.str("type")
            try:
                t = parse_type(tname)
            except ValueError:
                raise rf._bad("type", "a ggml type name") from None
            if rf.int("type_id", 0, 1 << 31) != int(t):
                raise ManifestError(f"manifest.json: {want}: type {t.name} does not match type_id {rj['type_id']}")
            shape = rf.list("shape", 3)
            if len(shape) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < _U63
                                          for x in shape):
                raise rf._bad("shape", "3 positive integers (ne0, ne1, experts)")
            if shape[2] != n_exp:
                raise ManifestError(f"manifest.json: {want} has {shape[2]} experts, n_experts is {n_exp}")
            try:
                b = nbytes(t, shape[:2])
            except ValueError as e:
                raise ManifestError(f"manifest.json: {want}: {e}") from None
            rf.int("offset")
            if rf.int("bytes", 1) != b:
                raise ManifestError(f"manifest.json: {want}: {rj['bytes']} bytes, but one {t.name} expert of "
                                    f"{shape[0]} x {shape[1]} is {b}")
        if "down" not in seen or not set(seen) - {"down"} or ("gate_up" in seen and {"gate", "up"} & set(seen)):
            raise ManifestError(f"manifest.json: layers[{i}] has roles {seen} (needs down with gate/up or gate_up)")
        sums = lf.list("checksums")
        if len(sums) != n_exp:
            raise ManifestError(f"manifest.json: layers[{i}] has {len(sums)} checksums for {n_exp} experts")
        for e, c in enumerate(sums):
            if not isinstance(c, str) or not _HEX32.match(c):
                raise ManifestError(f"manifest.json: layers[{i}].checksums[{e}] is {_short(c)}, expected 32 "
                                    f"lowercase hex digits")


MAX_LAYER = 1 << 16  # a GGUF block index; llama.cpp's own limit is 512
_ROLE_NAME = re.compile(r"^(" + "|".join(ROLE_ORDER) + r")$")


def layers_from_manifest(m: dict) -> list[LayerLayout]:
    try:
        return [LayerLayout(l["layer"], l["offset"], l["expert_stride"], l["block_bytes"],
                            [RoleLayout.from_json(r) for r in l["roles"]]) for l in m["layers"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(f"manifest.json: malformed layer table ({type(e).__name__}: {e})") from None
