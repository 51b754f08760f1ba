"""Runtime core on CPU: llama.cpp with an expert pack computes the same logits as stock llama.cpp,
bit for bit, at every cache size; the counters add up; the policy replays exactly; it fails closed."""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import pytest

from expert_pack_devtools.lossless import cache_mib_for_slots, run
from ggml_expert_pack.packer.format import MANIFEST_FILE, PACK_FILE, layers_from_manifest, load_manifest, manifest_digest
from ggml_expert_pack.pybind.provider import Policy, Provider, normalize_config

K = 4  # experts per token in the tiny models
TYPES = {
    "f16": dict(expert_type="f16"),
    "q8_0": dict(expert_type="q8_0"),
    "q4_k": dict(expert_type="q4_k"),
    "q2_k": dict(expert_type="q2_k"),
    "mixed": dict(expert_type="q4_k", expert_types={"down": "q8_0"},
                  layer_expert_types={"1": "q2_k", "2": "f16", "3": {"gate": "q3_k", "up": "q3_k"}}),
}


@pytest.fixture(scope="module")
def model_and_pack(packs):
    """(model, pack) of each kind: the session's (tests that damage a pack work on a copy)."""
    return lambda kind: packs("qwen3moe", **TYPES[kind])


def _provider(pack, slots=None, **kw):
    cfg = dict(cache_vram_reserve_mib=0, **kw)
    if slots is not None:
        cfg["cache_vram_mib"] = cache_mib_for_slots(pack, slots)
    return Provider.open(pack, **cfg)


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("slots", [K, 2 * K + 1, None], ids=["min", "evicting", "all-fit"])
def test_lossless_bit_for_bit(model_and_pack, stock, kind, slots):
    src, pack = model_and_pack(kind)
    p = _provider(pack, slots)
    try:
        with_pack = run(src, p, record_routing=True)
        stats = p.counters()
        slots_per_layer = p.slots_per_layer
    finally:
        p.close()
    assert with_pack.error == 0
    assert slots_per_layer == (slots or 16)
    # no ubatch cap: a step whose experts exceed the slots is served in rounds (the prompt stays one batch)
    assert with_pack.n_ubatch == 256
    ref = stock.run(src, n_ubatch=with_pack.n_ubatch)  # once per kind and run: the three cache sizes share it
    assert ref.tokens == with_pack.tokens
    assert with_pack.logits.shape == (12 + 32, 151936)
    assert np.array_equal(ref.logits, with_pack.logits), f"max |diff| {np.abs(ref.logits - with_pack.logits).max()}"

    m = load_manifest(pack)
    layers = layers_from_manifest(m)
    assert stats["io_errors"] == 0
    if slots is None:
        # every expert fits: preloaded at start into slot == expert, and the graph needs no acquire op at all; the
        # load is not a miss, and each step's experts count as hits (min(n_experts, k * n_tokens) per layer)
        assert stats["cache_misses"] == stats["cache_evictions"] == 0
        assert stats["pack_read_bytes"] == sum(l.read_bytes for l in layers) * m["n_experts"]
        assert stats["steps"] == len(with_pack.routing)
        assert stats["cache_hits"] == sum(min(m["n_experts"], ids.size) for step in with_pack.routing
                                          for ids in step.values())
        return
    # counters: one hit or miss per distinct (layer, expert) per step
    keys = sum(len(np.unique(ids)) for step in with_pack.routing for ids in step.values())
    assert stats["cache_hits"] + stats["cache_misses"] == keys
    assert stats["steps"] == len(with_pack.routing)
    read = {l.read_bytes for l in layers}
    if len(read) == 1:
        assert stats["pack_read_bytes"] == stats["cache_misses"] * read.pop()
    total_slots = slots_per_layer * len(m["layers"])
    assert stats["cache_misses"] - stats["cache_evictions"] <= total_slots  # free slots are filled once
    assert stats["cache_evictions"] >= stats["cache_misses"] - total_slots > 0
    # the 12-token prompt needs up to 16 experts per layer: more than the slots, so it was served in rounds
    assert stats["fallback_count"] > 0


def test_read_splits_stage_slots_and_buffered_io_are_lossless(model_and_pack, stock):
    src, pack = model_and_pack("q4_k")
    ref = stock.run(src, n_ubatch=2).logits
    for kw in (dict(read_splits=4, stage_slots=1), dict(direct_io=False), dict(verify_pack_sha256=False)):
        p = _provider(pack, 2 * K + 1, **kw)
        try:
            assert np.array_equal(run(src, p).logits, ref), kw
        finally:
            p.close()


