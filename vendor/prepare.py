#!/usr/bin/env python3
"""Fetch, verify, unpack and patch the upstream source (llama-cpp-python sdist, which vendors llama.cpp).

The upstream tree is never committed. This script:
  1. finds the sdist named in vendor/upstream.lock.json in vendor/cache/, or downloads it from the package
     index pip is configured with, by name and version
     (`pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==VERSION`);
  2. checks its sha256 against the lock file (a mismatch is fatal);
  3. unpacks it into vendor/upstream/ (ignored by git);
  4. applies vendor/patches/*.patch in order; a hunk that does not apply stops with the patch's name and
     the file it touches.

It is idempotent: the tree records which patches it carries (vendor/upstream/<top>/.expert-pack/), and a
later run reverts the patches that changed and applies the new ones, so an edited patch series is picked
up without a fresh download.

Offline use (the GPU machine reaches no registry): `bundle-tree OUT.tar.gz` writes a pruned, patched copy of
the tree; unpack it anywhere and point EXPERT_PACK_UPSTREAM at it (or unpack it into vendor/upstream/).
An already-unpacked pristine tree is accepted too: it is patched in place.

Usage:
  python vendor/prepare.py                 # make sure the patched tree exists; print its path
  python vendor/prepare.py --offline       # never download; fail with a clear message instead
  python vendor/prepare.py bundle-tree OUT.tar.gz
  python vendor/prepare.py make-patch NAME FILE...   # after editing the tree: (re)write a patch of the series

A patch is one feature of the fork. It starts with a header, plain lines before the first `--- a/` that say
what the patch does and why (`patch` skips them); make-patch keeps the header of the patch it rewrites, and a new
patch gets its header from `--header FILE`. A file may be touched by several patches: each one is the diff of that
file from its state after the earlier patches of the series.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent
LOCK = json.loads((VENDOR / "upstream.lock.json").read_text())
PATCH_DIR = VENDOR / "patches"
CACHE_DIR = VENDOR / "cache"
STAMP_DIR_NAME = ".expert-pack"


class PrepareError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[vendor/prepare] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_tree() -> Path:
    env = os.environ.get("EXPERT_PACK_UPSTREAM")
    if env:
        return Path(env).resolve()
    return VENDOR / "upstream" / LOCK["top_dir"]


# ---------------------------------------------------------------------------------------------------------
# fetching


def _pip_download(dest: Path) -> None:
    """`pip download` of this one package as an sdist, through whatever index pip is configured with.

    Only llama-cpp-python is taken as source (`--no-binary NAME`); pip prepares its metadata in an isolated
    build environment of its own, whose build requirements (scikit-build-core) come as wheels, so this works
    from a fresh virtualenv, the system Python and inside pip's own isolated build environment alike."""
    spec = f"{LOCK['name']}=={LOCK['version']}"
    args = ["download", "--no-deps", "--no-binary", LOCK["name"], "--progress-bar", "off", "-d", str(dest), spec]
    candidates = [[sys.executable, "-m", "pip"]]
    py3 = shutil.which("python3")
    if py3 and os.path.realpath(py3) != os.path.realpath(sys.executable):
        candidates.append([py3, "-m", "pip"])
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # inside pip's isolated build env, PYTHONPATH hides the real site-packages
    env.pop("PIP_NO_BUILD_ISOLATION", None)  # the nested metadata step needs its own build env
    last = ""
    for pip in candidates:
        r = subprocess.run(pip + args, capture_output=True, text=True, env=env)
        if r.returncode == 0:
            return
        last = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
    raise PrepareError(
        f"could not download {spec} (sdist) from the package index pip is configured with:\n{last}\n"
        f"Offline: copy {LOCK['filename']} (sha256 {LOCK['sha256']}) into {CACHE_DIR}/, or unpack a tree made by "
        f"`python vendor/prepare.py bundle-tree` and set EXPERT_PACK_UPSTREAM to it (README, Builds: Offline).")


