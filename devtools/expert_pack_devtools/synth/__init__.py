"""Synthetic MoE models in real llama.cpp architectures (qwen3moe, deepseek4, kimi-k3), with random weights
and realistic routing, written as GGUF. Used by the tests and the benchmarks: there are no real MoE weights
on our machines."""
from .config import ARCHS, SHAPES, RoutingConfig, SynthConfig
from .generate import generate, plan

__all__ = ["ARCHS", "SHAPES", "RoutingConfig", "SynthConfig", "generate", "plan"]