# ---- the policy -----------------------------------------------------------------------------------------------

def test_policy_replay_exact():
    p = Policy(n_slots=2, n_experts=8)
    assert p.step([0, 1, 0]) == [0, 1, 0]           # two misses into free slots
    assert p.step([0, 2]) == [0, 1]                 # 0 hits; 2 evicts 1 (0 is needed this step)
    # 1 again: slots hold 0 (used in steps 1 and 2) and 2 (step 2 only): 2 has the lower score
    assert p.step([1]) == [1]
    assert p.step([0]) == [0]                       # still cached
    assert (p.hits, p.misses, p.evictions) == (2, 4, 2)
    with pytest.raises(ValueError):
        p.step([3, 4, 5])                           # three distinct experts, two slots


def test_policy_takes_a_busy_slot_last():
    """A slot still being written by a background read (a running prefetch in the RAM tier) is passed over for the
    next lowest one, and taken only when nothing else can go."""
    p = Policy(n_slots=3, n_experts=8)
    assert p.step([0, 1, 2]) == [0, 1, 2]
    p.step([1, 2])                       # 0 is now the least used
    p.set_busy(0)
    assert p.step([3]) == [1]            # 0 is busy: 1, the next lowest (ties with 2, lower slot), goes
    p.set_busy(0, False)
    assert p.step([5]) == [0]            # not busy any more: 0, the least used, goes
    q = Policy(n_slots=2, n_experts=8)
    q.step([0, 1])
    q.set_busy(0)
    q.set_busy(1)
    assert q.step([1, 5]) == [1, 0]      # every unpinned slot is busy: the busy one goes after all


def _reference_policy(trace, n_slots, n_experts, half_life=16.0):
    """The same frequency/recency hybrid, written again in Python as the plain scan of every slot per miss that
    src/cache_policy.cpp replaced with an ordered index. Returns (hits, misses, evictions, each step's slots)."""
    slot_of, expert_in = [-1] * n_experts, [-1] * n_slots
    freq, last, pinned = [0.0] * n_experts, [0] * n_experts, [0] * n_slots
    now = hits = misses = evictions = 0
    slots = []

    def score(e):
        return freq[e] * 2 ** (-(now - last[e]) / half_life)

    for step in trace:
        unique = list(dict.fromkeys(step))
        now += 1
        for e in unique:  # every expert of the step is counted and pinned before any victim is chosen
            freq[e], last[e] = score(e) + 1, now
            if slot_of[e] >= 0:
                pinned[slot_of[e]] = now
                hits += 1
        for e in unique:
            if slot_of[e] >= 0:
                continue
            victim, best = -1, None
            for s in range(n_slots):
                if pinned[s] == now:
                    continue
                old = expert_in[s]
                if old < 0:
                    victim = s
                    break
                if victim < 0 or (score(old), last[old]) < best:
                    victim, best = s, (score(old), last[old])
            if expert_in[victim] >= 0:
                slot_of[expert_in[victim]] = -1
                evictions += 1
            expert_in[victim], slot_of[e], pinned[victim] = e, victim, now
            misses += 1
        slots.append([slot_of[e] for e in step])
    return hits, misses, evictions, slots


@pytest.mark.parametrize("n_slots, n_experts, k, n_steps", [(9, 32, 4, 2000), (96, 512, 8, 1500)])
def test_policy_matches_reference_on_a_long_trace(n_slots, n_experts, k, n_steps):
    """Every step's slot assignment (not only the counts) is the plain scan's, on a small cache and on a larger one
    whose index holds many ties and stale scores."""
    rng = random.Random(1)
    weights = [1 / (r + 1) ** 0.8 for r in range(n_experts)]
    trace = [rng.choices(range(n_experts), weights, k=k) for _ in range(n_steps)]
    p = Policy(n_slots=n_slots, n_experts=n_experts)
    got = [p.step(step) for step in trace]
    hits, misses, evictions, want = _reference_policy(trace, n_slots, n_experts)
    assert (p.hits, p.misses, p.evictions) == (hits, misses, evictions)
    assert got == want


# ---- configuration and fail-closed start --------------------------------------------------------------------

@pytest.mark.parametrize("cfg, match", [
    (dict(cache_vram_mbi=10), "unknown expert_pack key 'cache_vram_mbi'"),
    (dict(stage_slots=0), "'stage_slots' must be an integer"),
    (dict(read_splits="4"), "'read_splits' must be an integer"),
    (dict(direct_io="yes"), "'direct_io' must be true or false"),
    (dict(cache_vram_mib=-1), "'cache_vram_mib' must be a size in MiB"),
    (dict(stats_flush_interval=1.5), "'stats_flush_interval' must be an integer"),
])
def test_bad_config_names_the_key(model_and_pack, cfg, match):
    _, pack = model_and_pack("q4_k")
    with pytest.raises(ValueError, match=match):
        normalize_config(pack, **cfg)


