"""GPU path (marker `gpu`; skipped without a CUDA device): trunk + pack on the GPU against stock llama.cpp on
the original GGUF, same GPU, for the three main architectures, at the minimum cache and all-fit.

The criterion (DESIGN.md trap 11): greedy tokens identical, and max |delta logit| within the difference that
stock llama.cpp shows between its own runs at two n_ubatch settings (GPU kernels depend on the batch shape
and on the number of experts in the weight tensor, so bit equality is not guaranteed beyond a few tokens).
"""
from __future__ import annotations

import numpy as np
import pytest

from ggml_expert_pack.lossless import cache_mib_for_slots, run
from ggml_expert_pack.pybind.provider import Provider

pytestmark = pytest.mark.gpu

ARCHS = ["qwen3moe", "deepseek4", "kimi-k3"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", [4, None], ids=["min", "all-fit"])
def test_gpu_lossless(packs, arch, slots):
    src, pack = packs(arch)
    cfg = dict(cache_vram_reserve_mib=0)
    if slots:
        cfg["cache_vram_mib"] = cache_mib_for_slots(pack, slots)
    p = Provider.open(pack, **cfg)
    try:
        # the product path: the trunk + the pack, without the original
        with_pack = run(pack / "trunk.gguf", p, n_gpu_layers=-1, prompt_len=64)
        stats = p.stats()
    finally:
        p.close()
    assert with_pack.error == 0
    ub = with_pack.n_ubatch
    stock = run(src, None, n_gpu_layers=-1, n_ubatch=ub, prompt_len=64)
    stock_other = run(src, None, n_gpu_layers=-1, n_ubatch=max(1, ub // 2) if ub > 1 else 2, prompt_len=64)
    bound = float(np.abs(stock.logits - stock_other.logits).max())
    diff = float(np.abs(stock.logits - with_pack.logits).max())
    print(f"\n{arch} slots={slots or 'all'} ubatch={ub}: max|pack-stock|={diff:.3g}, stock's own bound={bound:.3g}, "
          f"bit-identical={diff == 0.0}, stats={ {k: stats[k] for k in ('cache_hits', 'cache_misses', 'cache_evictions', 'pack_read_bytes', 'h2d_bytes', 'io_errors', 'resident_layers')} }")
    assert with_pack.tokens == stock.tokens
    assert diff <= bound
    assert stats["io_errors"] == 0 and stats["cache_misses"] > 0
