"""A streaming GGUF (v3) writer: metadata first, then tensor data fed chunk by chunk, so that models of tens
of GB are written without holding them in memory. Used by the synthetic-model generator and by the packer
(trunk GGUF). gguf_file.py reads headers back.

GGUF layout (little endian): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv, the KVs, the tensor infos
(name, n_dims, ne[], type, offset from the data section), zero padding to `general.alignment` (default 32),
then each tensor's data, each padded to the alignment.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Sequence

import numpy as np
from gguf import GGUFValueType

from .ggml_types import GGMLQuantizationType, nbytes

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

_SCALAR_FMT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NP_DTYPE = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}


@dataclass
class KV:
    key: str
    type: GGUFValueType
    value: Any
    elem_type: GGUFValueType | None = None  # for arrays


def kv_u32(key: str, v: int) -> KV: return KV(key, GGUFValueType.UINT32, int(v))
def kv_i32(key: str, v: int) -> KV: return KV(key, GGUFValueType.INT32, int(v))
def kv_u16(key: str, v: int) -> KV: return KV(key, GGUFValueType.UINT16, int(v))
def kv_f32(key: str, v: float) -> KV: return KV(key, GGUFValueType.FLOAT32, float(v))
def kv_bool(key: str, v: bool) -> KV: return KV(key, GGUFValueType.BOOL, bool(v))
def kv_str(key: str, v: str) -> KV: return KV(key, GGUFValueType.STRING, str(v))
def kv_arr(key: str, elem: GGUFValueType, v: Sequence) -> KV: return KV(key, GGUFValueType.ARRAY, list(v), elem)


def _pack_str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _pack_kv(kv: KV) -> bytes:
    raw = getattr(kv, "raw", None)  # gguf_file.RawKV: copied verbatim
    if raw is not None:
        return raw
    out = [_pack_str(kv.key), struct.pack("<I", int(kv.type))]
    if kv.type == GGUFValueType.STRING:
        out.append(_pack_str(kv.value))
    elif kv.type == GGUFValueType.ARRAY:
        assert kv.elem_type is not None, kv.key
        out.append(struct.pack("<IQ", int(kv.elem_type), len(kv.value)))
        if kv.elem_type == GGUFValueType.STRING:
            out.extend(_pack_str(s) for s in kv.value)
        else:
            out.append(np.asarray(kv.value, dtype=_NP_DTYPE[kv.elem_type]).astype(
                np.dtype(_NP_DTYPE[kv.elem_type]).newbyteorder("<")).tobytes())
    else:
        out.append(struct.pack(_SCALAR_FMT[kv.type], kv.value))
    return b"".join(out)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]          # ggml order: ne0 (contiguous) first
    type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        return nbytes(self.type, self.shape)


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class GGUFStreamWriter:
    # kvs: KV (encoded here) or gguf_file.RawKV (copied verbatim)
    """Write one GGUF file: `begin()` writes everything up to the data section, then `write_tensor_data()`
    must be called once per tensor, in the order given, with chunks summing to the tensor's size."""

    def __init__(self, path: str | Path, kvs: list[KV], tensors: list[TensorInfo],
                 alignment: int = DEFAULT_ALIGNMENT):
        self.path = Path(path)
        self.kvs = kvs
        self.tensors = tensors
        self.alignment = alignment
        if alignment != DEFAULT_ALIGNMENT and not any(k.key == "general.alignment" for k in kvs):
            self.kvs = kvs + [kv_u32("general.alignment", alignment)]
        self.offsets: list[int] = []
        off = 0
        for t in tensors:
            self.offsets.append(off)
            off = align_up(off + t.nbytes, alignment)
        self.data_size = off
        self._f: BinaryIO | None = None
        self._next = 0
        self.data_start = 0

    def header_bytes(self) -> bytes:
        parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kvs))]
        parts.extend(_pack_kv(kv) for kv in self.kvs)
        for t, off in zip(self.tensors, self.offsets):
            parts.append(_pack_str(t.name))
            parts.append(struct.pack("<I", len(t.shape)))
            parts.append(struct.pack(f"<{len(t.shape)}Q", *t.shape))
            parts.append(struct.pack("<IQ", int(t.type), off))
        head = b"".join(parts)
        return head + b"\0" * (align_up(len(head), self.alignment) - len(head))

    @property
    def total_size(self) -> int:
        return len(self.header_bytes()) + self.data_size

    def begin(self, f: BinaryIO) -> None:
        self._f = f
        head = self.header_bytes()
        f.write(head)
        self.data_start = len(head)

    def write_tensor_data(self, chunks: Iterable[bytes | np.ndarray | memoryview]) -> int:
        assert self._f is not None, "begin() first"
        t = self.tensors[self._next]
        n = 0
        for c in chunks:
            b = memoryview(c).cast("B") if not isinstance(c, (bytes, bytearray)) else c
            self._f.write(b)
            n += len(b)
        if n != t.nbytes:
            raise RuntimeError(f"tensor {t.name}: wrote {n} bytes, expected {t.nbytes}")
        pad = align_up(n, self.alignment) - n
        if pad:
            self._f.write(b"\0" * pad)
        self._next += 1
        return n

    def end(self) -> None:
        if self._next != len(self.tensors):
            raise RuntimeError(f"{self.path}: {self._next} of {len(self.tensors)} tensors written")


def split_path(prefix: str | Path, i: int, n: int) -> Path:
    """llama.cpp's shard naming (llama_split_path): PREFIX-00001-of-00003.gguf."""
    return Path(f"{prefix}-{i + 1:05d}-of-{n:05d}.gguf")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
