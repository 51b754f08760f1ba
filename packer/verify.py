"""`expert-pack verify`: structure, alignment, every checksum, and that trunk, manifest and pack belong together.

Raises VerifyError naming the first problem found. `quick` checks structure and identities only (no data).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..gguf_file import GGUFFormatError
from ..progress import Progress
from .source import SourceError, check_hparams, check_tensor_types, read_gguf
from .format import (ALIGNMENT, FLAG_UNIFORM_STRIDE, HEADER_SIZE, TRUNK_KV_PACK_ID, TRUNK_KV_SOURCE, LayerLayout,
                     ManifestError, PackHeader, layers_from_manifest, layout_identity, load_manifest, manifest_digest,
                     pack_id, plan_block, plan_layers, validate_manifest, xxh3_hex)


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
    """Everything that can be checked from the manifest alone: fields (validate_manifest), the digest, the
    pack_id, and that the layout is exactly the one the packer writes for these roles (so that no offset, stride
    or size can point outside its block or the pack, even in a manifest whose digests were recomputed)."""
    # the digest first (as the loader checks it): an edited manifest is named as such, whatever the edit broke
    _check(isinstance(m.get("manifest_digest"), str), "manifest.json: manifest_digest is missing or not a string")
    _check(manifest_digest(m) == m["manifest_digest"],
           "manifest.json was modified after the build (its digest does not match its content)")
    try:
        validate_manifest(m)
    except ManifestError as e:
        raise VerifyError(str(e)) from None
    layers = layers_from_manifest(m)
    _check(pack_id(layout_identity(m["source"]["fingerprint"], m["n_experts"], layers)) == m["pack_id"],
           "manifest.json: the layout does not match its pack_id")
    n_exp, pack = m["n_experts"], m["pack"]
    planned, uniform = plan_layers([(l.layer, *plan_block([(r.role, r.tensor, r.type, r.shape) for r in l.roles]))
                                    for l in layers], n_exp, force_uniform=pack["uniform_stride"])
    expect = pack["data_start"]
    for l, p in zip(layers, planned):
        where = f"layer {l.layer}"
        _check(l.offset % ALIGNMENT == 0, f"{where}: block offset {l.offset} is not {ALIGNMENT}-aligned")
        _check(l.expert_stride % ALIGNMENT == 0, f"{where}: expert stride {l.expert_stride} is not {ALIGNMENT}-aligned")
        _check(l.offset == expect, f"{where}: blocks start at {l.offset}, expected {expect} (gap or overlap)")
        _check(0 < l.block_bytes <= l.expert_stride, f"{where}: block of {l.block_bytes} bytes in a stride of {l.expert_stride}")
        end = 0
        for r, pr in zip(l.roles, p.roles):
            _check(r.role == pr.role, f"{where}: roles out of order ({', '.join(x.role for x in l.roles)})")
            _check(r.offset >= end, f"{where} {r.role}: overlaps the previous role")
            _check(r.offset == pr.offset, f"{where} {r.role}: at offset {r.offset} in the block, the packer puts it "
                                          f"at {pr.offset}")
            end = r.offset + r.bytes
        _check(end <= l.block_bytes, f"{where}: roles end at {end}, past the block's {l.block_bytes} bytes")
        _check(l.block_bytes == p.block_bytes, f"{where}: block_bytes {l.block_bytes}, its roles end at {p.block_bytes}")
        if pack["uniform_stride"]:
            _check(l.expert_stride == pack["expert_stride"], f"{where}: stride differs from the pack's uniform stride")
        _check(l.expert_stride == p.expert_stride, f"{where}: expert stride {l.expert_stride}, the packer's is "
                                                   f"{p.expert_stride}")
        expect = l.offset + l.expert_stride * n_exp
    if not pack["uniform_stride"]:
        _check(pack["expert_stride"] == 0, "manifest.json: pack.expert_stride is set but strides are per layer")
    _check(expect == pack["data_start"] + pack["data_size"] == pack["size"],
           f"manifest.json: layers end at {expect}, data region ends at {pack['data_start'] + pack['data_size']}, "
           f"pack size {pack['size']}")
    return layers


def verify(pack_dir: str | Path, quick: bool = False, progress: bool | None = None) -> VerifyReport:
    d = Path(pack_dir)
    try:
        m = load_manifest(d, validate=False)  # check_structure validates, with VerifyError
    except ManifestError as e:
        raise VerifyError(str(e)) from None
    layers = check_structure(m)
    pid, n_exp = m["pack_id"], m["n_experts"]

    # the pack file and its header
    pack_path = d / m["pack"]["file"]
    _check(pack_path.is_file(), f"{pack_path.name} is missing" if not pack_path.exists() else
           f"{pack_path.name} is not a file")
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
    _check(h.expert_stride == m["pack"]["expert_stride"], f"{pack_path.name}: header stride {h.expert_stride}, the "
                                                          f"manifest says {m['pack']['expert_stride']}")

    # the trunk
    trunk_path = d / m["trunk"]["file"]
    _check(trunk_path.is_file(), f"{trunk_path.name} is missing" if not trunk_path.exists() else
           f"{trunk_path.name} is not a file")
    _check(trunk_path.stat().st_size == m["trunk"]["size"],
           f"{trunk_path.name} is {trunk_path.stat().st_size} bytes, the manifest says {m['trunk']['size']}")
    if "header_checksum" in m["trunk"]:  # the metadata llama.cpp loads, checked without reading the data
        with open(trunk_path, "rb") as f:
            head = f.read(m["trunk"]["header_size"])
        _check(xxh3_hex(head) == m["trunk"]["header_checksum"],
               f"{trunk_path.name}: its header (metadata and tensor infos) was modified after the build")
    try:
        th = read_gguf(trunk_path)
    except GGUFFormatError as e:
        raise VerifyError(f"{trunk_path.name}: {e}") from None
    _check(th.arch == m["source"]["arch"], f"{trunk_path.name}: architecture {th.arch!r}, the manifest says "
                                           f"{m['source']['arch']!r}")
    try:  # what llama.cpp would refuse or abort on when it loads the trunk
        check_tensor_types(th.tensors)
        check_hparams(th, n_exp, {l.layer: {r.role: r.shape for r in l.roles} for l in layers})
    except SourceError as e:
        raise VerifyError(f"{trunk_path.name}: {e}") from None
    need = max((t.offset + t.nbytes for t in th.tensors), default=th.data_offset)
    _check(need <= th.file_size, f"{trunk_path.name}: tensor data ends at {need}, past the file's {th.file_size} bytes")
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
