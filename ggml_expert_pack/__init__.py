"""expert-pack: run Mixture-of-Experts models far larger than GPU memory by streaming routed experts
from an SSD expert pack into a GPU-resident expert cache (a patched llama.cpp, driven from Python).

Subpackages (the wheel installs each source folder here, pyproject.toml):
  packer   offline: GGUF -> expert pack + manifest + trunk GGUF          (source folder packer/)
  pybind   cffi binding to the runtime provider's C API                 (source folder pybind/)
  server   llama-server-compatible HTTP server                          (source folder server/)

Development tooling (synthetic models, routing studies, benchmarks) is the separate package expert_pack_devtools.
"""
__version__ = "0.2.0"
