"""Loading a pack checks what `expert-pack verify --quick` checks, and the trunk, before llama.cpp reads either:
a damaged or edited manifest or trunk is one clear error, never a crash. Also the errors and sizes a user meets
first: paths, keys, size strings, the stats file, the summary line and the hit rate of resident layers."""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import textwrap

import pytest

from ggml_expert_pack.gguf_file import read_header
from expert_pack_devtools.lossless import cache_mib_for_slots
from ggml_expert_pack.packer.format import manifest_digest
from expert_pack_devtools.proc import python_c


@pytest.fixture(scope="module")
def pack(packs):
    return packs("qwen3moe")


def _copy(pack_dir, tmp_path):
    dst = tmp_path / "p"
    shutil.copytree(pack_dir, dst)
    return dst


def _load(model, pack_dir, **cfg):
    """Load through the C library's own checks (the provider and llama.cpp's loader, as the fork's tools do; the
    Python API checks the pack as `verify --quick` does before that) in a child process, so that a crash is a failed
    test, not the end of the run; (returncode, stderr, stdout)."""
    code = textwrap.dedent(f"""
        import json, sys
        from expert_pack_devtools.lossless import Session
        from ggml_expert_pack.pybind.provider import Provider
        try:
            p = Provider.open({str(pack_dir)!r}, **{cfg!r})
            s = Session({str(model)!r}, p, n_ctx=128, n_gpu_layers=0, n_threads=2)
            toks, rc = s.generate([100, 101, 102], 4)
            print(json.dumps({{"tokens": toks, "rc": rc, "stats": p.stats(), "summary": p.summary}}))
        except (ValueError, RuntimeError) as e:
            print("ERROR:", e, file=sys.stderr)
            sys.exit(3)
    """)
    r = subprocess.run(python_c(code), capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr, r.stdout


def _edit_manifest(d, fn, redigest=True):
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    if redigest:
        m["manifest_digest"] = manifest_digest(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _patch_kv(path, key, pack_fmt, value):
    """Overwrite a scalar KV of a GGUF in place (same size)."""
    kv = read_header(path).kvs[key]
    data = bytearray(path.read_bytes())
    at = data.find(kv.raw)
    assert at >= 0
    end = at + len(kv.raw)
    n = struct.calcsize(pack_fmt)
    data[end - n:end] = struct.pack(pack_fmt, value)
    path.write_bytes(bytes(data))


def test_a_manifest_edited_after_the_build_is_refused(pack, tmp_path):
    d = _copy(pack[1], tmp_path)
    _edit_manifest(d, lambda m: m["layers"][0].__setitem__("block_bytes", m["layers"][0]["block_bytes"] - 1),
                   redigest=False)
    rc, err, _ = _load(d / "trunk.gguf", d)
    assert rc == 3 and "modified after the build" in err


def test_a_layer_index_out_of_range_is_refused_even_with_a_recomputed_digest(pack, tmp_path):
    d = _copy(pack[1], tmp_path)
    _edit_manifest(d, lambda m: m["layers"][0].__setitem__("layer", 2147483648))
    rc, err, _ = _load(d / "trunk.gguf", d)
    assert rc == 3 and "out of range" in err and "layer" in err


def test_swapped_roles_with_a_recomputed_digest_fail_the_pack_id(pack, tmp_path):
    d = _copy(pack[1], tmp_path)

    def swap(m):
        r = m["layers"][0]["roles"]
        r[0]["role"], r[-1]["role"] = r[-1]["role"], r[0]["role"]
    _edit_manifest(d, swap)
    rc, err, _ = _load(d / "trunk.gguf", d)
    assert rc == 3 and "pack_id" in err


def test_an_oversized_manifest_is_refused_without_reading_it(pack, tmp_path):
    d = _copy(pack[1], tmp_path)
    with open(d / "manifest.json", "r+b") as f:
        f.truncate(300 << 20)  # sparse: nothing is written
    rc, err, _ = _load(d / "trunk.gguf", d)
    assert rc == 3 and "MiB" in err


@pytest.mark.parametrize("key,fmt,value,words", [
    ("qwen3moe.expert_count", "<I", 0, "expert_count"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", "<f", -math.inf, "layer_norm_rms_epsilon is -inf"),
    ("qwen3moe.block_count", "<I", 0, "block_count is 0 (must be 1..512)"),
    ("qwen3moe.rope.freq_base", "<f", 1.0, "modified after the build"),  # valid alone: the checksum catches it
])
def test_a_damaged_trunk_is_a_clear_error_not_an_assertion(pack, tmp_path, key, fmt, value, words):
    d = _copy(pack[1], tmp_path)
    _patch_kv(d / "trunk.gguf", key, fmt, value)
    rc, err, _ = _load(d / "trunk.gguf", d)
    assert rc == 3 and words in err, err


def test_the_python_api_checks_the_pack_as_verify_quick_does(pack, tmp_path):
    from llama_cpp import Llama
    d = _copy(pack[1], tmp_path)
    _patch_kv(d / "trunk.gguf", "qwen3moe.rope.freq_base", "<f", 0.0)
    with pytest.raises(ValueError, match="expert pack .*trunk.gguf"):
        Llama(model_path=str(d / "trunk.gguf"), expert_pack=str(d), verbose=False)


def test_an_epsilon_out_of_range_in_a_source_gguf_is_refused(pack, tmp_path):
    src = tmp_path / "src.gguf"
    shutil.copy(pack[0], src)
    _patch_kv(src, "qwen3moe.attention.layer_norm_rms_epsilon", "<f", -math.inf)
    rc, err, _ = _load(src, pack[1])
    assert rc == 3 and "layer_norm_rms_epsilon" in err and "finite" in err, err


def test_a_truncated_trunk_is_refused(pack, tmp_path):
    d = _copy(pack[1], tmp_path)
    size = (d / "trunk.gguf").stat().st_size
    os.truncate(d / "trunk.gguf", size - 4096)
    rc, err, _ = _load(d / "trunk.gguf", d)
    assert rc == 3 and "truncated" in err


def test_paths_are_said_in_the_apis_terms(pack, tmp_path):
    from llama_cpp import Llama
    with pytest.raises(ValueError, match="expert-pack folder.*trunk.gguf"):
        Llama(model_path=str(pack[1]), verbose=False)
    with pytest.raises(ValueError, match="expert-pack trunk.*expert_pack="):
        Llama(model_path=str(pack[1] / "trunk.gguf"), verbose=False)
    shard2 = tmp_path / "m-00002-of-00003.gguf"
    shutil.copy(pack[0], shard2)
    with pytest.raises(ValueError, match="shard 2 of 3.*m-00001-of-00003.gguf"):
        Llama(model_path=str(shard2), verbose=False)
    with pytest.raises(ValueError, match="no such directory"):
        Llama(model_path=str(pack[1] / "trunk.gguf"), expert_pack=str(tmp_path / "nope.pack"), verbose=False)


def test_unknown_keys_suggest_the_right_one():
    from ggml_expert_pack.pybind.provider import normalize_config
    with pytest.raises(ValueError, match="did you mean 'cache_vram_mib'"):
        normalize_config({"pack_path": "x", "manifest_path": "x", "cache_mib": 100})


@pytest.mark.parametrize("value,mib", [("512M", 512), ("8G", 8192), ("1.5G", 1536), ("2048", 2048), (100, 100),
                                       ("64K", 0.0625), ("1T", 1 << 20)])
def test_sizes_take_units(value, mib):
    from ggml_expert_pack.pybind import ffi, lib
    text = json.dumps({"pack_path": "x", "manifest_path": "x", "cache_vram_mib": value})
    err = ffi().new("char[512]")
    assert lib().expert_pack_config_validate(text.encode(), err, 512) == 0, ffi().string(err)


@pytest.mark.parametrize("key,value", [("cache_vram_mib", "8X"), ("cache_vram_mib", "-1G"), ("cache_vram_mib", "auto"),
                                       ("ram_cache_mib", "lots"), ("cache_vram_mib", True)])
def test_bad_sizes_name_the_key(key, value):
    from ggml_expert_pack.pybind.provider import normalize_config
    with pytest.raises(ValueError, match=f"'{key}' must be a size"):
        normalize_config({"pack_path": "x", "manifest_path": "x", key: value})


def test_a_stats_file_that_cannot_be_written_is_refused_at_start(pack, tmp_path):
    rc, err, _ = _load(pack[1] / "trunk.gguf", pack[1], stats_path=str(tmp_path / "no" / "such" / "s.json"))
    assert rc == 3 and "stats_path" in err and "cannot write" in err
    ok = tmp_path / "s.json"
    rc, err, _ = _load(pack[1] / "trunk.gguf", pack[1], stats_path=str(ok))
    assert rc == 0, err
    assert json.loads(ok.read_text())["cache_hits"] >= 0


def test_the_summary_says_how_the_cache_was_sized(pack):
    rc, err, out = _load(pack[1] / "trunk.gguf", pack[1], cache_vram_mib=cache_mib_for_slots(pack[1], 9),
                         cache_vram_reserve_mib=0)
    assert rc == 0, err
    line = json.loads(out)["summary"]
    assert line.startswith("expert pack: 9 of 16 experts cached per MoE layer, 0 of 4 MoE layers resident")
    assert "CPU" in line and "MiB asked" in line and "no host-RAM tier" in line
    # the default budget on the CPU is what the process can still take, not the machine's total memory
    rc, err, out = _load(pack[1] / "trunk.gguf", pack[1])
    assert rc == 0, err
    assert "MemAvailable" in json.loads(out)["summary"] or "cgroup" in json.loads(out)["summary"]


def test_resident_layers_count_as_hits(pack):
    rc, err, out = _load(pack[1] / "trunk.gguf", pack[1])  # the default budget holds every expert
    assert rc == 0, err
    r = json.loads(out)
    s = r["stats"]
    assert "4 of 4 MoE layers resident" in r["summary"]
    assert s["cache_misses"] == 0 and s["cache_hits"] > 0 and s["hit_rate"] == 1.0 and s["steps"] > 0
    assert s["pack_read_bytes"] > 0  # the preload's reads still count as bytes read


def test_ram_cache_auto(pack):
    rc, err, out = _load(pack[1] / "trunk.gguf", pack[1], cache_vram_mib=cache_mib_for_slots(pack[1], 9),
                         cache_vram_reserve_mib=0, ram_cache_mib="auto")
    assert rc == 0, err
    # on the CPU the cache itself is host memory: auto turns the tier off, and says so
    assert "no host-RAM tier (auto: off)" in json.loads(out)["summary"]


def test_a_pack_sizes_the_batch_for_whole_prompts(pack):
    """With a pack and no n_batch / n_ubatch given, both are sized for whole prompts (up to n_ctx and 8192), so a
    prompt reads the pack once; given sizes are kept; without a pack llama-cpp-python's 512 stays."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(pack[1] / "trunk.gguf"), expert_pack=str(pack[1]), n_ctx=2048, verbose=False)
    try:
        assert llm.n_batch == 2048 and llm.context_params.n_ubatch == 2048
    finally:
        llm.close()
    llm = Llama(model_path=str(pack[1] / "trunk.gguf"), expert_pack=str(pack[1]), n_ctx=2048, n_ubatch=256,
                verbose=False)
    try:
        assert llm.n_batch == 512 and llm.context_params.n_ubatch == 256
    finally:
        llm.close()
    llm = Llama(model_path=str(pack[0]), n_ctx=2048, verbose=False)
    try:
        assert llm.n_batch == 512 and llm.context_params.n_ubatch == 512
    finally:
        llm.close()


def test_prompt_logits_bit_identical_at_a_whole_prompt_ubatch(pack):
    """A 700-token prompt in one ubatch of 1024 with an evicting cache (served in rounds): logits bit-identical to
    stock's at the same ubatch."""
    import numpy as np
    from expert_pack_devtools.lossless import run
    from ggml_expert_pack.pybind.provider import Provider
    p = Provider.open(pack[1], cache_vram_mib=cache_mib_for_slots(pack[1], 9), cache_vram_reserve_mib=0,
                      read_splits=4, read_threads=4)
    try:
        got = run(pack[1] / "trunk.gguf", p, n_ubatch=1024, prompt_len=700, n_decode=4, n_ctx=1024)
    finally:
        p.close()
    ref = run(pack[0], None, n_ubatch=1024, prompt_len=700, n_decode=4, n_ctx=1024)
    assert got.error == 0 and got.n_ubatch == 1024
    assert got.tokens == ref.tokens and np.array_equal(got.logits, ref.logits)