def test_refused_odirect_is_a_startup_error(model_and_pack, monkeypatch):
    _, pack = model_and_pack("q4_k")
    monkeypatch.setenv("EXPERT_PACK_TEST_REFUSE_ODIRECT", "1")  # test seam: tmpfs here accepts O_DIRECT
    with pytest.raises(RuntimeError, match="refuses O_DIRECT"):
        Provider.open(pack)
    Provider.open(pack, direct_io=False).close()  # buffered reads only when asked for


def test_misaligned_pack_is_a_startup_error(model_and_pack, tmp_path):
    _, pack = model_and_pack("q4_k")
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    m = json.loads((bad / MANIFEST_FILE).read_text())
    m["layers"][1]["offset"] += 512
    m["manifest_digest"] = manifest_digest(m)  # a consistent manifest, only misaligned
    (bad / MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(RuntimeError, match="misaligned pack: layer 1"):
        Provider.open(bad)


def test_pack_of_another_build_is_refused(model_and_pack, tmp_path):
    _, pack = model_and_pack("q4_k")
    _, other = model_and_pack("q8_0")
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    shutil.copyfile(other / PACK_FILE, bad / PACK_FILE)
    with pytest.raises(RuntimeError, match="belong to different builds|geometry"):
        Provider.open(bad)


@pytest.mark.parametrize("read_splits,where", [(1, "head"), (4, "head"), (4, "tail")])
def test_checksum_mismatch_stops_the_step(model_and_pack, tmp_path, read_splits, where):
    """read_splits > 1: the chunked path, which hashes a block chunk by chunk as its chunks land."""
    src, pack = model_and_pack("q4_k")
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    l = layers_from_manifest(load_manifest(bad))[0]
    at = 100 if where == "head" else l.block_bytes - 50
    with open(bad / PACK_FILE, "r+b") as f:  # corrupt every expert of layer 0: the first step needs one
        for e in range(16):
            f.seek(l.expert_offset(e) + at)
            b = f.read(1)
            f.seek(l.expert_offset(e) + at)
            f.write(bytes([b[0] ^ 1]))
    p = Provider.open(bad, cache_vram_mib=cache_mib_for_slots(bad, 2 * K + 1), cache_vram_reserve_mib=0,
                      read_splits=read_splits)
    try:
        r = run(src, p)
        assert r.error != 0 and len(r.logits) == 0  # no logits from a step with missing data
        assert "checksum mismatch in layer 0 expert" in p.last_error
        assert p.counters()["io_errors"] == 1
    finally:
        p.close()
    p = _provider(bad)  # everything fits: the preload at start finds it
    try:
        with pytest.raises(RuntimeError, match="checksum mismatch in layer 0 expert 0"):
            run(src, p)
    finally:
        p.close()


def test_cache_below_one_token_is_a_startup_error(model_and_pack):
    src, pack = model_and_pack("q4_k")
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, K - 1), cache_vram_reserve_mib=0)
    try:
        with pytest.raises(RuntimeError, match=r"holds 3 slot\(s\) per layer .* one token needs 4 experts .* at least") as e:
            run(src, p)
    finally:
        p.close()
    # the budget the message names is enough
    least = float(re.search(r"at least ([0-9.]+) MiB", str(e.value)).group(1))
    p = Provider.open(pack, cache_vram_mib=least, cache_vram_reserve_mib=0)
    try:
        assert run(src, p, n_decode=1).error == 0
    finally:
        p.close()


def test_stats_file(model_and_pack, tmp_path):
    src, pack = model_and_pack("q4_k")
    path = tmp_path / "stats.json"
    p = _provider(pack, 2 * K + 1, stats_path=str(path), stats_flush_interval=5)
    try:
        run(src, p, prompt_len=2, n_decode=6)
        s = json.loads(path.read_text())  # flushed at step 5
        assert s["steps"] == 5 and s["slots_per_layer"] == 2 * K + 1 and s["config"]["stats_flush_interval"] == 5
        assert set(s) >= {"cache_hits", "cache_misses", "cache_evictions", "pack_read_bytes", "h2d_bytes",
                          "fallback_count", "io_errors", "hit_rate", "pack_id"}
    finally:
        p.close()
    assert json.loads(path.read_text())["steps"] == 7  # and on close
    assert os.path.getsize(path) > 0
