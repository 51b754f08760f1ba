"""ggml_expert_pack.server"""
