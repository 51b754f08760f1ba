"""`expert-pack inspect`: what a pack holds, from its manifest, its header and the trunk's metadata.

The pack is checked as `verify --quick` checks it (structure and identities, no data read): a summary of a
manifest that does not describe its pack would be wrong, so inspect refuses such a pack with verify's message.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from ..ggml_types import type_size
from .format import HEADER_SIZE, ManifestError, PackHeader, layers_from_manifest, load_manifest
from .verify import VerifyError, verify

SLOT_UNIT = 256                 # a cache slot is the block rounded up to 256 and to each role type's block bytes
ARENA_TAIL_PAD = 64 << 10       # and each layer's arena has this much tail padding (src/arena.cpp)
SUGGESTED_FRACTION = 0.25       # of each layer's experts, and at least two tokens' worth (docs/POLICY.md: a 25%
                                # cache hits 0.57-0.74 of the time on realistic and skewed routing)


class InspectError(ValueError):
    pass


def summary(pack_dir: str | Path) -> dict:
    d = Path(pack_dir)
    try:
        verify(d, quick=True, progress=False)
        m = load_manifest(d)
    except (ManifestError, VerifyError) as e:
        raise InspectError(str(e)) from None
    layers = layers_from_manifest(m)
    pack_path = d / m["pack"]["file"]
    try:
        with open(pack_path, "rb") as f:
            header = PackHeader.unpack(f.read(HEADER_SIZE))
    except OSError as e:
        raise InspectError(f"{pack_path}: {e.strerror}") from None
    except ValueError as e:
        raise InspectError(f"{pack_path.name}: {e}") from None
    if header.pack_id.hex() != m["pack_id"]:
        raise InspectError(f"{pack_path.name} belongs to another pack (pack_id {header.pack_id.hex()}, "
                           f"manifest {m['pack_id']})")
    roles: dict[str, Counter] = {}
    for l in layers:
        for r in l.roles:
            roles.setdefault(r.role, Counter())[r.type.name] += 1
    blocks = Counter(l.block_bytes for l in layers)
    n_exp = m["n_experts"]
    top_k, trunk_note = _experts_used(d / m["trunk"]["file"], m["source"]["arch"])
    # the expert cache: every layer holds the same number of slots; a partial cache one all-zero slot more
    per_slot = sum(_slot_stride(l) for l in layers)
    fixed = ARENA_TAIL_PAD * len(layers)

    def cache_bytes(slots: int) -> int:
        return per_slot * (slots + (1 if slots < n_exp else 0)) + fixed
    cache = {"all_resident_bytes": cache_bytes(n_exp)}
    if top_k:
        cache["minimum_bytes"] = cache_bytes(min(top_k, n_exp))
        suggested = min(n_exp, max(2 * top_k, math.ceil(SUGGESTED_FRACTION * n_exp)))
        cache["suggested_bytes"] = cache_bytes(suggested)
        cache["suggested_slots"] = suggested
    return {
        "pack_dir": str(d), "pack_id": m["pack_id"], "header_pack_id": header.pack_id.hex(),
        "source": {k: m["source"][k] for k in ("arch", "name", "files", "fingerprint")},
        "n_moe_layers": len(layers), "moe_layers": [l.layer for l in layers], "n_experts": n_exp,
        "n_expert_used": top_k, "trunk_note": trunk_note,
        "roles": {role: dict(c) for role, c in roles.items()},
        "expert_bytes": {str(k): v for k, v in sorted(blocks.items())},
        "uniform_stride": m["pack"]["uniform_stride"],
        "expert_stride": m["pack"]["expert_stride"] or sorted({l.expert_stride for l in layers}),
        "pack_bytes": m["pack"]["size"], "trunk_bytes": m["trunk"]["size"],
        "trunk_tensors": m["trunk"]["n_tensors"], "checksum": m["pack"]["checksum"],
        "cache": cache,
    }


def _slot_stride(l) -> int:
    unit = SLOT_UNIT
    for r in l.roles:
        unit = math.lcm(unit, type_size(r.type))
    return (l.block_bytes + unit - 1) // unit * unit


def _experts_used(trunk: Path, arch: str) -> tuple[int | None, str | None]:
    """Top-k from the trunk's `<arch>.expert_used_count` (the largest, where it is per layer), or None and why."""
    from .source import read_gguf
    from ..gguf_file import GGUFFormatError
    try:
        h = read_gguf(trunk)
    except FileNotFoundError:
        return None, f"{trunk.name} is missing"
    except (GGUFFormatError, OSError) as e:
        return None, f"{trunk.name} is unreadable ({e})"
    v = h.get(f"{arch}.expert_used_count")
    if isinstance(v, list):
        v = max(v, default=None)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        return None, f"{trunk.name} has no valid {arch}.expert_used_count"
    return v, None


def render(s: dict) -> str:
    def gib(n): return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    k = s["n_expert_used"]
    lines = [
        f"expert pack   {s['pack_dir']}",
        f"pack id       {s['pack_id']}",
        f"source        {s['source']['arch']} '{s['source']['name']}' ({', '.join(s['source']['files'])})",
        f"fingerprint   {s['source']['fingerprint']}",
        f"MoE layers    {s['n_moe_layers']} ({_ranges(s['moe_layers'])}), {s['n_experts']} experts each, "
        + (f"top-{k} per token" if k else f"top-k unknown: {s['trunk_note']}"),
    ]
    for role, types in s["roles"].items():
        lines.append(f"  {role:<8}    " + ", ".join(f"{t} x{n} layers" for t, n in types.items()))
    eb = ", ".join(f"{gib(int(b))} x{n}" for b, n in s["expert_bytes"].items())
    c = s["cache"]
    cache = f"all resident {gib(c['all_resident_bytes'])}"
    if "suggested_bytes" in c:
        cache = (f"suggested {gib(c['suggested_bytes'])} ({c['suggested_slots']} of {s['n_experts']} experts per "
                 f"layer; --cache-mib {_mib_arg(c['suggested_bytes'])}), minimum "
                 f"{gib(c['minimum_bytes'])} (top-{k}), " + cache)
    lines += [
        f"expert bytes  {eb} (stride {'uniform ' if s['uniform_stride'] else 'per layer: '}{s['expert_stride']})",
        f"pack size     {gib(s['pack_bytes'])}, checksums {s['checksum']}",
        f"trunk size    {gib(s['trunk_bytes'])}, {s['trunk_tensors']} tensors",
        f"total         {gib(s['pack_bytes'] + s['trunk_bytes'])}",
        f"expert cache  {cache}",
    ]
    return "\n".join(lines)


def _mib_arg(n: int) -> str:
    """A --cache-mib value that holds n bytes: rounded up, to 0.1 MiB below 100 MiB."""
    mib = n / 2**20
    return f"{math.ceil(mib * 10) / 10:.1f}" if mib < 100 else str(math.ceil(mib))


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
