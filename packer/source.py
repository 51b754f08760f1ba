"""The model to pack: one GGUF or a llama.cpp split (first shard given), its tensors and routed experts."""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..gguf_file import GGUFFormatError, GGUFHeader, TensorEntry, read_header
from ..gguf_stream import split_path
from .format import EXPERT_TENSOR, ROLE_ORDER

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class SourceError(ValueError):
    """A source model that cannot be packed; the message says why in one line."""


@dataclass
class SourceTensor:
    entry: TensorEntry
    shard: int

    @property
    def name(self) -> str:
        return self.entry.name


@dataclass
class Source:
    paths: list[Path]
    headers: list[GGUFHeader]
    tensors: list[SourceTensor]                       # in file order, shard by shard
    experts: dict[int, dict[str, SourceTensor]] = field(default_factory=dict)  # layer -> role -> tensor
    n_experts: int = 0

    @property
    def meta(self) -> GGUFHeader:
        return self.headers[0]

    @property
    def arch(self) -> str:
        return self.meta.arch

    def fingerprint(self) -> str:
        """XXH3-128 over every shard's header bytes and size: identifies the source without reading its
        data (the data of every expert is covered by the per-block checksums)."""
        from ..pybind import Hasher
        h = Hasher()
        for p, hd in zip(self.paths, self.headers):
            with open(p, "rb") as f:
                h.update(f.read(hd.data_offset))
            h.update(struct.pack("<Q", hd.file_size))
        return h.digest().hex()

    @property
    def total_bytes(self) -> int:
        return sum(t.entry.nbytes for t in self.tensors)


def shard_paths(first: Path, header: GGUFHeader) -> list[Path]:
    count = header.get("split.count", 0) or 0
    if count <= 1:
        return [first]
    if header.get("split.no", 0) != 0:
        raise SourceError(f"{first} is shard {header.get('split.no') + 1} of {count}; give the first shard")
    m = _SPLIT_NAME.match(first.name)
    if not m:
        raise SourceError(f"{first} declares {count} shards but is not named PREFIX-00001-of-{count:05d}.gguf")
    prefix = first.parent / m.group("prefix")
    paths = [split_path(prefix, i, count) for i in range(count)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise SourceError(f"missing shard{'s' if len(missing) > 1 else ''} of {first.name}: {', '.join(missing)}")
    return paths


def open_source(path: str | Path) -> Source:
    first = Path(path)
    if not first.exists():
        raise SourceError(f"{first}: no such file")
    try:
        h0 = read_header(first)
        paths = shard_paths(first, h0)
        headers = [h0] + [read_header(p) for p in paths[1:]]
    except GGUFFormatError as e:
        raise SourceError(str(e)) from e
    for i, (p, h) in enumerate(zip(paths, headers)):
        if len(paths) > 1 and h.get("split.no") != i:
            raise SourceError(f"{p}: split.no is {h.get('split.no')}, expected {i}")
        need = max((t.offset + t.nbytes for t in h.tensors), default=h.data_offset)
        if h.file_size < need:
            raise SourceError(f"{p} is truncated: {h.file_size} bytes, its tensors need {need}")
    tensors = [SourceTensor(t, i) for i, h in enumerate(headers) for t in h.tensors]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise SourceError("duplicate tensor names across shards")
    declared = h0.get("split.tensors.count")
    if declared is not None and declared != len(tensors):
        raise SourceError(f"split.tensors.count is {declared} but the shards hold {len(tensors)} tensors")
    if not h0.arch:
        raise SourceError(f"{first} has no general.architecture")
    src = Source(paths, headers, tensors)
    _find_experts(src)
    return src


def _find_experts(src: Source) -> None:
    arch = src.arch
    declared = src.meta.get(f"{arch}.expert_count")
    for t in src.tensors:
        m = EXPERT_TENSOR.match(t.name)
        if not m:
            continue
        layer, role = int(m.group(1)), m.group(2)
        shape = t.entry.shape
        if len(shape) != 3:
            raise SourceError(f"unsupported layout: {t.name} has {len(shape)} dims, expected 3 (ne0, ne1, experts)")
        src.experts.setdefault(layer, {})[role] = t
    if not src.experts:
        raise SourceError(f"{src.paths[0].name} has no routed experts (no blk.N.ffn_*_exps tensors): nothing to pack")
    counts = {t.entry.shape[2] for roles in src.experts.values() for t in roles.values()}
    if len(counts) != 1:
        raise SourceError(f"unsupported layout: layers have different expert counts {sorted(counts)}")
    src.n_experts = counts.pop()
    if declared is not None and declared != src.n_experts:
        raise SourceError(f"unsupported layout: {arch}.expert_count is {declared} but expert tensors hold "
                          f"{src.n_experts}")
    for layer, roles in sorted(src.experts.items()):
        names = set(roles)
        if "down" not in names or ("gate_up" in names and names & {"gate", "up"}) or not names - {"down"}:
            raise SourceError(f"unsupported layout: layer {layer} has expert roles {sorted(names, key=ROLE_ORDER.index)}")


def shard_of(src: Source, t: SourceTensor) -> Path:
    return src.paths[t.shard]


def describe(src: Source) -> str:
    return (f"{src.arch} '{src.meta.get('general.name', '')}', {len(src.paths)} file(s), {len(src.tensors)} tensors, "
            f"{len(src.experts)} MoE layers x {src.n_experts} experts")


__all__ = ["Source", "SourceError", "SourceTensor", "describe", "open_source", "shard_of"]
