"""Every MoE architecture of the vendored llama.cpp: llama.cpp's own `test-llama-archs -o` writes a small
random model per architecture; each MoE one is packed and must either compute logits bit-identical to stock
llama.cpp on the original (64-token prompt in one batch + 32 decode steps, at the minimum cache and all-fit), or
be refused with a message naming its architecture. The table of outcomes goes to test-artifacts/archs.md.

The tool is built by scripts/build_archs_tool.sh (about 6 minutes on 2 cores, once); set EP_SKIP_ARCHS_TOOL=1 to
skip this module instead.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ggml_expert_pack.gguf_file import read_header
from expert_pack_devtools.lossless import cache_mib_for_slots, run
from ggml_expert_pack.packer import build
from ggml_expert_pack.packer.format import TRUNK_FILE
from ggml_expert_pack.pybind.provider import Provider

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "build" / "archs-tool" / "bin" / "test-llama-archs"
PROMPT, DECODE = 64, 32


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    if os.environ.get("EP_SKIP_ARCHS_TOOL") == "1":
        pytest.skip("EP_SKIP_ARCHS_TOOL=1")
    if not TOOL.exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "build_archs_tool.sh")], check=True, cwd=ROOT)
    out = tmp_path_factory.mktemp("archs")
    subprocess.run([str(TOOL), "-o", str(out)], check=True, cwd=out, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    models = sorted(out.rglob("*.gguf"))
    assert models, "test-llama-archs -o wrote no model"
    return models


def _is_moe(path: Path) -> bool:
    return any("_exps" in t.name for t in read_header(path).tensors)


def _check(model: Path, pack_root: Path, stock) -> tuple[str, str]:
    arch = str(read_header(model).get("general.architecture"))
    try:
        pack = build(model, pack_root / model.stem, progress=False).pack_dir
    except (ValueError, RuntimeError) as e:
        return arch, f"refused by the packer: {e}"
    k = int(read_header(model).get(f"{arch}.expert_used_count") or 0)
    results = []
    for slots in ([k] if k else []) + [None]:
        cfg = dict(cache_vram_reserve_mib=0)
        if slots:
            cfg["cache_vram_mib"] = cache_mib_for_slots(pack, slots)
        p = Provider.open(pack, **cfg)
        try:
            r = run(pack / TRUNK_FILE, p, prompt_len=PROMPT, n_decode=DECODE, n_ctx=PROMPT + DECODE + 8)
            stats = p.stats()
        except RuntimeError as e:
            return arch, f"refused at load: {e}"
        finally:
            p.close()
        if stats["cache_misses"] == 0 or stats["pack_read_bytes"] == 0:
            return arch, "FAILED: the pack was not read"
        if slots and stats["cache_evictions"] == 0:
            results.append("min (no eviction needed)")
        if r.error:
            return arch, f"FAILED: llama_decode returned {r.error}"
        # the two cache sizes share one stock run where their ubatch is the same (conftest.py, `stock`)
        ref = stock.run(model, prompt_len=PROMPT, n_decode=DECODE, n_ctx=PROMPT + DECODE + 8, n_ubatch=r.n_ubatch)
        same = r.tokens == ref.tokens and np.array_equal(r.logits, ref.logits)
        results.append(f"{'min' if slots else 'all-fit'} {'bit-identical' if same else 'DIFFERENT'}")
        if not same:
            return arch, "FAILED: " + ", ".join(results)
    return arch, "pass: " + ", ".join(results)


def test_every_moe_arch_is_lossless_or_refused_by_name(arch_models, stock, tmp_path):
    rows = []
    for model in arch_models:
        if not _is_moe(model):
            continue
        arch, outcome = _check(model, tmp_path, stock)
        rows.append((arch, model.name, outcome))
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    table = ["| arch | model | outcome |", "|---|---|---|"] + [f"| {a} | {m} | {o} |" for a, m, o in rows]
    (ROOT / "test-artifacts" / "archs.md").write_text("\n".join(table) + "\n")
    print("\n" + "\n".join(table))
    assert rows, "no MoE model among the generated ones"
    bad = [r for r in rows if r[2].startswith("FAILED") or (r[2].startswith("refused") and r[0] not in r[2])]
    assert not bad, bad
