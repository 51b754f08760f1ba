"""The policy simulator: exact on hand-made traces, Belady is an upper bound, the hybrid is the
provider's own policy."""
from __future__ import annotations

import numpy as np
import pytest

from expert_pack_devtools import policy_sim
from ggml_expert_pack.pybind.provider import Policy
from expert_pack_devtools.routing.trace import RoutingTrace


def _trace(steps, n_expert=8):
    """One layer, one prompt, k = len(step)."""
    e = np.array(steps, dtype=np.int32)[:, None, :]
    return RoutingTrace("hand", [0], n_expert, [e])


def test_hand_made_sequence():
    # k=1, 2 slots: a b c a b c ... LRU always misses; Belady keeps one of them every time
    t = _trace([[x] for x in [0, 1, 2] * 4])
    assert policy_sim.hit_rate(t, "lru", 2) == 0.0
    # Belady: 12 accesses, 3 cold misses + one miss per round after → 5 hits (known optimum for this pattern)
    assert policy_sim.hit_rate(t, "belady", 2) == pytest.approx(5 / 12)
    # LFU with LRU tie-break equals LRU here (equal counts)
    assert policy_sim.hit_rate(t, "lfu", 2) == 0.0


def test_pinned_experts_are_never_evicted_for_each_other():
    t = _trace([[0, 1], [2, 3], [0, 1], [2, 3]], n_expert=4)
    for p in policy_sim.POLICIES:
        assert policy_sim.hit_rate(t, p, 2) == 0.0  # two slots hold exactly one step
        assert policy_sim.hit_rate(t, p, 4) == pytest.approx(4 / 8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_bounds_every_policy_and_hybrid_is_the_provider(seed):
    rng = np.random.default_rng(seed)
    p = np.arange(1, 33) ** -1.0
    p /= p.sum()
    steps = [list(rng.choice(32, size=4, replace=False, p=p)) for _ in range(400)]
    t = _trace(steps, n_expert=32)
    for slots in (4, 8, 16):
        rates = {name: policy_sim.hit_rate(t, name, slots) for name in policy_sim.POLICIES}
        assert all(rates["belady"] >= r - 1e-12 for r in rates.values()), rates
        pol = Policy(slots, 32)
        for s in steps:
            pol.step([int(x) for x in s])
        assert rates["hybrid"] == pytest.approx(pol.hits / (pol.hits + pol.misses))


def test_a0_evicts_the_least_popular_over_the_whole_trace():
    # k=1, 2 slots: 1 is used three times first, then 0 and 2 alternate five times each. A0 knows that 0 and 2 are
    # the popular ones over the trace: when 2 first comes it evicts 1 and then always hits (2 + 8 hits). LFU counts
    # only the past, keeps 1 while it has the highest count so far, and 0 and 2 evict each other meanwhile.
    t = _trace([[x] for x in [1, 1, 1] + [0, 2] * 5])
    assert policy_sim.hits(t, "a0", 2) == (10, 13)
    assert policy_sim.hits(t, "lfu", 2)[0] < 10
    assert policy_sim.hits(t, "belady", 2)[0] == 10


def test_sweep_and_markdown():
    rng = np.random.default_rng(3)
    t = _trace([list(rng.choice(16, size=2, replace=False)) for _ in range(50)], n_expert=16)
    rows = policy_sim.sweep(t, fractions=(0.05, 0.5))
    assert rows[0]["slots"] == 2  # never below top-k
    assert rows[1]["slots"] == 8 and 0 < rows[1]["hybrid_over_belady"] <= 1 and 0 < rows[1]["a0_over_belady"] <= 1
    md = policy_sim.markdown(rows, "test")
    assert "| 50% | 8 |" in md


def test_cli(tmp_path, capsys):
    from ggml_expert_pack.cli import main
    rng = np.random.default_rng(4)
    path = tmp_path / "t.npz"
    _trace([list(rng.choice(16, size=2, replace=False)) for _ in range(40)], n_expert=16).save(path)
    assert main(["policy-sim", str(path), "--fractions", "0.25,0.5"]) == 0
    assert "| 25% | 4 |" in capsys.readouterr().out
    assert main(["policy-sim", str(path), "--fractions", "2"]) == 2


# ---- traces recorded by the runtime (trace_path) ------------------------------------------------------------

def test_runtime_trace_replays_the_runtime(packs, tmp_path, capsys):
    """Decode-only (one token per step): the hybrid replayed from the recorded trace is the runtime's cache."""
    from ggml_expert_pack.cli import main
    from expert_pack_devtools.lossless import cache_mib_for_slots, run
    from ggml_expert_pack.pybind.provider import Provider
    from expert_pack_devtools.routing.trace import StepTrace
    src, pack = packs("qwen3moe")
    path = tmp_path / "routing.trace"
    slots = 9
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, slots), cache_vram_reserve_mib=0,
                      trace_path=str(path))
    try:
        got = run(src, p, prompt_len=1, n_decode=20, record_routing=True)
        c = p.counters()
    finally:
        p.close()  # flushes the trace
    assert got.error == 0
    t = StepTrace.load(path)
    assert (t.n_layers, t.n_expert, t.k) == (4, 16, 4)
    assert len(t.records) == c["steps"] * t.n_layers == 21 * 4
    # the ids are the router's own (the graph callback saw the same top-k)
    for (step, layer, ids), want in zip(t.records, (ids for s in got.routing for _, ids in sorted(s.items()))):
        assert np.array_equal(ids, want)
    assert [s for s, _, _ in t.records] == [s for s in range(1, 22) for _ in range(4)]
    h, total = policy_sim.hits(t, "hybrid", slots)
    assert (h, total) == (c["cache_hits"], c["cache_hits"] + c["cache_misses"])
    assert all(policy_sim.hits(t, "belady", slots)[0] >= policy_sim.hits(t, q, slots)[0] for q in policy_sim.POLICIES)
    assert main(["policy-sim", "--trace", str(path), "--fractions", "0.5"]) == 0
    assert "| 50% | 8 |" in capsys.readouterr().out
    assert main(["policy-sim"]) == 2  # no trace at all


