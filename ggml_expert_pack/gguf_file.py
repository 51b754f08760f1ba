"""A fast GGUF header reader: KV metadata and tensor infos with absolute data offsets.

gguf-py's GGUFReader builds a numpy view per array element and takes ~15 s on a 150k-token vocabulary; this
reads the same header in well under a second by skipping what it does not decode. KVs keep their raw
encoded bytes so that they can be copied verbatim into another GGUF (a trunk, a synthetic model).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from .ggml_types import GGMLQuantizationType, nbytes

_SCALAR = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1), GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2), GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1), GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8), GGUFValueType.FLOAT64: ("<d", 8),
}
MAX_ARRAY_DECODE = 4096  # arrays longer than this are skipped (kept raw), not decoded


class GGUFFormatError(ValueError):
    pass


@dataclass
class RawKV:
    key: str
    type: GGUFValueType
    value: Any              # decoded value; for long arrays: None (see n_items)
    raw: bytes              # the whole encoded entry (key + type + value), ready to copy
    elem_type: GGUFValueType | None = None
    n_items: int = 0


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # ggml order
    type: GGMLQuantizationType
    offset: int             # absolute file offset of the data
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    kvs: dict[str, RawKV]
    tensors: list[TensorEntry]
    alignment: int
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kvs.get(key)
        return default if kv is None else kv.value

    @property
    def arch(self) -> str:
        return self.get("general.architecture", "")

    def tensor(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Buf:
    def __init__(self, f, size: int):
        self.f, self.size = f, size
        self.buf = b""
        self.base = 0   # file offset of buf[0]
        self.pos = 0    # absolute position

    def need(self, n: int) -> memoryview:
        rel = self.pos - self.base
        if rel + n > len(self.buf):
            if self.pos + n > self.size:
                raise GGUFFormatError(f"truncated GGUF header (needs {self.pos + n} bytes, file has {self.size})")
            self.f.seek(self.pos)
            self.buf = self.f.read(max(n, 1 << 20))
            self.base, rel = self.pos, 0
        mv = memoryview(self.buf)[rel:rel + n]
        self.pos += n
        return mv

    def u32(self) -> int: return struct.unpack("<I", self.need(4))[0]
    def u64(self) -> int: return struct.unpack("<Q", self.need(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        if n > (1 << 30):
            raise GGUFFormatError(f"implausible string length {n} at offset {self.pos - 8}")
        return bytes(self.need(n))

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            n = self.u64()
            rel = self.pos - self.base
            if rel + n <= len(self.buf):
                self.pos += n
            else:
                self.need(n)

    def span(self, start: int) -> bytes:
        """Raw bytes from absolute `start` to the current position."""
        if start >= self.base:
            return self.buf[start - self.base:self.pos - self.base]
        cur = self.pos
        self.f.seek(start)
        data = self.f.read(cur - start)
        self.pos = cur
        return data


def _read_value(b: _Buf, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None, int]:
    if vtype == GGUFValueType.STRING:
        return b.string().decode("utf-8", errors="replace"), None, 0
    if vtype == GGUFValueType.ARRAY:
        etype = GGUFValueType(b.u32())
        count = b.u64()
        if etype == GGUFValueType.STRING:
            if count > MAX_ARRAY_DECODE:
                b.skip_strings(count)
                return None, etype, count
            return [b.string().decode("utf-8", errors="replace") for _ in range(count)], etype, count
        if etype == GGUFValueType.ARRAY:
            raise GGUFFormatError("nested arrays are not supported")
        fmt, size = _SCALAR[etype]
        raw = b.need(size * count)
        if count > MAX_ARRAY_DECODE:
            return None, etype, count
        return list(struct.unpack(f"<{count}{fmt[1]}", raw)), etype, count
    fmt, size = _SCALAR[vtype]
    return struct.unpack(fmt, b.need(size))[0], None, 0


def read_header(path: str | Path) -> GGUFHeader:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        b = _Buf(f, size)
        magic = bytes(b.need(4)) if size >= 4 else b""
        if magic != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file (magic {magic!r})")
        version = b.u32()
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = b.u64(), b.u64()
        if n_tensors > (1 << 24) or n_kv > (1 << 20):
            raise GGUFFormatError(f"{path}: implausible header ({n_tensors} tensors, {n_kv} KVs)")
        kvs: dict[str, RawKV] = {}
        for _ in range(n_kv):
            start = b.pos
            key = b.string().decode("utf-8", errors="replace")
            try:
                vtype = GGUFValueType(b.u32())
            except ValueError as e:
                raise GGUFFormatError(f"{path}: bad value type for key {key!r}") from e
            value, etype, count = _read_value(b, vtype)
            kvs[key] = RawKV(key, vtype, value, b.span(start), etype, count)
        infos = []
        for _ in range(n_tensors):
            name = b.string().decode("utf-8", errors="replace")
            n_dims = b.u32()
            if n_dims > 4:
                raise GGUFFormatError(f"{path}: tensor {name!r} has {n_dims} dims")
            shape = struct.unpack(f"<{n_dims}Q", b.need(8 * n_dims))
            ttype, off = struct.unpack("<IQ", b.need(12))
            try:
                ttype = GGMLQuantizationType(ttype)
            except ValueError as e:
                raise GGUFFormatError(f"{path}: tensor {name!r} has unknown type {ttype}") from e
            infos.append((name, tuple(int(x) for x in shape), ttype, off))
        alignment = kvs["general.alignment"].value if "general.alignment" in kvs else 32
        data_offset = (b.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, ttype, off in infos:
        try:
            nb = nbytes(ttype, shape)
        except ValueError as e:
            raise GGUFFormatError(f"{path}: tensor {name!r}: {e}") from e
        tensors.append(TensorEntry(name, shape, ttype, data_offset + off, nb))
    return GGUFHeader(path, version, kvs, tensors, alignment, data_offset, size)
