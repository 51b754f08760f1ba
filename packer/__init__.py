"""ggml_expert_pack.packer"""
