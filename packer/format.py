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
        if len(raw) < _HEADER.size + _HEADER_CHECK.size:
            raise ValueError("pack header is truncated")
        f = _HEADER.unpack_from(raw)
        if f[0] != MAGIC:
            raise ValueError(f"not an expert pack (magic {f[0]!r}, expected {MAGIC!r})")
        if f[1] != VERSION:
            raise ValueError(f"unsupported expert pack version {f[1]} (this build reads {VERSION})")
        from ..pybind import xxh3_128
        (check,) = _HEADER_CHECK.unpack_from(raw, _HEADER.size)
        if xxh3_128(raw[:_HEADER.size]) != check:
            raise ValueError("pack header checksum mismatch (the header is corrupt)")
        return cls(version=f[1], header_size=f[2], alignment=f[3], n_layers=f[4], n_experts=f[5], flags=f[6],
                   data_start=f[7], data_size=f[8], expert_stride=f[9], pack_id=f[10], manifest_digest=f[11],
                   source_fingerprint=f[12], checksum_algo=f[13])


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


def load_manifest(pack_dir: str | Path) -> dict:
    path = Path(pack_dir) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"{pack_dir} is not an expert pack directory (no {MANIFEST_FILE})")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if m.get("format") != "expert-pack":
        raise ValueError(f"{path}: not an expert-pack manifest")
    if m.get("version") != VERSION:
        raise ValueError(f"{path}: manifest version {m.get('version')}, this build reads {VERSION}")
    return m


def layers_from_manifest(m: dict) -> list[LayerLayout]:
    return [LayerLayout(l["layer"], l["offset"], l["expert_stride"], l["block_bytes"],
                        [RoleLayout.from_json(r) for r in l["roles"]]) for l in m["layers"]]
