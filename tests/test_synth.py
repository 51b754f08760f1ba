"""Synthetic models: every arch loads in llama.cpp and generates deterministically; shards, types, tokenizer."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from ggml_expert_pack.gguf_file import read_header
from expert_pack_devtools.synth import SynthConfig, plan
from expert_pack_devtools.synth.generate import generate
from conftest import TINY

ARCHS = list(TINY)


def _generate_tokens(path, n=16) -> list[int]:
    """n greedy tokens after a fixed prompt (token ids: text can merge or split tokens)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=256, verbose=False, seed=1234)
    out = []
    for tok in llm.generate(llm.tokenize(b"Once upon a time"), temp=0.0):
        out.append(tok)
        if len(out) == n:
            break
    del llm
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_loads_and_generates_deterministically(synth_model, arch):
    path = synth_model(arch)
    first = _generate_tokens(path)
    second = _generate_tokens(path)  # a second, separate load
    assert len(first) == 16
    assert first == second


def test_three_shards_load_from_first(synth_model):
    single = synth_model("qwen3moe")
    first = synth_model("qwen3moe", shards=3)
    assert first.name.endswith("-00001-of-00003.gguf")
    shards = sorted(first.parent.glob(first.name.replace("-00001-of-00003", "-0000?-of-00003")))
    assert len(shards) == 3
    heads = [read_header(p) for p in shards]
    assert [h.get("split.no") for h in heads] == [0, 1, 2]
    assert all(h.get("split.count") == 3 for h in heads)
    assert sum(len(h.tensors) for h in heads) == heads[0].get("split.tensors.count") == len(read_header(single).tensors)
    # same weights, same computation: the split model generates what the single file does
    assert _generate_tokens(first) == _generate_tokens(single)


def test_tensor_types_per_role_and_layer(synth_model):
    path = synth_model("qwen3moe", expert_type="q4_k", expert_types={"down": "q8_0"},
                       layer_expert_types={"1": "f16", "2": {"gate": "q2_k", "up": "q3_k"}, "3": "mxfp4"})
    h = read_header(path)
    types = {t.name: t.type for t in h.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == T.Q4_K
    assert types["blk.0.ffn_down_exps.weight"] == T.Q8_0
    assert types["blk.1.ffn_up_exps.weight"] == T.F16
    assert types["blk.1.ffn_down_exps.weight"] == T.F16
    assert types["blk.2.ffn_gate_exps.weight"] == T.Q2_K
    assert types["blk.2.ffn_up_exps.weight"] == T.Q3_K
    assert types["blk.2.ffn_down_exps.weight"] == T.Q8_0
    assert types["blk.3.ffn_gate_exps.weight"] == T.MXFP4
    assert len(_generate_tokens(path)) == 16


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_finite(synth_model, arch):
    from ggml_expert_pack import libggml
    path = synth_model(arch)
    h = read_header(path)
    with open(path, "rb") as f:
        for t in h.tensors:
            if t.type == T.I32:
                continue
            f.seek(t.offset)
            data = np.frombuffer(f.read(t.nbytes), dtype=np.uint8)
            assert libggml.validate(t.type, data), t.name


def test_real_tokenizer(synth_model):
    from llama_cpp import Llama
    llm = Llama(model_path=str(synth_model("qwen3moe")), n_ctx=64, verbose=False, vocab_only=True)
    toks = llm.tokenize(b"Hello world, this is expert-pack.", add_bos=False)
    assert 5 <= len(toks) <= 12  # a BPE vocabulary, not bytes or characters
    assert llm.detokenize(toks) == b"Hello world, this is expert-pack."
    assert llm.n_vocab() == 151936


def test_plan_matches_file(synth_model):
    path = synth_model("deepseek4")
    kvs, specs, n_vocab = plan(SynthConfig.from_dict(TINY["deepseek4"]))
    h = read_header(path)
    assert [(t.name, t.shape, t.type) for t in h.tensors] == [(s.name, s.shape, s.type) for s in specs]
    assert h.get("deepseek4.hash_layer_count") == 1
    assert h.get("deepseek4.nextn_predict_layers") == 1


@pytest.mark.parametrize("bad, match", [
    (dict(arch="mixtral"), "unsupported arch"),
    (dict(n_expert_used=64), "n_expert_used"),
    (dict(expert_type="q9_k"), "unknown ggml type"),
    (dict(expert_types={"gatee": "q4_k"}), "unknown role"),
    (dict(n_dense_lead=1), "kimi-k3"),
    (dict(bogus=1), "unknown config keys"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        SynthConfig.from_dict({**TINY["qwen3moe"], **bad})


def test_incompatible_type_and_width_is_a_clear_error(tmp_path):
    cfg = SynthConfig.from_dict({**TINY["qwen3moe"], "n_ff_exp": 96})  # 96 is not a multiple of Q4_K's 256
    with pytest.raises(ValueError, match="block size"):
        generate(cfg, tmp_path / "bad.gguf", progress=False)
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind


def test_cli_synth_and_print_config(tmp_path, capsys):
    from ggml_expert_pack.cli import main
    assert main(["synth", str(tmp_path / "m.gguf"), "--shape", "tiny", "--layers", "2", "--routing", "uniform",
                 "--print-config"]) == 0
    cfg = SynthConfig.from_dict(__import__("json").loads(capsys.readouterr().out))
    assert cfg.n_layer == 2 and cfg.routing.preset == "uniform" and cfg.routing.zipf == 0.0
    assert main(["synth", str(tmp_path / "m.gguf"), "--shape", "tiny", "--layers", "2", "--quiet"]) == 0
    assert read_header(tmp_path / "m.gguf").get("qwen3moe.block_count") == 2
