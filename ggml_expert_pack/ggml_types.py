"""ggml tensor types: names, block geometry and byte sizes (from the vendored gguf-py, the source of truth
that matches the vendored ggml)."""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Accepted spellings: "q4_k", "Q4_K", "f16", "mxfp4", ...
_BY_NAME = {t.name.lower(): t for t in GGMLQuantizationType}


def parse_type(name: str | int | GGMLQuantizationType) -> GGMLQuantizationType:
    if isinstance(name, GGMLQuantizationType):
        return name
    if isinstance(name, int):
        return GGMLQuantizationType(name)
    t = _BY_NAME.get(str(name).strip().lower())
    if t is None:
        raise ValueError(f"unknown ggml type {name!r}; known: {', '.join(sorted(_BY_NAME))}")
    return t


def block_size(t: GGMLQuantizationType) -> int:
    """Elements per block."""
    return GGML_QUANT_SIZES[t][0]


def type_size(t: GGMLQuantizationType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[t][1]


def row_bytes(t: GGMLQuantizationType, ne0: int) -> int:
    bs, ts = GGML_QUANT_SIZES[t]
    if ne0 % bs:
        raise ValueError(f"row length {ne0} is not a multiple of the {t.name} block size {bs}")
    return ne0 // bs * ts


def nbytes(t: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes of a contiguous tensor; shape in ggml order (ne0 first)."""
    n_rows = 1
    for d in shape[1:]:
        n_rows *= d
    return row_bytes(t, shape[0]) * n_rows


FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def is_quantized(t: GGMLQuantizationType) -> bool:
    return t not in FLOAT_TYPES and t not in (GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                                              GGMLQuantizationType.I32, GGMLQuantizationType.I64,
                                              GGMLQuantizationType.F64)
