"""Every provider configuration key at a non-default value, on the CPU and on the GPU, lossless against stock.

The rows below together set each key of the provider (pybind CONFIG_KEYS) away from its default at least once
(a pairwise-style cover, not the full product): a key that only a CPU test exercised could crash on the GPU
unseen (as read_splits >= 2 once did: a SIGSEGV inside llama_decode on CUDA while the CPU build ran it fine).
CPU: logits bit-identical to stock. GPU (marker `gpu`): greedy tokens identical and the logits within stock's
own run-to-run bound (tests/test_gpu.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from expert_pack_devtools.lossless import cache_mib_for_slots, ram_mib_for_blocks, run
from ggml_expert_pack.pybind.provider import CONFIG_KEYS, Provider

# values are functions of (pack dir, tmp dir) where they depend on them
ROWS = {
    "splits2-inline-1stage": dict(read_splits=2, read_threads=1, stage_slots=1),
    "splits4-threads4-nochecksum": dict(read_splits=4, read_threads=4, stage_slots=12, verify_pack_sha256=False),
    "splits4-threads8-buffered-files": dict(read_splits=4, read_threads=8, direct_io=False,
                                            stats_path=lambda p, t: str(t / "stats.json"), stats_flush_interval=1,
                                            trace_path=lambda p, t: str(t / "trace.bin")),
    "victim-tier-splits2": dict(ram_cache_mib=lambda p, t: ram_mib_for_blocks(p, 24), ram_tier_mode="victim",
                                read_splits=2),
    "inclusive-tier-prefetch-splits4": dict(ram_cache_mib=lambda p, t: ram_mib_for_blocks(p, 24),
                                            ram_tier_mode="inclusive", prefetch=True, read_splits=4, read_threads=1),
    "spill-tier-prefetch-size-strings": dict(ram_cache_mib="3M", ram_tier_mode="spill", prefetch=True,
                                             cache_vram_reserve_mib="0M"),
}
# keys every row sets (an evicting device cache), or the pack itself
COMMON = {"pack_path", "manifest_path", "cache_vram_mib", "cache_vram_reserve_mib"}


def test_the_rows_cover_every_key():
    covered = COMMON | {k for row in ROWS.values() for k in row}
    assert set(CONFIG_KEYS) <= covered, f"no row sets {sorted(set(CONFIG_KEYS) - covered)}"


def _config(pack, tmp_path, row):
    cfg = {"cache_vram_mib": cache_mib_for_slots(pack, 5), "cache_vram_reserve_mib": 0}
    for k, v in ROWS[row].items():
        cfg[k] = v(pack, tmp_path) if callable(v) else v
    return cfg


def _run_row(packs, tmp_path, row, n_gpu_layers):
    src, pack = packs("qwen3moe")
    p = Provider.open(pack, **_config(pack, tmp_path, row))
    try:
        got = run(pack / "trunk.gguf", p, n_gpu_layers=n_gpu_layers, prompt_len=24, n_decode=12)
        stats = p.stats()
    finally:
        p.close()
    assert got.error == 0
    assert stats["io_errors"] == 0 and stats["cache_misses"] > 0 and stats["cache_evictions"] > 0
    if "stats_path" in ROWS[row]:
        assert (tmp_path / "stats.json").stat().st_size > 0 and (tmp_path / "trace.bin").stat().st_size > 0
    if ROWS[row].get("prefetch"):
        assert stats["prefetch_issued"] > 0
    return src, got


@pytest.mark.parametrize("row", sorted(ROWS))
def test_config_row_cpu_bit_identical(packs, stock, tmp_path, row):
    src, got = _run_row(packs, tmp_path, row, n_gpu_layers=0)
    ref = stock.run(src, n_gpu_layers=0, n_ubatch=got.n_ubatch, prompt_len=24, n_decode=12)  # one for all rows
    assert got.tokens == ref.tokens
    assert np.array_equal(got.logits, ref.logits)


@pytest.mark.gpu
@pytest.mark.parametrize("row", sorted(ROWS))
def test_config_row_gpu_lossless(packs, stock, tmp_path, row):
    src, got = _run_row(packs, tmp_path, row, n_gpu_layers=-1)
    ub = got.n_ubatch
    ref = stock.run(src, n_gpu_layers=-1, n_ubatch=ub, prompt_len=24, n_decode=12)
    other = stock.run(src, n_gpu_layers=-1, n_ubatch=max(1, ub // 2) if ub > 1 else 2, prompt_len=24, n_decode=12)
    assert got.tokens == ref.tokens
    diff = float(np.abs(ref.logits - got.logits).max())
    bound = float(np.abs(ref.logits - other.logits).max())
    print(f"\n{row}: max|pack-stock|={diff:.3g}, stock's own bound={bound:.3g}")
    assert diff <= bound
