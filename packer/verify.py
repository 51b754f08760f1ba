"""`expert-pack verify`: structure, alignment, every checksum, and that trunk, manifest and pack belong together.

Raises VerifyError naming the first problem found. `quick` checks structure and identities only (no data).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..gguf_file import GGUFFormatError, read_header
from ..ggml_types import nbytes
from ..progress import Progress
from .format import (ALIGNMENT, FLAG_UNIFORM_STRIDE, HEADER_SIZE, PACK_FILE, TRUNK_FILE, TRUNK_KV_PACK_ID,
                     TRUNK_KV_SOURCE, LayerLayout, PackHeader, layers_from_manifest, layout_identity, load_manifest,
                     manifest_digest, pack_id)


class VerifyError(ValueError):
    pass


@dataclass
class VerifyReport:
    pack_id: str
    n_layers: int
    n_experts: int
    blocks_checked: int
    bytes_checked: int


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise VerifyError(msg)


def check_structure(m: dict) -> list[LayerLayout]:
    """Everything that can be checked from the manifest alone."""
    try:
        layers = layers_from_manifest(m)
    except (KeyError, TypeError, ValueError) as e:
        raise VerifyError(f"manifest.json: malformed layer table ({e})") from e
    _check(manifest_digest(m) == m.get("manifest_digest"),
           "manifest.json was modified after the build (its digest does not match its content)")
    _check(pack_id(layout_identity(m["source"]["fingerprint"], m["n_experts"], layers)) == m.get("pack_id"),
           "manifest.json: the layout does not match its pack_id")
    n_exp, pack = m["n_experts"], m["pack"]
    _check(pack["alignment"] == ALIGNMENT and pack["data_start"] % ALIGNMENT == 0,
           f"manifest.json: data_start {pack['data_start']} is not {ALIGNMENT}-aligned")
    expect = pack["data_start"]
    for l, lj in zip(layers, m["layers"]):
        where = f"layer {l.layer}"
        _check(l.offset % ALIGNMENT == 0, f"{where}: block offset {l.offset} is not {ALIGNMENT}-aligned")
        _check(l.expert_stride % ALIGNMENT == 0, f"{where}: expert stride {l.expert_stride} is not {ALIGNMENT}-aligned")
        _check(l.offset == expect, f"{where}: blocks start at {l.offset}, expected {expect} (gap or overlap)")
        _check(0 < l.block_bytes <= l.expert_stride, f"{where}: block of {l.block_bytes} bytes in a stride of {l.expert_stride}")
        end = 0
        for r in l.roles:
            _check(r.shape[2] == n_exp, f"{where} {r.role}: {r.shape[2]} experts, expected {n_exp}")
            _check(r.bytes == nbytes(r.type, r.shape[:2]), f"{where} {r.role}: {r.bytes} bytes for {r.type.name} {r.shape[:2]}")
            _check(r.offset >= end, f"{where} {r.role}: overlaps the previous role")
            end = r.offset + r.bytes
        _check(end <= l.block_bytes, f"{where}: roles end at {end}, past the block's {l.block_bytes} bytes")
        _check(len(lj.get("checksums", [])) == n_exp, f"{where}: checksum count is not {n_exp}")
        if pack["uniform_stride"]:
            _check(l.expert_stride == pack["expert_stride"], f"{where}: stride differs from the pack's uniform stride")
        expect = l.offset + l.expert_stride * n_exp
    _check(pack["data_start"] == HEADER_SIZE, f"manifest.json: data_start {pack['data_start']}, expected {HEADER_SIZE}")
    _check(expect == pack["data_start"] + pack["data_size"] == pack["size"],
           f"manifest.json: layers end at {expect}, data region ends at {pack['data_start'] + pack['data_size']}, "
           f"pack size {pack['size']}")
    return layers


def verify(pack_dir: str | Path, quick: bool = False, progress: bool | None = None) -> VerifyReport:
    d = Path(pack_dir)
    try:
        m = load_manifest(d)
    except (FileNotFoundError, ValueError) as e:
        raise VerifyError(str(e)) from e
    layers = check_structure(m)
    pid, n_exp = m["pack_id"], m["n_experts"]

    # the pack file and its header
    pack_path = d / m["pack"]["file"]
    _check(pack_path.exists(), f"{pack_path.name} is missing")
    size = pack_path.stat().st_size
    _check(size == m["pack"]["size"], f"{pack_path.name} is {size} bytes, the manifest says {m['pack']['size']} "
                                      f"({'truncated' if size < m['pack']['size'] else 'too long'})")
    with open(pack_path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    try:
        h = PackHeader.unpack(raw)
    except ValueError as e:
        raise VerifyError(f"{pack_path.name}: {e}") from e
    _check(h.pack_id.hex() == pid, f"{pack_path.name} belongs to another pack (pack_id {h.pack_id.hex()}, "
                                   f"manifest {pid})")
    _check(h.manifest_digest.hex() == m["manifest_digest"],
           f"{pack_path.name} was written with a different manifest (digest mismatch)")
    _check(h.source_fingerprint.hex() == m["source"]["fingerprint"], f"{pack_path.name}: source fingerprint mismatch")
    _check((h.n_layers, h.n_experts, h.data_start, h.data_size) ==
           (len(layers), n_exp, m["pack"]["data_start"], m["pack"]["data_size"]),
           f"{pack_path.name}: header geometry does not match the manifest")
    _check(bool(h.flags & FLAG_UNIFORM_STRIDE) == m["pack"]["uniform_stride"], f"{pack_path.name}: stride flag mismatch")

    # the trunk
    trunk_path = d / m["trunk"]["file"]
    _check(trunk_path.exists(), f"{trunk_path.name} is missing")
    _check(trunk_path.stat().st_size == m["trunk"]["size"],
           f"{trunk_path.name} is {trunk_path.stat().st_size} bytes, the manifest says {m['trunk']['size']}")
    try:
        th = read_header(trunk_path)
    except GGUFFormatError as e:
        raise VerifyError(f"{trunk_path.name}: {e}") from e
    _check(th.get(TRUNK_KV_PACK_ID) == pid,
           f"{trunk_path.name} belongs to another pack ({TRUNK_KV_PACK_ID} {th.get(TRUNK_KV_PACK_ID)}, manifest {pid})")
    _check(th.get(TRUNK_KV_SOURCE) == m["source"]["fingerprint"], f"{trunk_path.name}: source fingerprint mismatch")
    expert_names = {r.tensor for l in layers for r in l.roles}
    clash = expert_names & {t.name for t in th.tensors}
    _check(not clash, f"{trunk_path.name} holds routed-expert tensors ({min(clash) if clash else ''})")
    _check(len(th.tensors) == m["trunk"]["n_tensors"], f"{trunk_path.name}: {len(th.tensors)} tensors, "
                                                       f"manifest says {m['trunk']['n_tensors']}")
    if quick:
        return VerifyReport(pid, len(layers), n_exp, 0, 0)

    # every block: checksum and zero padding
    from ..pybind import Hasher, xxh3_128
    bar = Progress(m["pack"]["data_size"] + m["trunk"]["size"], "verify", progress)
    checked = 0
    fd = os.open(pack_path, os.O_RDONLY)
    try:
        for l, lj in zip(layers, m["layers"]):
            stride = l.expert_stride
            batch = max(1, (64 << 20) // stride)
            for e0 in range(0, n_exp, batch):
                e1 = min(n_exp, e0 + batch)
                buf = np.frombuffer(os.pread(fd, (e1 - e0) * stride, l.expert_offset(e0)), dtype=np.uint8)
                _check(len(buf) == (e1 - e0) * stride, f"layer {l.layer} expert {e0}: short read (truncated pack)")
                view = buf.reshape(e1 - e0, stride)
                for j in range(e1 - e0):
                    e = e0 + j
                    got = xxh3_128(view[j, :l.block_bytes]).hex()
                    _check(got == lj["checksums"][e], f"layer {l.layer} expert {e} (offset {l.expert_offset(e)}): "
                                                      f"checksum mismatch (manifest {lj['checksums'][e]}, data {got})")
                    _check(not view[j, l.block_bytes:].any(),
                           f"layer {l.layer} expert {e}: padding after the block is not zero")
                    end = 0
                    for r in l.roles:
                        _check(not view[j, end:r.offset].any(), f"layer {l.layer} expert {e}: padding before "
                                                                 f"{r.role} is not zero")
                        end = r.offset + r.bytes
                    checked += 1
                bar.update(buf.nbytes)
    finally:
        os.close(fd)
    hasher = Hasher()
    with open(trunk_path, "rb") as f:
        for chunk in iter(lambda: f.read(64 << 20), b""):
            hasher.update(chunk)
            bar.update(len(chunk))
    _check(hasher.digest().hex() == m["trunk"]["checksum"], f"{trunk_path.name}: checksum mismatch (corrupt trunk)")
    bar.close()
    return VerifyReport(pid, len(layers), n_exp, checked, m["pack"]["data_size"] + m["trunk"]["size"])
