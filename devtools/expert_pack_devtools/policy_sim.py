"""Replay a routing trace through cache policies at several cache sizes: LRU, LFU, our hybrid (the provider's own
policy code, through the C API), A0 and Belady's optimum (evict the expert used again farthest in the future).

A0 (Aho, Denning & Ullman, "Principles of optimal page replacement", JACM 1971) evicts the expert with the lowest
frequency over the *whole* trace: it knows each expert's popularity in advance but not the order of the uses.
When uses are independent draws from fixed popularities it is the best policy without foresight of the order;
on real traces it is a reference for what knowing popularity is worth, not a bound.

The cache is the runtime's: one arena per MoE layer with the same number of slots, the experts of the current
step pinned (never evicted to make room for each other). A step's experts are distinct, so hits/(hits+misses) is
the unique-key hit rate the runtime reports. Two kinds of traces:
- a RoutingTrace (`routing-stats --save-trace`, teacher-forced through stock llama.cpp): one step per token
  (the decode regime);
- a StepTrace (recorded by the runtime, config key `trace_path`): the runtime's own steps, each step the
  distinct experts of all its tokens. A step that needs more experts than the cache holds is replayed as
  consecutive groups of at most `slots` in first-use order (the runtime's rounds put the experts already cached
  first, so only such steps may count differently from the runtime; one-token steps replay it exactly).
"""
from __future__ import annotations

import bisect
from collections import OrderedDict

import numpy as np

from .routing.trace import RoutingTrace, StepTrace

POLICIES = ("lru", "lfu", "hybrid", "a0", "belady")


def layer_steps(trace: RoutingTrace | StepTrace, li: int, slots: int | None = None) -> list[list[int]]:
    """The li-th MoE layer's steps in execution order, distinct experts per step: token by token across the
    prompts of a RoutingTrace; the recorded steps of a StepTrace, split into groups of at most `slots`."""
    if isinstance(trace, StepTrace):
        out = []
        for ids in trace.layer_records(trace.layers[li]):
            step = list(dict.fromkeys(int(x) for x in ids.reshape(-1)))
            n = slots or len(step) or 1
            out += [step[i:i + n] for i in range(0, len(step), n)]
        return out
    return [list(dict.fromkeys(int(x) for x in row)) for e in trace.experts for row in e[:, li, :]]


def top_k(trace: RoutingTrace | StepTrace) -> int:
    return trace.k if isinstance(trace, StepTrace) else trace.experts[0].shape[2]



def _lru(steps, slots):
    cache: OrderedDict = OrderedDict()
    hits = 0
    for step in steps:
        pinned = set(step)
        for x in step:
            if x in cache:
                hits += 1
                cache.move_to_end(x)
                continue
            if len(cache) >= slots:
                victim = next(k for k in cache if k not in pinned)
                del cache[victim]
            cache[x] = None
    return hits


def replay(steps, slots, rank, use=None) -> int:
    """Demand caching of `slots` experts with each step's experts pinned: a miss evicts the cached expert, not
    needed by the step, of the lowest rank(expert, t). `use(expert, t)` (optional) is told of every use first.
    Returns the hits."""
    cache: set = set()
    hits = 0
    for t, step in enumerate(steps):
        pinned = set(step)
        for x in step:
            if use:
                use(x, t)
            if x in cache:
                hits += 1
                continue
            if len(cache) >= slots:
                cache.remove(min((k for k in cache if k not in pinned), key=lambda k: rank(k, t)))
            cache.add(x)
    return hits


def _lfu(steps, slots):
    """Frequency counted over everything seen so far (perfect LFU); ties go to the least recently used."""
    freq: dict = {}
    last: dict = {}

    def use(x, t):
        freq[x] = freq.get(x, 0) + 1
        last[x] = t
    return replay(steps, slots, lambda k, t: (freq[k], last[k]), use)


def _a0(steps, slots):
    """Evict the expert least used over the whole trace (hindsight popularity); ties to the lower id."""
    freq: dict = {}
    for step in steps:
        for x in step:
            freq[x] = freq.get(x, 0) + 1
    return replay(steps, slots, lambda k, t: (freq[k], k))


