"""docs/BENCHMARKS.md's generated tables (`expert-pack bench tables`): each one is what its raw results under
docs/results give, so a hand edit of a generated table fails here; the command names what differs and rewrites it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from expert_pack_devtools.bench import tables
from expert_pack_devtools.bench.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"


def test_committed_tables_are_their_raw_results(capsys):
    assert main(["tables", "--check", str(DOC)]) == 0, capsys.readouterr().out
    kinds = set(re.findall(r"^<!-- table ([a-z-]+): ", DOC.read_text(), re.M))
    assert kinds == set(tables.RENDERERS)  # every renderer has a table in the document


@pytest.fixture
def doc_copy(tmp_path):
    """The document beside a link to the committed results, so its paths resolve."""
    (tmp_path / "results").symlink_to(DOC.parent / "results")
    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text(DOC.read_text())
    return copy


def test_a_hand_edit_is_named_then_regenerated(doc_copy, capsys):
    original = doc_copy.read_text()
    row = "| (s4) `serve-spill-tier-4-threads` | 4.02 | 1.27x |"
    assert original.count(row) == 1
    edited = row.replace("4.02", "4.01")
    doc_copy.write_text(original.replace(row, edited))
    assert main(["tables", "--check", str(doc_copy)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"differs: line \d+: table tier of results/2026-12-01-h200-prefetch-4-threads/", out), out
    assert "1 table(s) differ" in out and "table systems" not in out
    assert edited in doc_copy.read_text()  # --check rewrites nothing
    assert main(["tables", str(doc_copy)]) == 0
    assert doc_copy.read_text() == original
    assert main(["tables", "--check", str(doc_copy)]) == 0


def test_text_outside_the_markers_is_kept(doc_copy):
    text = doc_copy.read_text()
    start = text.index("<!-- table pack-speed:")
    end = text.index("<!-- end table -->", start)
    emptied = text[:text.index("\n", start) + 1] + text[end:]  # the region's table removed
    new, changed = tables.regenerate(emptied.replace("## Packing speed", "## Packing speed, edited"), doc_copy.parent)
    assert [c.split(": ")[1] for c in changed] == ["table pack-speed of results/2026-11-30-h200-pack-speed-first-decode/pack_speed.json"]
    assert new == text.replace("## Packing speed", "## Packing speed, edited")


@pytest.mark.parametrize("marker, msg", [
    ("<!-- table nope: results/policy/policy.json -->", "table nope: no such renderer"),
    ("<!-- table decode: results/none/decode.json -->", "table decode: no file results/none/decode.json"),
])
def test_bad_markers_are_one_line(doc_copy, marker, msg, capsys):
    doc_copy.write_text(doc_copy.read_text() + f"\n{marker}\n<!-- end table -->\n")
    assert main(["tables", "--check", str(doc_copy)]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err


def test_a_document_without_markers_is_refused(tmp_path, capsys):
    (tmp_path / "x.md").write_text("# no tables\n")
    assert main(["tables", str(tmp_path / "x.md")]) == 2
    assert "no generated tables" in capsys.readouterr().err
