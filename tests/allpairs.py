"""A tiny deterministic all-pairs (pairwise) generator for test parametrizations.

`allpairs(axes)` takes {name: [values, ...]} and returns a list of {name: value} cases in which every pair of values
of any two axes appears in at least one case; with fewer than three axes that is the full product. Greedy: each new
case is the first one, in the full product's order, that covers the most pairs not covered yet, so the same input
always gives the same cases (pytest ids stay stable). Meant for the small matrices of the tests (the full product is
enumerated, so keep it below some ten thousand cases). tests/test_allpairs.py checks the covering property.
"""
from __future__ import annotations

import itertools


def _pairs(case: tuple) -> set:
    return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}


def allpairs(axes: dict[str, list]) -> list[dict]:
    names = list(axes)
    values = [list(axes[n]) for n in names]
    if not names or any(not v for v in values):
        return []
    # values are compared by their index on their axis, so unhashable or equal-comparing values are fine
    product = list(itertools.product(*(range(len(v)) for v in values)))
    if len(names) < 3:
        chosen = product
    else:
        uncovered = set().union(*(_pairs(c) for c in product))
        chosen = []
        while uncovered:
            best = max(product, key=lambda c: len(_pairs(c) & uncovered))  # max keeps the first of equals
            chosen.append(best)
            uncovered -= _pairs(best)
    return [{n: values[i][k] for i, (n, k) in enumerate(zip(names, c))} for c in chosen]


def case_id(case: dict) -> str:
    """A readable pytest id: the values joined by '-'."""
    return "-".join(str(v) for v in case.values())
