"""`expert-pack inspect`: what a pack holds, from its manifest and header."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from .format import HEADER_SIZE, PackHeader, layers_from_manifest, load_manifest


def summary(pack_dir: str | Path) -> dict:
    d = Path(pack_dir)
    m = load_manifest(d)
    layers = layers_from_manifest(m)
    with open(d / m["pack"]["file"], "rb") as f:
        header = PackHeader.unpack(f.read(HEADER_SIZE))
    roles: dict[str, Counter] = {}
    for l in layers:
        for r in l.roles:
            roles.setdefault(r.role, Counter())[r.type.name] += 1
    blocks = Counter(l.block_bytes for l in layers)
    return {
        "pack_dir": str(d), "pack_id": m["pack_id"], "header_pack_id": header.pack_id.hex(),
        "source": {k: m["source"][k] for k in ("arch", "name", "files", "fingerprint")},
        "n_moe_layers": len(layers), "moe_layers": [l.layer for l in layers], "n_experts": m["n_experts"],
        "roles": {role: dict(c) for role, c in roles.items()},
        "expert_bytes": {str(k): v for k, v in sorted(blocks.items())},
        "uniform_stride": m["pack"]["uniform_stride"],
        "expert_stride": m["pack"]["expert_stride"] or sorted({l.expert_stride for l in layers}),
        "pack_bytes": m["pack"]["size"], "trunk_bytes": m["trunk"]["size"],
        "trunk_tensors": m["trunk"]["n_tensors"], "checksum": m["pack"]["checksum"],
    }


def render(s: dict) -> str:
    def gib(n): return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    lines = [
        f"expert pack   {s['pack_dir']}",
        f"pack id       {s['pack_id']}",
        f"source        {s['source']['arch']} '{s['source']['name']}' ({', '.join(s['source']['files'])})",
        f"fingerprint   {s['source']['fingerprint']}",
        f"MoE layers    {s['n_moe_layers']} ({_ranges(s['moe_layers'])}), {s['n_experts']} experts each",
    ]
    for role, types in s["roles"].items():
        lines.append(f"  {role:<8}    " + ", ".join(f"{t} x{n} layers" for t, n in types.items()))
    eb = ", ".join(f"{gib(int(b))} x{n}" for b, n in s["expert_bytes"].items())
    lines += [
        f"expert bytes  {eb} (stride {'uniform ' if s['uniform_stride'] else 'per layer: '}{s['expert_stride']})",
        f"pack size     {gib(s['pack_bytes'])}, checksums {s['checksum']}",
        f"trunk size    {gib(s['trunk_bytes'])}, {s['trunk_tensors']} tensors",
        f"total         {gib(s['pack_bytes'] + s['trunk_bytes'])}",
    ]
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
