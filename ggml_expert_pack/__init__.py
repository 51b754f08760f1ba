"""expert-pack: run Mixture-of-Experts models far larger than GPU memory by streaming routed experts
from an SSD expert pack into a GPU-resident expert cache (a patched llama.cpp, driven from Python).

Subpackages:
  synth    synthetic MoE models in real architectures (qwen3moe, deepseek4, kimi-k3) for tests and benchmarks
  packer   offline: GGUF -> expert pack + manifest + trunk GGUF          (source folder packer/)
  pybind   cffi binding to the runtime provider's C API                 (source folder pybind/)
  server   llama-server-compatible HTTP server                          (source folder server/)
"""
__version__ = "0.2.0"

# The wheel installs packer/, server/ and pybind/ inside this package. In a source checkout they sit beside
# it; extending __path__ makes `ggml_expert_pack.packer` import the same way in both layouts (e.g. when
# `python -m pytest` puts the checkout first on sys.path).
import os as _os

_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "packer")):
    _src = _os.path.dirname(_here)
    if all(_os.path.isfile(_os.path.join(_src, d, "__init__.py")) for d in ("packer", "server", "pybind")):
        __path__.append(_src)  # noqa: F821 (module __path__)
