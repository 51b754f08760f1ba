"""tests/allpairs.py: every pair of values of any two axes appears in some case, the same input gives the same
cases, each case is a point of the full product, and with fewer than three axes the cases are the full product."""
from __future__ import annotations

import itertools

import pytest

from allpairs import allpairs, case_id

SPACES = {
    "one-axis": {"a": [1, 2, 3]},
    "two-axes": {"a": [1, 2, 3], "b": ["x", "y"]},
    "three-binary": {"a": [0, 1], "b": [0, 1], "c": [0, 1]},
    "3^4": {k: [0, 1, 2] for k in "abcd"},
    "mixed": {"kind": ["f16", "q8_0", "q4_k", "q2_k", "mixed"], "slots": [4, 9, None], "threads": [1, 4],
              "io": [True, False], "splits": [1, 2, 4]},
    "unhashable": {"cfg": [{"x": 1}, {"x": 2}], "lst": [[1], [2], [3]], "n": [None, 0]},
    "single-values": {"a": [1], "b": [2, 3], "c": [4], "d": [5, 6]},
}


@pytest.mark.parametrize("space", list(SPACES))
def test_every_pair_is_covered(space):
    axes = SPACES[space]
    cases = allpairs(axes)
    names = list(axes)
    for c in cases:
        assert list(c) == names
        assert all(any(c[n] is v for v in axes[n]) for n in names)  # a point of the product
    for a, b in itertools.combinations(names, 2):
        for i, j in itertools.product(range(len(axes[a])), range(len(axes[b]))):
            assert any(c[a] is axes[a][i] and c[b] is axes[b][j] for c in cases), (a, axes[a][i], b, axes[b][j])
    index = [tuple(next(k for k, v in enumerate(axes[n]) if v is c[n]) for n in names) for c in cases]
    assert len(set(index)) == len(index)  # no case twice
    full = 1
    for v in axes.values():
        full *= len(v)
    if len(names) < 3:
        assert len(cases) == full
    else:
        assert len(cases) <= full


def test_deterministic_and_smaller_than_the_product():
    for axes in SPACES.values():
        assert allpairs(axes) == allpairs(axes)
    assert len(allpairs(SPACES["3^4"])) < 81
    assert len(allpairs(SPACES["mixed"])) < 5 * 3 * 2 * 2 * 3


def test_empty_axes_give_no_case():
    assert allpairs({}) == []
    assert allpairs({"a": [1, 2], "b": []}) == []


def test_case_id():
    assert case_id({"a": 1, "b": None, "c": "x"}) == "1-None-x"
