"""Per-device expert caches: every device that runs MoE layers (llama.cpp's layer split) has its own cache, sized from
its own memory, with its own counters in the stats (`devices`) and on serve's /metrics (label `device`). On the CPU
one device; on a GPU machine a split between the GPU and the CPU backend exercises the same per-device code as two
GPUs do (lossless against stock with the same split). llama.cpp's row split is refused with a pack."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from expert_pack_devtools.lossless import cache_mib_for_slots, run
from ggml_expert_pack.pybind.provider import Provider

COUNTERS = ("cache_hits", "cache_misses", "cache_evictions", "h2d_bytes")


def test_cpu_device_counters_add_up(packs):
    _, pack = packs("qwen3moe")
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 8))
    try:
        r = run(pack / "trunk.gguf", p, n_gpu_layers=0, prompt_len=24, n_decode=4)
        s = p.stats()
        assert r.error == 0
        assert [d["device"] for d in s["devices"]] == ["CPU"]
        d = s["devices"][0]
        assert d["layers"] == s["n_layers"] and d["slots_per_layer"] == s["slots_per_layer"]
        assert d["cache_bytes"] > 0  # (the totals' geometry is the attached model's: gone once it is freed)
        for k in COUNTERS:
            assert d[k] == s[k], k
        assert d["cache_misses"] > 0
        p.reset_stats()
        s = p.stats()
        assert all(s["devices"][0][k] == 0 for k in COUNTERS)
    finally:
        p.close()


def test_metrics_label_each_device():
    from ggml_expert_pack.server.api import metrics_text
    engine = SimpleNamespace(totals=SimpleNamespace(prompt_tokens=0, prompt_seconds=0.0, predicted_tokens=0,
                                                    predicted_seconds=0.0, requests=0, cancelled=0),
                             busy=False, lane=SimpleNamespace(waiting=0))
    devices = [dict(device="CUDA0", cache_hits=5, cache_misses=2, cache_evictions=1, h2d_bytes=4096,
                    slots_per_layer=18, cache_bytes=1 << 20),
               dict(device='C"PU', cache_hits=3, cache_misses=0, cache_evictions=0, h2d_bytes=0,
                    slots_per_layer=128, cache_bytes=1 << 22)]
    text = metrics_text(engine, {"cache_hits": 8, "cache_misses": 2, "devices": devices})
    lines = text.splitlines()
    assert 'expert_pack_device_cache_hits_total{device="CUDA0"} 5' in lines
    assert 'expert_pack_device_cache_hits_total{device="C\\"PU"} 3' in lines
    assert 'expert_pack_device_slots_per_layer{device="CUDA0"} 18' in lines
    # one HELP and TYPE per family, before its samples
    assert sum(line == "# TYPE expert_pack_device_cache_hits_total counter" for line in lines) == 1


ROW_REFUSED = ("expert pack: split_mode LLAMA_SPLIT_MODE_ROW is not supported with an expert pack; "
               "use LLAMA_SPLIT_MODE_LAYER")


def test_row_split_is_refused_by_the_python_api(packs):
    """The caches hold whole experts on the device of each layer: the row split is refused before loading, in one
    line (on a CPU-only build llama.cpp itself loads with it, the split having no GPU to act on)."""
    import llama_cpp
    from llama_cpp import Llama
    src, pack = packs("qwen3moe")
    for model in (pack / "trunk.gguf", src):
        with pytest.raises(ValueError) as e:
            Llama(model_path=str(model), expert_pack=str(pack), split_mode=llama_cpp.LLAMA_SPLIT_MODE_ROW, n_ctx=128,
                  verbose=False)
        assert str(e.value) == ROW_REFUSED
    p = Provider.open(pack)
    try:
        mp = llama_cpp.llama_model_default_params()
        mp.split_mode = llama_cpp.LLAMA_SPLIT_MODE_ROW
        with pytest.raises(ValueError, match="LLAMA_SPLIT_MODE_ROW is not supported"):
            p.use_in(mp)
        mp.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
        p.use_in(mp)  # the layer split (the default) is the pack's
        assert mp.expert_source_ctx == p.handle
    finally:
        p.close()


def test_row_split_is_refused_by_the_loader(packs):
    """libllama's loader refuses the row split with an expert source too (the fork's tools, or a caller that sets
    split_mode after Provider.use_in), in one line of its log; without a source the CPU build loads with it."""
    import subprocess
    import textwrap

    from expert_pack_devtools.proc import python_c
    src, pack = packs("qwen3moe")
    code = textwrap.dedent(f"""
        import llama_cpp as lc
        from ggml_expert_pack.pybind.provider import Provider
        lc.llama_backend_init()
        for model, with_pack in (({str(pack / "trunk.gguf")!r}, True), ({str(src)!r}, False)):
            p = Provider.open({str(pack)!r}) if with_pack else None
            mp = lc.llama_model_default_params()
            if p is not None:
                p.use_in(mp)
            mp.split_mode = lc.LLAMA_SPLIT_MODE_ROW
            m = lc.llama_model_load_from_file(model.encode(), mp)
            print("loaded" if m else "refused", flush=True)
            if m:
                lc.llama_model_free(m)
            if p is not None:
                p.close()
    """)
    r = subprocess.run(python_c(code), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["refused", "loaded"]
    lines = [ln for ln in r.stderr.splitlines() if "split-mode row" in ln]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].endswith("expert pack: --split-mode row is not supported with an expert pack; "
                             "use --split-mode layer")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_gpu_cpu_layer_split_lossless(packs, stock, arch):
    """Half the layers on the GPU, half on the CPU backend, evicting caches on both: each device gets its own cache
    and counters, and the output matches stock llama.cpp with the same split (tokens identical, logits within the
    difference stock shows between its own runs at two ubatch sizes)."""
    src, pack = packs(arch)
    p = Provider.open(pack, cache_vram_reserve_mib=0)
    n_moe = p.stats()["n_layers"]
    p.close()
    ngl = max(1, n_moe // 2)
    p = Provider.open(pack, cache_vram_reserve_mib=0, cache_vram_mib=cache_mib_for_slots(pack, 4))
    try:
        with_pack = run(pack / "trunk.gguf", p, n_gpu_layers=ngl, prompt_len=64)
        s = p.stats()
    finally:
        p.close()
    assert with_pack.error == 0
    names = sorted(d["device"] for d in s["devices"])
    assert len(names) == 2 and "CPU" in names, names
    for d in s["devices"]:  # a device whose few layers all fit holds them resident: no misses there
        assert d["layers"] > 0, d
        if d["resident_layers"] < d["layers"]:
            assert d["cache_misses"] > 0, d
    assert any(d["resident_layers"] < d["layers"] for d in s["devices"]), s["devices"]
    for k in COUNTERS:
        assert sum(d[k] for d in s["devices"]) == s[k], k
    ub = with_pack.n_ubatch
    ref = stock.run(src, n_gpu_layers=ngl, n_ubatch=ub, prompt_len=64)
    ref_other = stock.run(src, n_gpu_layers=ngl, n_ubatch=max(1, ub // 2) if ub > 1 else 2, prompt_len=64)
    assert with_pack.tokens == ref.tokens
    assert float(np.abs(ref.logits - with_pack.logits).max()) <= float(np.abs(ref.logits - ref_other.logits).max())
