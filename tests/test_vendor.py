"""vendor/prepare.py: pinned sdist, patch series applied in order, failures that name the patch and file."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("prepare", ROOT / "vendor" / "prepare.py")
prepare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare)


def _patch(old_name: str, new_text_from: str, new_text_to: str) -> str:
    return (f"--- a/{old_name}\n+++ b/{old_name}\n@@ -1 +1 @@\n-{new_text_from}\n+{new_text_to}\n")


@pytest.fixture
def series(tmp_path, monkeypatch):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("alpha\n")
    (tree / "b.txt").write_text("beta\n")
    pdir = tmp_path / "patches"
    pdir.mkdir()
    monkeypatch.setattr(prepare, "PATCH_DIR", pdir)
    return tree, pdir


def test_series_applies_in_order_and_resyncs_after_an_edit(series):
    tree, pdir = series
    (pdir / "0001-a.patch").write_text(_patch("a.txt", "alpha", "ALPHA"))
    (pdir / "0002-b.patch").write_text(_patch("b.txt", "beta", "BETA"))
    prepare.sync_patches(tree)
    assert (tree / "a.txt").read_text() == "ALPHA\n" and (tree / "b.txt").read_text() == "BETA\n"
    prepare.sync_patches(tree)  # idempotent
    assert (tree / "b.txt").read_text() == "BETA\n"
    (pdir / "0002-b.patch").write_text(_patch("b.txt", "beta", "Beta!"))  # edit the second patch
    prepare.sync_patches(tree)
    assert (tree / "a.txt").read_text() == "ALPHA\n" and (tree / "b.txt").read_text() == "Beta!\n"
    (pdir / "0002-b.patch").unlink()  # drop it
    prepare.sync_patches(tree)
    assert (tree / "b.txt").read_text() == "beta\n"


def test_a_hunk_that_does_not_apply_names_patch_and_file(series):
    tree, pdir = series
    (pdir / "0001-bad.patch").write_text(_patch("b.txt", "gamma", "delta"))
    with pytest.raises(prepare.PrepareError) as e:
        prepare.sync_patches(tree)
    assert "0001-bad.patch" in str(e.value) and "b.txt" in str(e.value)
    assert (tree / "b.txt").read_text() == "beta\n"  # nothing half-applied


def test_sha256_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "CACHE_DIR", tmp_path)
    bogus = tmp_path / prepare.LOCK["filename"]
    bogus.write_bytes(b"not the sdist")
    with pytest.raises(prepare.PrepareError, match="--offline"):
        prepare.fetch_sdist(offline=True)
    assert not bogus.exists()  # the bad file is deleted, not used


def test_unpack_and_bundle_roundtrip(tmp_path, monkeypatch):
    # a fake sdist with the expected layout, pinned by its own hash
    top = prepare.LOCK["top_dir"]
    src = tmp_path / "src" / top
    (src / "llama_cpp").mkdir(parents=True)
    (src / "llama_cpp" / "__init__.py").write_text(f'__version__ = "{prepare.LOCK["version"]}"\n')
    (src / "vendor/llama.cpp/include").mkdir(parents=True)
    (src / "vendor/llama.cpp/include/llama.h").write_text("// header\n")
    (src / "vendor/llama.cpp/docs").mkdir(parents=True)
    (src / "vendor/llama.cpp/docs/big.md").write_text("pruned\n")
    sdist = tmp_path / prepare.LOCK["filename"]
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(src, arcname=top)
    lock = dict(prepare.LOCK, sha256=hashlib.sha256(sdist.read_bytes()).hexdigest())
    monkeypatch.setattr(prepare, "LOCK", lock)
    monkeypatch.setattr(prepare, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(prepare, "PATCH_DIR", tmp_path / "no-patches")
    tree = prepare.ensure_tree(tmp_path / "up" / top, offline=True)
    assert (tree / "vendor/llama.cpp/include/llama.h").exists()
    assert json.loads((tree / ".expert-pack/upstream.json").read_text())["sha256"] == lock["sha256"]
    out = tmp_path / "bundle.tar.gz"
    prepare.bundle_tree(out, tree)
    names = tarfile.open(out).getnames()
    assert f"{top}/vendor/llama.cpp/include/llama.h" in names
    assert not any("docs/big.md" in n for n in names)


def test_the_build_tree_carries_the_whole_series():
    tree = prepare.default_tree()
    if not tree.exists():
        pytest.skip("no prepared upstream tree (the build prepares it)")
    applied = sorted(p.name for p in (tree / ".expert-pack" / "applied").glob("*.patch"))
    assert applied == [p.name for p in prepare.patch_series()]


def test_make_patch_keeps_headers_and_stacks_patches_on_one_file(tmp_path, monkeypatch):
    # a fake sdist holding one file; two patches of the series touch it, each with its header
    top = prepare.LOCK["top_dir"]
    src = tmp_path / "src" / top
    src.mkdir(parents=True)
    (src / "a.txt").write_text("one\ntwo\nthree\nfour\nfive\nsix\nseven\neight\n")
    sdist = tmp_path / prepare.LOCK["filename"]
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(src, arcname=top)
    monkeypatch.setattr(prepare, "LOCK", dict(prepare.LOCK, sha256=hashlib.sha256(sdist.read_bytes()).hexdigest()))
    monkeypatch.setattr(prepare, "CACHE_DIR", tmp_path)
    pdir = tmp_path / "patches"
    monkeypatch.setattr(prepare, "PATCH_DIR", pdir)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text((src / "a.txt").read_text().replace("one", "ONE"))
    with pytest.raises(prepare.PrepareError, match="header"):
        prepare.make_patch(tree, "0001-first.patch", ["a.txt"])  # a new patch says what and why
    prepare.make_patch(tree, "0001-first.patch", ["a.txt"], header="first: ONE\n")
    (tree / "a.txt").write_text((tree / "a.txt").read_text().replace("eight", "EIGHT"))
    prepare.make_patch(tree, "0002-second.patch", ["a.txt"], header="second: EIGHT\n")
    second = (pdir / "0002-second.patch").read_text()
    assert second.startswith("second: EIGHT\n") and "+EIGHT" in second and "ONE" not in second.split("@@", 2)[2]
    with pytest.raises(prepare.PrepareError, match="later in the series"):
        prepare.make_patch(tree, "0001-first.patch", ["a.txt"])  # its tree state holds 0002's change too
    (tree / "a.txt").write_text((tree / "a.txt").read_text().replace("EIGHT", "Eight"))
    prepare.make_patch(tree, "0002-second.patch", ["a.txt"])  # rewritten: the header stays
    assert (pdir / "0002-second.patch").read_text().startswith("second: EIGHT\n")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "a.txt").write_text((src / "a.txt").read_text())
    prepare.sync_patches(fresh)  # the series applies in order, headers and all
    assert (fresh / "a.txt").read_text() == (tree / "a.txt").read_text()
