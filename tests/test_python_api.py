"""The Python API: `Llama(model_path, expert_pack=...)` behaves like stock llama-cpp-python on the
original GGUF — same text, same chat, same streaming — plus `expert_pack_stats()`; bad configuration raises
ValueError naming the key."""
from __future__ import annotations

import pickle

import pytest
from llama_cpp import Llama

from expert_pack_devtools.lossless import cache_mib_for_slots
from ggml_expert_pack.packer import build

K = 4


@pytest.fixture(scope="module")
def pair(synth_model, tmp_path_factory):
    src = synth_model("qwen3moe")
    pack = build(src, tmp_path_factory.mktemp("api") / "pack", progress=False).pack_dir
    return src, pack


def _llm(path, **kw):
    # op_offload off on both sides: on a CUDA build stock would compute the prompt's big matmuls on the GPU, which a
    # pack turns off (vendor/patches/0004) -- the comparison is CPU against CPU
    return Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, seed=0, op_offload=False, **kw)


@pytest.fixture(scope="module")
def stock(pair):
    llm = _llm(pair[0])
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def packed(pair):
    # an evicting cache: 2K+1 slots per layer out of 16 experts
    llm = _llm(pair[1] / "trunk.gguf", expert_pack={"pack_dir": str(pair[1]), "cache_vram_reserve_mib": 0,
                                                     "cache_vram_mib": cache_mib_for_slots(pair[1], 2 * K + 1)})
    yield llm
    llm.close()


def test_completion_equals_stock(stock, packed):
    a = stock("The capital of France is", max_tokens=24, temperature=0)
    b = packed("The capital of France is", max_tokens=24, temperature=0)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["usage"] == a["usage"]


def test_chat_and_streaming_equal_stock(stock, packed):
    msgs = [{"role": "user", "content": "Hello there"}]
    a = stock.create_chat_completion(messages=msgs, max_tokens=16, temperature=0)
    b = packed.create_chat_completion(messages=msgs, max_tokens=16, temperature=0)
    assert b["choices"][0]["message"] == a["choices"][0]["message"]
    streamed = "".join(ch["choices"][0]["text"] for ch in packed.create_completion(
        "Once upon a time", max_tokens=16, temperature=0, stream=True))
    assert streamed == stock("Once upon a time", max_tokens=16, temperature=0)["choices"][0]["text"]


def test_tokenize_is_the_same(stock, packed):
    assert packed.tokenize(b"expert packs") == stock.tokenize(b"expert packs")


def test_stats(packed):
    packed.reset()
    packed("Count me", max_tokens=8, temperature=0)
    s = packed.expert_pack_stats()
    for k in ("cache_hits", "cache_misses", "cache_evictions", "pack_read_bytes", "h2d_bytes", "fallback_count",
              "io_errors"):
        assert isinstance(s[k], int), k
    assert s["cache_misses"] > 0 and s["pack_read_bytes"] > 0 and s["io_errors"] == 0


def test_ram_tier_and_read_threads_through_the_api(pair, stock):
    from expert_pack_devtools.lossless import ram_mib_for_blocks
    llm = _llm(pair[1] / "trunk.gguf", expert_pack={"pack_dir": str(pair[1]), "cache_vram_reserve_mib": 0,
                                                     "cache_vram_mib": cache_mib_for_slots(pair[1], 2 * K + 1),
                                                     "ram_cache_mib": ram_mib_for_blocks(pair[1], 24),
                                                     "read_threads": 3})
    try:
        got = llm("The capital of France is", max_tokens=24, temperature=0)
        s = llm.expert_pack_stats()
    finally:
        llm.close()
    assert got["choices"][0]["text"] == stock("The capital of France is", max_tokens=24, temperature=0)["choices"][0]["text"]
    assert s["ram_blocks"] == 24 and s["config"]["read_threads"] == 3
    assert s["cache_misses"] == s["ram_hits"] + s["ram_misses"] > 0 and s["io_errors"] == 0


def test_stats_without_pack_is_an_error(stock):
    with pytest.raises(ValueError, match="without an expert pack"):
        stock.expert_pack_stats()


@pytest.mark.parametrize("cfg, match", [
    ({"pack_dir": None, "cache_vram_mb": 1}, "cache_vram_mb"),
    ({"read_splits": "two"}, "read_splits"),
    ({"direct_io": 1}, "direct_io"),
    ({"ram_cache_mib": "1024 apples"}, "ram_cache_mib"),  # "1024", "1G" and "auto" are sizes; this is not
    ({"read_threads": 0}, "read_threads"),
    ({"trace_path": 3}, "trace_path"),
])
def test_bad_keys_name_the_key(pair, cfg, match):
    cfg = {**cfg, "pack_dir": str(pair[1])}
    with pytest.raises(ValueError, match=match):
        _llm(pair[1] / "trunk.gguf", expert_pack=cfg)


def test_wrong_type_for_expert_pack(pair):
    with pytest.raises(ValueError, match="expert_pack"):
        _llm(pair[1] / "trunk.gguf", expert_pack=42)


def test_trunk_without_pack_is_refused(pair):
    with pytest.raises(ValueError, match="expert_pack"):
        _llm(pair[1] / "trunk.gguf")


def test_state_keeps_the_pack(packed):
    state = packed.__getstate__()
    assert state["expert_pack"]["pack_dir"]
    pickle.dumps(state)


def test_max_tokens_is_exact_even_on_a_split_utf8_character(packed):
    """Upstream generated one token past max_tokens when the last one ended inside a UTF-8 character (patch 0008)."""
    from llama_cpp import LogitsProcessorList

    from expert_pack_devtools.bench_client import requests
    for _, _, prompt in requests():
        for stream in (False, True):
            calls = []
            out = packed.create_completion(prompt, max_tokens=6, temperature=0, stream=stream,
                                           logits_processor=LogitsProcessorList([lambda ids, s: calls.append(1) or s]))
            if stream:
                list(out)
            else:
                assert out["usage"]["completion_tokens"] <= 6
            assert len(calls) <= 6, prompt
