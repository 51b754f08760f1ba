"""expert-pack: run Mixture-of-Experts models far larger than GPU memory by streaming routed experts
from an SSD expert pack into a GPU-resident expert cache (a patched llama.cpp, driven from Python).

Subpackages:
  synth    synthetic MoE models in real architectures (qwen3moe, deepseek4, kimi-k3) for tests and benchmarks
  packer   offline: GGUF -> expert pack + manifest + trunk GGUF          (source folder packer/)
  pybind   cffi binding to the runtime provider's C API                 (source folder pybind/)
  server   llama-server-compatible HTTP server                          (source folder server/)
"""
__version__ = "0.1.0"
