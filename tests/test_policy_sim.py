"""The policy simulator (issue 9.3): exact on hand-made traces, Belady is an upper bound, the hybrid is the
provider's own policy."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_expert_pack import policy_sim
from ggml_expert_pack.pybind.provider import Policy
from ggml_expert_pack.routing.trace import RoutingTrace


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


def test_sweep_and_markdown():
    rng = np.random.default_rng(3)
    t = _trace([list(rng.choice(16, size=2, replace=False)) for _ in range(50)], n_expert=16)
    rows = policy_sim.sweep(t, fractions=(0.05, 0.5))
    assert rows[0]["slots"] == 2  # never below top-k
    assert rows[1]["slots"] == 8 and 0 < rows[1]["hybrid_over_belady"] <= 1
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
