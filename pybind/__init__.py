"""cffi binding to the runtime provider's C API (libggml-expert-pack, ggml_expert_pack/include/expert_pack.h).

ABI mode: the declarations are read from the installed header itself, so the binding cannot drift from the
library; llama_cpp keeps its own ctypes binding for llama.h (docs/ARCHITECTURE.md, "Decisions": two FFI layers).
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from cffi import FFI

HEADER = Path(__import__("ggml_expert_pack").__file__).resolve().parent / "include" / "expert_pack.h"


def _declarations(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = [ln for ln in text.splitlines()
             if not ln.lstrip().startswith("#") and ln.strip() not in ('extern "C" {', "}")]
    return "\n".join(lines).replace("EXPERT_PACK_API", "")


@functools.lru_cache(maxsize=None)
def _load():
    from ..libggml import lib_dir
    ffi = FFI()
    ffi.cdef(_declarations(HEADER.read_text()))
    return ffi, ffi.dlopen(str(lib_dir() / "libggml-expert-pack.so"))


def ffi():
    return _load()[0]


def lib():
    return _load()[1]


def version() -> str:
    return ffi().string(lib().expert_pack_version()).decode()


def xxh3_128(data) -> bytes:
    """XXH3-128 of a bytes-like object (numpy arrays included), 16 bytes, canonical order."""
    f, L = _load()
    buf = f.from_buffer(data)
    out = f.new("uint8_t[16]")
    L.expert_pack_xxh3_128(buf, len(buf), out)
    return bytes(out)


class Hasher:
    """Streaming XXH3-128."""

    def __init__(self):
        f, L = _load()
        self._h = f.gc(L.expert_pack_hasher_new(), L.expert_pack_hasher_free)

    def update(self, data) -> "Hasher":
        f, L = _load()
        buf = f.from_buffer(data)
        L.expert_pack_hasher_update(self._h, buf, len(buf))
        return self

    def digest(self) -> bytes:
        f, L = _load()
        out = f.new("uint8_t[16]")
        L.expert_pack_hasher_digest(self._h, out)
        return bytes(out)