def fetch_sdist(offline: bool) -> Path:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / LOCK["filename"]
    if path.exists():
        digest = sha256_file(path)
        if digest == LOCK["sha256"]:
            return path
        log(f"cached {path.name} has sha256 {digest}, expected {LOCK['sha256']}: deleting it")
        path.unlink()
    if offline:
        raise PrepareError(
            f"{path} is missing and --offline was given. Copy the sdist there, or unpack a tree made by "
            f"`vendor/prepare.py bundle-tree` and set EXPERT_PACK_UPSTREAM to it.")
    log(f"downloading {LOCK['name']}=={LOCK['version']} (sdist) from the package registry")
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        _pip_download(Path(tmp))
        got = Path(tmp) / LOCK["filename"]
        if not got.exists():
            raise PrepareError(f"download did not produce {LOCK['filename']}: {os.listdir(tmp)}")
        digest = sha256_file(got)
        if digest != LOCK["sha256"]:
            raise PrepareError(
                f"sha256 mismatch for {LOCK['filename']}: got {digest}, lock file pins {LOCK['sha256']}")
        os.replace(got, path)
    return path


def unpack(sdist: Path, tree: Path) -> None:
    tree.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tree.parent) as tmp:
        with tarfile.open(sdist) as tf:
            if sys.version_info >= (3, 12):
                tf.extractall(tmp, filter="data")
            else:
                tf.extractall(tmp)
        src = Path(tmp) / LOCK["top_dir"]
        if not src.is_dir():
            raise PrepareError(f"{sdist.name} does not contain {LOCK['top_dir']}/")
        os.replace(src, tree)
    log(f"unpacked {sdist.name} into {tree}")


# ---------------------------------------------------------------------------------------------------------
# patches


def patch_series() -> list[Path]:
    return sorted(p for p in PATCH_DIR.glob("*.patch") if p.is_file())


def _run_patch(tree: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["patch", "-p1", "--batch", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(patch),
                           *extra], capture_output=True, text=True)


def _files_in_patch(patch: Path) -> list[str]:
    out = []
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("\t")[0].strip()
            out.append(name[2:] if name.startswith("b/") else name)
    return out


def patch_header(patch: Path) -> str:
    """The lines before the patch's first file (what the patch does and why)."""
    text = patch.read_text(errors="replace")
    at = text.find("--- a/")
    while at > 0 and text[at - 1] != "\n":
        at = text.find("--- a/", at + 1)
    return text[:at] if at >= 0 else text


def _file_section(patch: Path, rel: str) -> str:
    """The part of a patch that touches one file (its ---/+++ lines and hunks)."""
    out, keep = [], False
    lines = patch.read_text(errors="replace").splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            name = lines[i + 1][4:].split("\t")[0].strip()
            keep = (name[2:] if name.startswith("b/") else name) == rel
        if keep:
            out.append(line)
    return "".join(out)


def apply_patch(tree: Path, patch: Path) -> None:
    r = _run_patch(tree, patch, "--forward", "--dry-run")
    if r.returncode != 0:
        failing = [ln for ln in r.stdout.splitlines() if "FAILED" in ln or "can't find" in ln.lower()
                   or "checking file" in ln or "Reversed" in ln]
        raise PrepareError(
            f"patch {patch.name} does not apply to {tree}\n"
            f"  files it touches: {', '.join(_files_in_patch(patch))}\n  " + "\n  ".join(failing or r.stdout.splitlines()))
    r = _run_patch(tree, patch, "--forward")
    if r.returncode != 0:
        raise PrepareError(f"patch {patch.name} failed after a clean dry run:\n{r.stdout}{r.stderr}")


def revert_patch(tree: Path, patch: Path) -> None:
    r = _run_patch(tree, patch, "-R")
    if r.returncode != 0:
        raise PrepareError(
            f"could not revert {patch.name} from {tree} (was the tree edited by hand?). Delete {tree} and rerun.\n"
            f"{r.stdout}")


