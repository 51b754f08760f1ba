"""Runtime completeness on CPU: trunk + pack without the original, mismatched trios refused, I/O
faults mid-generation that fail the request and recover."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from expert_pack_devtools.lossless import Session, cache_mib_for_slots, run
from ggml_expert_pack.packer.format import PACK_FILE, TRUNK_FILE
from ggml_expert_pack.pybind.provider import Provider
from conftest import TINY

ARCHS = list(TINY)
PROMPT, DECODE = 64, 32


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", [4, None], ids=["min", "all-fit"])
def test_trunk_plus_pack_equals_stock_on_the_original(packs, stock, arch, slots):
    src, pack = packs(arch)
    cfg = dict(cache_vram_reserve_mib=0)
    if slots:
        cfg["cache_vram_mib"] = cache_mib_for_slots(pack, slots)
    p = Provider.open(pack, **cfg)
    try:
        r = run(pack / TRUNK_FILE, p, prompt_len=PROMPT, n_decode=DECODE)
    finally:
        p.close()
    assert r.error == 0
    ref = stock.run(src, prompt_len=PROMPT, n_decode=DECODE, n_ubatch=r.n_ubatch)  # shared by both cache sizes
    assert r.tokens == ref.tokens
    assert np.array_equal(r.logits, ref.logits)


def test_trunk_without_its_pack_is_refused_clearly(packs):
    _, pack = packs("qwen3moe")
    with pytest.raises(RuntimeError, match="could not load"):
        run(pack / TRUNK_FILE, None, n_decode=1)


def test_trunk_of_another_pack_is_refused(packs):
    _, pack = packs("qwen3moe")
    _, other = packs("qwen3moe", expert_type="q8_0")
    p = Provider.open(pack)
    try:
        with pytest.raises(RuntimeError, match="trunk of another pack"):
            run(other / TRUNK_FILE, p, n_decode=1)
    finally:
        p.close()


def test_original_that_is_not_the_source_is_refused(packs):
    _, pack = packs("qwen3moe")
    other_src, _ = packs("qwen3moe", expert_type="q8_0")
    p = Provider.open(pack)
    try:
        with pytest.raises(RuntimeError, match="not the model this pack was built from"):
            run(other_src, p, n_decode=1)
    finally:
        p.close()


# ---- I/O faults mid-generation ------------------------------------------------------------------------------

def _tokens(n, seed=0):
    return [(i * 7919 + seed * 31) % 1000 + 100 for i in range(n)]


def test_eio_mid_generation_fails_the_request_then_recovers(packs, stock):
    src, pack = packs("qwen3moe")
    want, rc = stock.generate(src, _tokens(8), 24, n_gpu_layers=0)
    assert rc == 0
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 9), cache_vram_reserve_mib=0)
    s = Session(pack / TRUNK_FILE, p, n_gpu_layers=0)
    try:
        got, rc = s.generate(_tokens(8), 6)
        assert rc == 0 and got == want[:6]
        p.inject_eio(3)                           # the disk fails mid-generation, after 3 more block reads
        while rc == 0 and len(got) < 24:
            got.append(int(np.argmax(s.logits())))
            rc = s.decode([got[-1]])
        assert rc != 0 and len(got) < 24          # the request fails at a step that needed the disk
        assert got == want[:len(got)]             # every token produced came from complete data
        c = p.counters()
        assert c["io_errors"] == 1 and "Input/output error" in p.last_error
        assert s.decode([want[0]]) != 0           # still failing: every read fails
        p.inject_eio(-1)                          # the disk is readable again: the next request is served
        s.reset()
        again, rc = s.generate(_tokens(8), 24)
        assert rc == 0 and again == want
        print(f"\nEIO: {c}; after recovery: {p.counters()}")
    finally:
        s.close()
        p.close()


def test_truncated_pack_mid_generation_fails_then_recovers(packs, stock, tmp_path):
    src, pack0 = packs("qwen3moe")
    pack = tmp_path / "pack"
    shutil.copytree(pack0, pack)
    want, _ = stock.generate(src, _tokens(8, 1), 16, n_gpu_layers=0)
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 9), cache_vram_reserve_mib=0)
    s = Session(pack / TRUNK_FILE, p, n_gpu_layers=0)
    try:
        got, rc = s.generate(_tokens(8, 1), 4)
        assert rc == 0 and got == want[:4]
        # the pack loses its second half while the model runs
        path = pack / PACK_FILE
        keep = path.stat().st_size
        tail = path.read_bytes()[keep // 2:]
        os.truncate(path, keep // 2)
        p.reset_cache()
        rc = s.decode([got[-1]])
        assert rc != 0 and "truncated" in p.last_error and p.counters()["io_errors"] >= 1
        with open(path, "ab") as f:  # restored
            f.write(tail)
        s.reset()
        again, rc = s.generate(_tokens(8, 1), 16)
        assert rc == 0 and again == want
    finally:
        s.close()
        p.close()


def test_deep_model_with_a_small_cache_prefills_a_full_batch(synth_model, stock, tmp_path):
    """48 layers, 64 experts, a cache of 4 slots: a 256-token ubatch needs 16 rounds in every layer, and the graph
    must have room for them (on the GPU a 48-layer model with 18 of 128 slots aborted in graph_reserve)."""
    from ggml_expert_pack.packer import build
    src = synth_model("qwen3moe", n_layer=48, n_expert=64)
    pack = build(src, tmp_path / "pack", progress=False).pack_dir
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 4), cache_vram_reserve_mib=0)
    try:
        r = run(pack / TRUNK_FILE, p, prompt_len=PROMPT, n_decode=4)
        assert r.error == 0 and r.n_ubatch >= PROMPT  # the prompt in one ubatch: no cap
        assert p.stats()["fallback_count"] > 0  # the prompt went through in rounds
    finally:
        p.close()
    ref = stock.run(src, prompt_len=PROMPT, n_decode=4)
    assert r.tokens == ref.tokens and np.array_equal(r.logits, ref.logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_rounds_with_distinct_slots_per_token(packs, stock, arch):
    """The GPU's assignment for rounds, run on the CPU: its mul_mat_id needs a token's k slot ids distinct, so the
    pairs a round does not serve read other slots (the zero slot and unserved slots first, then served ones) with a
    zero input instead of all sharing the zero slot. Their outputs are exact zeros; what can change is how a kernel
    tiles a served slot's rows when zero rows join them (seen on deepseek4: prompt logits within 0.03, as between two
    ubatch sizes) -- the GPU criterion, not bit equality, applies."""
    src, pack = packs(arch)
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 4), cache_vram_reserve_mib=0)
    p.distinct_round_slots()
    try:
        r = run(pack / TRUNK_FILE, p, prompt_len=PROMPT, n_decode=4)
        assert r.error == 0 and p.stats()["fallback_count"] > 0  # the prompt went through in rounds
    finally:
        p.close()
    ref = stock.run(src, prompt_len=PROMPT, n_decode=4, n_ubatch=r.n_ubatch)
    prompt_rows = slice(0, PROMPT)
    assert np.array_equal(r.logits[prompt_rows].argmax(axis=1), ref.logits[prompt_rows].argmax(axis=1))
    assert float(np.abs(r.logits - ref.logits).max()) < 0.1
