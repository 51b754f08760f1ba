"""ggml_expert_pack.pybind"""