def sync_patches(tree: Path) -> None:
    stamp = tree / STAMP_DIR_NAME
    applied_dir = stamp / "applied"
    applied_dir.mkdir(parents=True, exist_ok=True)
    applied = sorted(applied_dir.glob("*.patch"))
    wanted = patch_series()

    # longest common prefix of (name, content)
    keep = 0
    while (keep < len(applied) and keep < len(wanted) and applied[keep].name == wanted[keep].name
           and applied[keep].read_bytes() == wanted[keep].read_bytes()):
        keep += 1
    for p in reversed(applied[keep:]):
        log(f"reverting {p.name}")
        revert_patch(tree, p)
        p.unlink()
    for p in wanted[keep:]:
        log(f"applying {p.name}")
        apply_patch(tree, p)
        shutil.copyfile(p, applied_dir / p.name)
    (stamp / "upstream.json").write_text(json.dumps(LOCK, indent=2) + "\n")


def looks_like_upstream(tree: Path) -> bool:
    return ((tree / "vendor/llama.cpp/include/llama.h").is_file()
            and (tree / "llama_cpp/__init__.py").is_file()
            and f'__version__ = "{LOCK["version"]}' in (tree / "llama_cpp/__init__.py").read_text())  # +expertpack.N once patched


def ensure_tree(tree: Path | None = None, offline: bool = False) -> Path:
    tree = tree or default_tree()
    if tree.exists():
        if not looks_like_upstream(tree):
            raise PrepareError(f"{tree} exists but is not the {LOCK['name']} {LOCK['version']} source tree")
    else:
        if os.environ.get("EXPERT_PACK_UPSTREAM"):
            raise PrepareError(f"EXPERT_PACK_UPSTREAM={tree} does not exist")
        unpack(fetch_sdist(offline), tree)
    sync_patches(tree)
    return tree


# ---------------------------------------------------------------------------------------------------------
# pruned bundle for machines without a registry

# What a build needs; everything else (docs, most vocab files, other backends' sources, the web UI) stays out.
PRUNE_EXCLUDE_DIRS = {
    ".git", "docs", "docker", "examples", "scripts", "tests",  # sdist top level (tests are llama-cpp-python's)
    "vendor/llama.cpp/docs", "vendor/llama.cpp/media", "vendor/llama.cpp/benches", "vendor/llama.cpp/app",
    # tools/ui and tools/mtmd stay: the fork's tools (llama-server, llama-cli) configure them
    "vendor/llama.cpp/ggml/src/ggml-sycl", "vendor/llama.cpp/ggml/src/ggml-vulkan",
    "vendor/llama.cpp/ggml/src/ggml-opencl", "vendor/llama.cpp/ggml/src/ggml-hexagon",
    "vendor/llama.cpp/ggml/src/ggml-metal", "vendor/llama.cpp/ggml/src/ggml-cann",
    "vendor/llama.cpp/ggml/src/ggml-webgpu", "vendor/llama.cpp/ggml/src/ggml-openvino",
    "vendor/llama.cpp/ggml/src/ggml-et", "vendor/llama.cpp/ggml/src/ggml-virtgpu",
    "vendor/llama.cpp/gguf-py/tests", "vendor/llama.cpp/gguf-py/examples",
}
KEEP_VOCABS = {"ggml-vocab-qwen2.gguf"}


def _bundle_filter(rel: str) -> bool:
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        if "/".join(parts[:i]) in PRUNE_EXCLUDE_DIRS:
            return False
    if rel.startswith("vendor/llama.cpp/models/") and rel.count("/") == 3:
        return parts[-1] in KEEP_VOCABS
    return True


def bundle_tree(out: Path, tree: Path) -> None:
    n = 0
    with tarfile.open(out, "w:gz", compresslevel=6) as tf:
        for root, dirs, files in os.walk(tree):
            rel_root = os.path.relpath(root, tree)
            rel_root = "" if rel_root == "." else rel_root
            dirs[:] = [d for d in dirs if _bundle_filter(f"{rel_root}/{d}".lstrip("/"))]
            for f in files:
                rel = f"{rel_root}/{f}".lstrip("/")
                if _bundle_filter(rel):
                    tf.add(os.path.join(root, f), arcname=f"{LOCK['top_dir']}/{rel}", recursive=False)
                    n += 1
    log(f"wrote {out} ({n} files, {out.stat().st_size / 2**20:.1f} MiB)")


# ---------------------------------------------------------------------------------------------------------
# maintaining the series