def _hybrid(steps, slots, n_expert):
    from ggml_expert_pack.pybind.provider import Policy
    p = Policy(slots, n_expert)
    for step in steps:
        p.step(step)
    return int(p.hits)


def _belady(steps, slots):
    uses: dict = {}
    for t, step in enumerate(steps):
        for x in step:
            uses.setdefault(x, []).append(t)

    def next_use(x, t):
        u = uses[x]
        i = bisect.bisect_right(u, t)
        return u[i] if i < len(u) else float("inf")
    return replay(steps, slots, lambda k, t: -next_use(k, t))


def step_hits(steps, policy: str, slots: int, n_expert: int | None = None) -> int:
    """Hits of one cache of `slots` over `steps` (lists of distinct keys, each step's keys pinned together) under
    `policy`, one of POLICIES; "hybrid" (the runtime's policy through the C API) needs n_expert, the key count."""
    if policy == "lru":
        return _lru(steps, slots)
    if policy == "lfu":
        return _lfu(steps, slots)
    if policy == "hybrid":
        if n_expert is None:
            raise ValueError("policy 'hybrid' needs n_expert")
        return _hybrid(steps, slots, n_expert)
    if policy == "a0":
        return _a0(steps, slots)
    if policy == "belady":
        return _belady(steps, slots)
    raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")


def hits(trace: RoutingTrace | StepTrace, policy: str, slots: int) -> tuple[int, int]:
    """(hits, accesses) over all layers, each layer its own cache of `slots`; accesses are distinct
    (layer, expert) keys per step, as the runtime's cache_hits + cache_misses."""
    hits = total = 0
    for li in range(len(trace.layers)):
        steps = layer_steps(trace, li, slots)
        total += sum(len(s) for s in steps)
        hits += step_hits(steps, policy, slots, trace.n_expert)
    return hits, total


def hit_rate(trace: RoutingTrace | StepTrace, policy: str, slots: int) -> float:
    """Hit rate over all layers (each layer its own cache of `slots`)."""
    h, total = hits(trace, policy, slots)
    return h / max(total, 1)


def sweep(trace: RoutingTrace | StepTrace, fractions=(0.1, 0.14, 0.25, 0.5)) -> list[dict]:
    """Rows {fraction, slots, lru, lfu, hybrid, a0, belady, hybrid_over_belady, a0_over_belady} for cache sizes
    given as fractions of a layer's experts (at least top-k slots, the runtime's minimum)."""
    k = top_k(trace)
    rows = []
    for f in fractions:
        slots = max(k, int(round(f * trace.n_expert)))
        row = {"fraction": f, "slots": slots, **{p: hit_rate(trace, p, slots) for p in POLICIES}}
        row["hybrid_over_belady"] = row["hybrid"] / row["belady"] if row["belady"] else float("nan")
        row["a0_over_belady"] = row["a0"] / row["belady"] if row["belady"] else float("nan")
        rows.append(row)
    return rows


def markdown(rows: list[dict], label: str) -> str:
    out = [f"**{label}**", "", "| cache (of a layer's experts) | slots | LRU | LFU | hybrid (ours) | A0 | Belady | "
           "ours ÷ Belady | A0 ÷ Belady |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['fraction']:.0%} | {r['slots']} | {r['lru']:.3f} | {r['lfu']:.3f} | {r['hybrid']:.3f} | "
                   f"{r['a0']:.3f} | {r['belady']:.3f} | {r['hybrid_over_belady']:.2f} | {r['a0_over_belady']:.2f} |")
    return "\n".join(out) + "\n"


def plot(results: dict[str, list[dict]], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (label, rows) in zip(axes, results.items()):
        xs = [r["fraction"] * 100 for r in rows]
        for p in POLICIES:
            ax.plot(xs, [r[p] for r in rows], marker="o", label=p)
        ax.set_title(f"routing: {label}")
        ax.set_xlabel("cache, % of a layer's experts")
        ax.grid(alpha=.3)
    axes[0].set_ylabel("hit rate")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
