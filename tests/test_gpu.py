"""GPU path (marker `gpu`; skipped without a CUDA device): trunk + pack on the GPU against stock llama.cpp on
the original GGUF, same GPU, for the three main architectures, at the minimum cache and all-fit.

The criterion (docs/ARCHITECTURE.md, trap 11): greedy tokens identical, and max |delta logit| within the difference that
stock llama.cpp shows between its own runs at two n_ubatch settings (GPU kernels depend on the batch shape
and on the number of experts in the weight tensor, so bit equality is not guaranteed beyond a few tokens).
"""
from __future__ import annotations

import numpy as np
import pytest

from expert_pack_devtools.lossless import cache_mib_for_slots, run
from ggml_expert_pack.pybind.provider import Provider

pytestmark = pytest.mark.gpu

ARCHS = ["qwen3moe", "deepseek4", "kimi-k3"]


def _against_stock(stock, src, with_pack):
    """The GPU criterion: greedy tokens identical to stock's at the same ubatch; returns (max |delta logit|, the bound
    stock shows between its own runs at two ubatch sizes). The stock runs are the session's shared ones (conftest.py)."""
    ub = with_pack.n_ubatch
    ref = stock.run(src, n_gpu_layers=-1, n_ubatch=ub, prompt_len=64)
    ref_other = stock.run(src, n_gpu_layers=-1, n_ubatch=max(1, ub // 2) if ub > 1 else 2, prompt_len=64)
    assert with_pack.tokens == ref.tokens
    return (float(np.abs(ref.logits - with_pack.logits).max()),
            float(np.abs(ref.logits - ref_other.logits).max()))


def _pack_on_gpu(pack, **cfg):
    """The product path on the GPU: the trunk + the pack (without the original), a 64-token prompt and a decode;
    returns the run and the provider's stats (counters and geometry) while attached."""
    p = Provider.open(pack, cache_vram_reserve_mib=0, **cfg)
    try:
        return run(pack / "trunk.gguf", p, n_gpu_layers=-1, prompt_len=64), p.stats()
    finally:
        p.close()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", [4, None], ids=["min", "all-fit"])
def test_gpu_lossless(packs, stock, arch, slots):
    src, pack = packs(arch)
    with_pack, stats = _pack_on_gpu(pack, **({"cache_vram_mib": cache_mib_for_slots(pack, slots)} if slots else {}))
    assert with_pack.error == 0
    ub = with_pack.n_ubatch
    diff, bound = _against_stock(stock, src, with_pack)
    print(f"\n{arch} slots={slots or 'all'} ubatch={ub}: max|pack-stock|={diff:.3g}, stock's own bound={bound:.3g}, "
          f"bit-identical={diff == 0.0}, stats={ {k: stats[k] for k in ('cache_hits', 'cache_misses', 'cache_evictions', 'pack_read_bytes', 'h2d_bytes', 'io_errors', 'resident_layers')} }")
    assert diff <= bound
    assert stats["io_errors"] == 0 and stats["pack_read_bytes"] > 0
    if slots:
        assert stats["cache_misses"] > 0
    else:  # every layer resident: loaded once at start, every step a hit
        assert stats["cache_misses"] == 0 and stats["hit_rate"] == 1.0


@pytest.mark.parametrize("read_threads", [1, 4])
def test_gpu_ram_tier_lossless(packs, stock, read_threads):
    """The host-RAM tier on a GPU: pinned blocks, asynchronous copies from them into the VRAM slots (store_from),
    an evicting device cache and an evicting tier; same criterion as above."""
    from expert_pack_devtools.lossless import ram_mib_for_blocks
    src, pack = packs("qwen3moe")
    with_pack, stats = _pack_on_gpu(pack, cache_vram_mib=cache_mib_for_slots(pack, 4),
                                    ram_cache_mib=ram_mib_for_blocks(pack, 24), read_threads=read_threads)
    assert with_pack.error == 0
    diff, bound = _against_stock(stock, src, with_pack)
    print(f"\nram tier, read_threads={read_threads}: max|pack-stock|={diff:.3g}, stock's own bound={bound:.3g}, "
          f"stats={ {k: stats[k] for k in ('cache_misses', 'ram_hits', 'ram_misses', 'ram_evictions', 'ram_pinned')} }")
    assert diff <= bound
    assert stats["io_errors"] == 0 and stats["cache_misses"] == stats["ram_hits"] + stats["ram_misses"]
    assert stats["ram_hits"] > 0 and stats["ram_evictions"] > 0
    # while attached, the tier is page-locked memory (host buffer type of the device, checked at allocation)
    from expert_pack_devtools.lossless import Session
    p = Provider.open(pack, cache_vram_reserve_mib=0, cache_vram_mib=cache_mib_for_slots(pack, 4),
                      ram_cache_mib=ram_mib_for_blocks(pack, 24), read_threads=read_threads)
    s = Session(pack / "trunk.gguf", p, n_ctx=256, n_gpu_layers=-1)
    try:
        s.generate(list(range(100, 108)), 4)
        attached = p.stats()
    finally:
        s.close()
        p.close()
    assert attached["ram_pinned"] is True and attached["ram_blocks"] == 24


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_gpu_prefetch_lossless(packs, stock, arch):
    """Next-layer prefetch on a GPU: the next router's product and top-k on the device, the prefetch op on the CPU
    after the acquire op, background reads into pinned RAM blocks, their copies at the next layer's acquire; same
    criterion as above, and the prefetches are used."""
    from expert_pack_devtools.lossless import ram_mib_for_blocks
    src, pack = packs(arch)
    with_pack, c = _pack_on_gpu(pack, cache_vram_mib=cache_mib_for_slots(pack, 4),
                                ram_cache_mib=ram_mib_for_blocks(pack, 24), prefetch=True)
    assert with_pack.error == 0
    diff, bound = _against_stock(stock, src, with_pack)
    print(f"\nprefetch {arch}: max|pack-stock|={diff:.3g}, stock's own bound={bound:.3g}, "
          f"counters={ {k: c[k] for k in ('cache_misses', 'ram_hits', 'prefetch_issued', 'prefetch_used', 'prefetch_wasted', 'prefetch_cancelled', 'predicted', 'predicted_correct')} }")
    assert diff <= bound
    assert c["io_errors"] == 0 and c["cache_misses"] == c["ram_hits"] + c["ram_misses"]
    assert c["predicted"] > 0 and c["prefetch_issued"] > 0 and c["prefetch_used"] > 0