def test_runtime_trace_prompt_steps(packs, tmp_path):
    """A prompt step records every token; a step larger than the cache replays in groups of at most `slots`."""
    from expert_pack_devtools.lossless import cache_mib_for_slots, run
    from ggml_expert_pack.pybind.provider import Provider
    from expert_pack_devtools.routing.trace import StepTrace
    src, pack = packs("qwen3moe")
    path = tmp_path / "prompt.trace"
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 4), cache_vram_reserve_mib=0,
                      trace_path=str(path))
    try:
        assert run(src, p, prompt_len=12, n_decode=2).error == 0
        steps = p.counters()["steps"]
    finally:
        p.close()
    t = StepTrace.load(path)
    assert len(t.records) == steps * 4 == 3 * 4
    assert [ids.shape for _, _, ids in t.records[:4]] == [(12, 4)] * 4
    assert all(len(s) <= 4 for li in range(4) for s in policy_sim.layer_steps(t, li, 4))
    h, total = policy_sim.hits(t, "hybrid", 4)
    assert total == sum(len(np.unique(ids)) for _, _, ids in t.records)


def test_bad_trace_files(tmp_path):
    from expert_pack_devtools.routing.trace import StepTrace
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"NOTATRACE" + bytes(20))
    with pytest.raises(ValueError, match="not a routing trace"):
        StepTrace.load(bad)
    head = b"EPTRACE1" + np.array([1, 4, 16, 4], "<u4").tobytes()
    bad.write_bytes(head + np.array([1], "<u8").tobytes() + np.array([0, 2], "<u4").tobytes() + bytes(12))
    with pytest.raises(ValueError, match="truncated record"):
        StepTrace.load(bad)


def test_trace_path_that_cannot_be_created_is_a_startup_error(packs, tmp_path):
    from ggml_expert_pack.pybind.provider import Provider
    _, pack = packs("qwen3moe")
    with pytest.raises(RuntimeError, match="'trace_path': cannot create .*no-such-dir"):
        Provider.open(pack, trace_path=str(tmp_path / "no-such-dir" / "t.trace"))