def make_patch(tree: Path, name: str, files: list[str], header: str | None = None) -> Path:
    """Write vendor/patches/NAME from the tree's current FILES (paths relative to the sdist top), and record it as
    applied; the patch's sections for other files are kept. Each file is diffed against its state after the patches before NAME in the series (the pristine sdist
    plus their hunks for that file); a file that a later patch also touches is refused (its tree state holds that
    patch's hunks too). The header is `header`, else the existing patch's; a new patch without one is refused."""
    out = PATCH_DIR / name
    series = [p for p in patch_series() if p.name != name]
    later = {f: p.name for p in series if p.name > name for f in _files_in_patch(p)}
    clash = [f for f in files if f in later]
    if clash:
        raise PrepareError(f"{', '.join(clash)} is also touched by {later[clash[0]]}, later in the series: "
                           f"make that patch's change there, or move this one after it")
    if header is None:
        header = patch_header(out) if out.exists() else ""
    if not header.strip():
        raise PrepareError(f"{name} needs a header saying what it does and why: --header FILE")
    header = header.rstrip("\n") + "\n\n"
    sdist = fetch_sdist(offline=True)
    chunks = []
    with tarfile.open(sdist) as tf, tempfile.TemporaryDirectory() as tmp:
        for rel in files:
            member = tf.extractfile(f"{LOCK['top_dir']}/{rel}")
            if member is None:
                raise PrepareError(f"{rel} is not in the sdist")
            base = Path(tmp) / "base"
            base.mkdir(exist_ok=True)
            orig = base / rel
            orig.parent.mkdir(parents=True, exist_ok=True)
            orig.write_bytes(member.read())
            for earlier in (p for p in series if p.name < name):
                section = _file_section(earlier, rel)
                if section:
                    r = subprocess.run(["patch", "-p1", "--batch", "--no-backup-if-mismatch", "-d", str(base)],
                                       input=section, capture_output=True, text=True)
                    if r.returncode != 0:
                        raise PrepareError(f"{earlier.name} does not apply to the pristine {rel}:\n{r.stdout}")
            r = subprocess.run(["diff", "-u", "--label", f"a/{rel}", "--label", f"b/{rel}", str(orig), str(tree / rel)],
                               capture_output=True, text=True)
            if r.returncode > 1:
                raise PrepareError(f"diff failed on {rel}: {r.stderr}")
            if not r.stdout:
                raise PrepareError(f"{rel} does not differ from its state before {name}")
            chunks.append(r.stdout)
            shutil.rmtree(base)
    # the files of the existing patch not named here keep their sections as they are
    if out.exists():
        made = dict(zip(files, chunks))
        old = _files_in_patch(out)
        chunks = [made.pop(f) if f in made else _file_section(out, f) for f in old] + list(made.values())
    PATCH_DIR.mkdir(parents=True, exist_ok=True)
    out.write_text(header + "".join(chunks))
    applied = tree / STAMP_DIR_NAME / "applied"
    applied.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out, applied / name)
    log(f"wrote {out} ({len(files)} files)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offline", action="store_true", help="never download; fail if the sdist is not cached")
    ap.add_argument("--tree", type=Path, default=None, help="upstream tree (default: $EXPERT_PACK_UPSTREAM or "
                    "vendor/upstream/<top>)")
    sub = ap.add_subparsers(dest="cmd")
    b = sub.add_parser("bundle-tree", help="write a pruned, patched copy of the tree as a .tar.gz")
    b.add_argument("out", type=Path)
    m = sub.add_parser("make-patch", help="(re)write vendor/patches/NAME from edited upstream files")
    m.add_argument("name", help="e.g. 0002-expert-pack-loader.patch")
    m.add_argument("files", nargs="+", help="paths relative to the sdist top, e.g. vendor/llama.cpp/src/llama.cpp")
    m.add_argument("--header", type=Path, default=None, help="a file holding the patch's header (what and why); "
                   "default: the header of the patch being rewritten")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "make-patch":
            header = args.header.read_text() if args.header else None
            make_patch(args.tree or default_tree(), args.name, args.files, header)
            return 0
        tree = ensure_tree(args.tree, offline=args.offline)
        if args.cmd == "bundle-tree":
            bundle_tree(args.out, tree)
        else:
            print(tree)
    except PrepareError as e:
        print(f"vendor/prepare.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
