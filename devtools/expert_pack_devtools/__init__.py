"""expert-pack's development tooling, apart from the product (ggml_expert_pack): what the tests, the benchmarks and
the design studies use, never imported by the runtime, the packer, the binding or the server.

  synth         synthetic MoE models in real architectures (qwen3moe, deepseek4, kimi-k3) with realistic routing
  routing       routing traces from stock llama.cpp and their statistics against real models' bands
  policy_sim    cache policies (LRU, LFU, ours, A0, Belady) replayed over routing traces
  lossless      a model run through llama.cpp's low-level API with and without a pack (the lossless checks)
  bench_client  the reference workload against a llama-server-compatible endpoint
  bench         the benchmark harness: named system configurations and questions (docs/BENCHMARKS.md)
  cli           the `expert-pack` development subcommands (demo, synth, routing-stats, bench-client, policy-sim)

Installed as `expert_pack_devtools` (source folder devtools/expert_pack_devtools/, pyproject.toml).
"""
