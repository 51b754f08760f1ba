"""Routing traces and statistics: exact values on hand-made traces, and the generator's knobs move the
statistics of a real (synthetic) model the right way."""
from __future__ import annotations

import numpy as np
import pytest

from expert_pack_devtools import routing
from expert_pack_devtools.routing import stats
from expert_pack_devtools.routing.trace import RoutingTrace


def _trace(rows, n_expert=8):
    """rows: per token, per layer, the k expert ids."""
    return RoutingTrace("hand-made", list(range(len(rows[0]))), n_expert, [np.array(rows, dtype=np.int32)])


def test_lru_and_overlap_exact():
    # one layer, k=2: tokens {0,1} {1,2} {0,1} {3,4}
    t = _trace([[[0, 1]], [[1, 2]], [[0, 1]], [[3, 4]]])
    assert stats.consecutive_overlap(t) == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    # 2 slots: 0m 1m | 1h 2m(evict 0) | 0m(evict 1) 1m(evict 2) | 3m 4m  -> 1 hit of 8
    assert stats.lru_hit_per_layer(t, 2) == pytest.approx(1 / 8)
    # 3 slots: 0m 1m | 1h 2m | 0h 1h | 3m 4m -> 3 of 8
    assert stats.lru_hit_per_layer(t, 3) == pytest.approx(3 / 8)
    oracle, lru = stats.oracle_over_lru(t, 2)
    assert oracle == pytest.approx(5 / 8)  # keys (0,1) x3 and (0,0) x2 are the top two
    assert lru == pytest.approx(1 / 8)


def test_zipf_and_coverage_on_a_known_distribution():
    rng = np.random.default_rng(0)
    E, n = 64, 20000
    p = np.arange(1, E + 1, dtype=float) ** -0.7
    ids = rng.choice(E, size=(n, 1, 1), p=p / p.sum())
    t = RoutingTrace("zipf", [0], E, [ids.astype(np.int32)])
    assert stats.zipf_exponent(t) == pytest.approx(0.7, abs=0.08)
    assert 0 < stats.coverage(t, 75) < 1


def test_routing_knobs_move_the_statistics(synth_model):
    prompts = routing.PROMPTS[:6]
    measured = {}
    for preset in ("uniform", "realistic"):
        path = synth_model("qwen3moe", routing={"preset": preset, **routing_preset(preset)})
        trace = routing.capture(path, prompts, router_inputs=True)
        assert trace.experts[0].shape[1:] == (4, 4)  # 4 MoE layers, top-4
        measured[preset] = stats.compute(trace, *routing.router_selector(path, trace.layers))
        measured[preset]["lru_hit_k"] = stats.lru_hit_per_layer(trace, 4)  # 6x would hold all 16 experts
    u, r = measured["uniform"], measured["realistic"]
    assert r["consecutive_overlap"] > u["consecutive_overlap"] + 0.1
    assert r["zipf_exponent"] > u["zipf_exponent"]
    assert r["lru_hit_k"] > u["lru_hit_k"]
    assert 0.0 <= r["next_layer_pred"] <= 1.0


def routing_preset(name):
    from expert_pack_devtools.synth import RoutingConfig
    return RoutingConfig.PRESETS[name]
