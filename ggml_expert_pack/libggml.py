"""ctypes access to the few libggml-base functions the Python side needs (quantization, row validation).

PyPI's gguf and the vendored gguf-py can only *de*quantize K-quants; quantizing goes through the very ggml
that llama.cpp runs (docs/ARCHITECTURE.md, trap 12), shipped in llama_cpp/lib by this wheel.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from .ggml_types import GGMLQuantizationType, nbytes


def lib_dir() -> Path:
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    if env:
        return Path(env)
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("the llama_cpp package (shipped by this wheel) is not installed")
    return Path(spec.origin).parent / "lib"


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    path = lib_dir() / "libggml-base.so"
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize a float32 matrix of shape (n_rows, ne0) (numpy order) into ggml type `qtype`.
    Returns the raw bytes as a uint8 array of shape (n_rows, row_bytes). Releases the GIL while it runs."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    n_rows, ne0 = x.shape
    if qtype == GGMLQuantizationType.F32:
        return x.view(np.uint8).reshape(n_rows, -1)
    if qtype == GGMLQuantizationType.F16:
        return x.astype(np.float16).view(np.uint8).reshape(n_rows, -1)
    lib = _lib()
    if lib.ggml_quantize_requires_imatrix(int(qtype)):
        raise ValueError(f"{qtype.name} needs an importance matrix; pick another type")
    lib.ggml_quantize_init(int(qtype))
    out = np.empty(nbytes(qtype, (ne0, n_rows)), dtype=np.uint8)
    written = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, n_rows, ne0, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out.reshape(n_rows, -1)


def validate(qtype: GGMLQuantizationType, data: np.ndarray) -> bool:
    """ggml's own check: no NaN/Inf in scales or values."""
    data = np.ascontiguousarray(data)
    return bool(_lib().ggml_validate_row_data(int(qtype), data.ctypes.data, data.nbytes))


GGML_BACKEND_DEVICE_TYPE_GPU = 1


def gpu_devices() -> list[str]:
    """Names of the GPU devices the installed ggml can use (empty on a CPU build or without a GPU)."""
    lib = ctypes.CDLL(str(lib_dir() / "libggml.so"))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU:
            out.append(lib.ggml_backend_dev_name(dev).decode())
    return out
