"""Packer: byte-exact round trips, layout rules, the trunk, corruption detection and bad input; the CLI's errors."""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from ggml_expert_pack.cli import main as cli
from ggml_expert_pack.gguf_file import read_header
from ggml_expert_pack.gguf_stream import GGUFStreamWriter, TensorInfo, kv_f32, kv_str, kv_u32
from ggml_expert_pack.packer import BuildError, SourceError, VerifyError, build, open_source, verify
from ggml_expert_pack.packer.format import (ALIGNMENT, HEADER_SIZE, MANIFEST_FILE, PACK_FILE, TRUNK_FILE,
                                            layers_from_manifest, load_manifest)
from ggml_expert_pack.pybind import xxh3_128
from expert_pack_devtools.proc import python_c

MIXED = dict(expert_type="q4_k", layer_expert_types={"1": "f16", "2": "q2_k"})
CASES = {
    "qwen3moe": ("qwen3moe", 1, {}),
    "deepseek4": ("deepseek4", 1, {}),
    "kimi-k3": ("kimi-k3", 1, {}),
    "qwen3moe-mixed-types": ("qwen3moe", 1, MIXED),
    "qwen3moe-role-types": ("qwen3moe", 1, dict(expert_types={"gate": "q8_0", "up": "q3_k", "down": "mxfp4"})),
    "qwen3moe-3-shards": ("qwen3moe", 3, {}),
}


@pytest.fixture(scope="module")
def packs(synth_model, tmp_path_factory):
    """case -> (source path, pack dir), built once per module."""
    root = tmp_path_factory.mktemp("packs")
    out = {}

    def get(case):
        if case not in out:
            arch, shards, over = CASES[case]
            src = synth_model(arch, shards=shards, **over)
            out[case] = (src, build(src, root / case).pack_dir)
        return out[case]
    return get


def _source_bytes(src_path: Path, tensor_name: str) -> tuple[bytes, tuple, object]:
    s = open_source(src_path)
    t = next(t for t in s.tensors if t.name == tensor_name)
    with open(s.paths[t.shard], "rb") as f:
        f.seek(t.entry.offset)
        return f.read(t.entry.nbytes), t.entry.shape, t.entry.type


def _xxh3_long_inputs():
    a = bytes(range(256)) * 4096                                                  # 1 MiB
    b = (np.arange(1_000_003, dtype=np.int64) * 7919 % 251).astype(np.uint8).tobytes()  # an odd length
    return {"a": a, "b": b, "c": bytes(range(256)) * 9 + b"xyz", "a+1": a + b"\x01"}


def test_xxh3_known_vectors():
    assert xxh3_128(b"").hex() == "99aa06d3014798d86001c324468d497f"
    assert xxh3_128(b"abc").hex() == "06b05ab6733a618578af5f94892f3950"
    # inputs long enough for the vectorised loop (the AVX2 path where the CPU has it, src/checksum_avx2.cpp)
    want = {"a": "1b208d2839093774d36c0e13a3df139e", "b": "db7dab1eb1a05b19c0f8462487e4854d",
            "c": "284ea7510a9d3ae2a6cb3518d8e6e30d", "a+1": "f9e5b35fdf1767253bfbd48c2a5afcae"}
    assert {k: xxh3_128(v).hex() for k, v in _xxh3_long_inputs().items()} == want


def test_xxh3_vector_paths_agree():
    """The run-time choice of the hash's vector unit never changes a checksum: the default path and the forced
    baseline (EXPERT_PACK_XXH3_BASELINE=1) agree on random blocks of many lengths."""
    import subprocess
    code = ("import numpy as np; from ggml_expert_pack.pybind import xxh3_128; "
            "r = np.random.default_rng(5); "
            "print(' '.join(xxh3_128(r.integers(0, 256, n, dtype=np.uint8)).hex() "
            "for n in (0, 1, 17, 129, 240, 241, 1024, 4096, 65536 + 3, 2 * 1048576 + 4096)))")
    env = {k: v for k, v in os.environ.items() if k != "EXPERT_PACK_XXH3_BASELINE"}
    default = subprocess.run(python_c(code), capture_output=True, text=True, env=env, check=True)
    baseline = subprocess.run(python_c(code), capture_output=True, text=True, check=True,
                              env={**env, "EXPERT_PACK_XXH3_BASELINE": "1"})
    assert default.stdout.split() == baseline.stdout.split() and len(default.stdout.split()) == 10


@pytest.mark.parametrize("case", list(CASES))
def test_roundtrip_byte_for_byte(packs, case):
    src, pack = packs(case)
    m = load_manifest(pack)
    layers = layers_from_manifest(m)
    raw = (pack / PACK_FILE).read_bytes()
    assert len(raw) == m["pack"]["size"]
    source = open_source(src)
    assert [l.layer for l in layers] == sorted(source.experts)  # dense layers skipped, MTP layers included
    for l, lj in zip(layers, m["layers"]):
        assert l.offset % ALIGNMENT == 0 and l.expert_stride % ALIGNMENT == 0 and l.read_bytes % ALIGNMENT == 0
        for r in l.roles:
            data, shape, ttype = _source_bytes(src, r.tensor)
            assert (r.type, r.shape) == (ttype, shape)
            for e in range(m["n_experts"]):
                got = raw[l.expert_offset(e) + r.offset: l.expert_offset(e) + r.offset + r.bytes]
                assert got == data[e * r.bytes:(e + 1) * r.bytes], f"{r.tensor} expert {e}"
        for e in range(m["n_experts"]):
            block = raw[l.expert_offset(e): l.expert_offset(e) + l.expert_stride]
            assert xxh3_128(block[:l.block_bytes]).hex() == lj["checksums"][e]
            assert not any(block[l.block_bytes:])
    verify(pack)


@pytest.mark.parametrize("case", ["qwen3moe", "deepseek4", "kimi-k3", "qwen3moe-3-shards"])
def test_trunk_and_manifest_reproduce_the_tensor_list(packs, case):
    src, pack = packs(case)
    original = [(t.name, t.entry.shape, t.entry.type) for t in open_source(src).tensors]
    m = load_manifest(pack)
    trunk = {t.name: (t.shape, t.type) for t in read_header(pack / TRUNK_FILE).tensors}
    experts = {r.tensor: (r.shape, r.type) for l in layers_from_manifest(m) for r in l.roles}
    assert not set(trunk) & set(experts)
    rebuilt = [(n, *(trunk.get(n) or experts[n])) for n in m["source"]["tensor_names"]]
    assert rebuilt == original
    # the trunk keeps all metadata but the split keys, and is tied to the pack
    th, sh = read_header(pack / TRUNK_FILE), read_header(src)
    assert {k for k in sh.kvs if not k.startswith("split.")} | {"expert_pack.pack_id", "expert_pack.source_fingerprint"} \
        == set(th.kvs)
    assert th.get("expert_pack.pack_id") == m["pack_id"]
    # trunk tensor data is byte for byte the source's
    s = open_source(src)
    for t in read_header(pack / TRUNK_FILE).tensors[:5]:
        with open(pack / TRUNK_FILE, "rb") as f:
            f.seek(t.offset)
            assert f.read(t.nbytes) == _source_bytes(src, t.name)[0]
    del s


def test_stride_choice(packs, capsys):
    """One stride when blocks are alike; per-layer strides when they save more than 3% (docs/FORMAT.md)."""
    for case, uniform in [("qwen3moe", True), ("qwen3moe-role-types", True), ("qwen3moe-mixed-types", False)]:
        m = load_manifest(packs(case)[1])
        layers = layers_from_manifest(m)
        one = max(l.read_bytes for l in layers) * len(layers) * m["n_experts"]
        per = sum(l.read_bytes for l in layers) * m["n_experts"]
        with capsys.disabled():
            print(f"\n{case}: one stride {one} B, per-layer {per} B, saving {100 * (one - per) / one:.1f}%")
        assert m["pack"]["uniform_stride"] is uniform


def _copy_pack(pack: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(pack, dst)
    return dst


def test_flipped_byte_names_the_block(packs, tmp_path):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    m = load_manifest(pack)
    l = layers_from_manifest(m)[2]
    off = l.expert_offset(11) + l.roles[1].offset + 77
    with open(pack / PACK_FILE, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    verify(pack, quick=True)  # structure is intact
    with pytest.raises(VerifyError, match=f"layer {l.layer} expert 11 .*checksum mismatch"):
        verify(pack)
    assert cli(["verify", str(pack), "--quiet"]) == 1


def test_nonzero_padding_is_found(packs, tmp_path):
    pack = _copy_pack(packs("qwen3moe-mixed-types")[1], tmp_path)
    l = next(l for l in layers_from_manifest(load_manifest(pack)) if l.block_bytes < l.expert_stride)
    with open(pack / PACK_FILE, "r+b") as f:
        f.seek(l.expert_offset(3) + l.expert_stride - 1)
        f.write(b"\x01")
    with pytest.raises(VerifyError, match="expert 3: padding"):
        verify(pack)


def test_truncated_pack(packs, tmp_path):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    size = (pack / PACK_FILE).stat().st_size
    os.truncate(pack / PACK_FILE, size - 4096)
    with pytest.raises(VerifyError, match="truncated"):
        verify(pack, quick=True)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["layers"][1]["checksums"].__setitem__(0, "0" * 32), "modified after the build"),
    (lambda m: m["layers"][0].__setitem__("offset", 8192), "modified after the build"),
    (lambda m: m.__setitem__("n_experts", 8), "modified after the build"),
])
def test_edited_manifest(packs, tmp_path, edit, match):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    m = json.loads((pack / MANIFEST_FILE).read_text())
    edit(m)
    (pack / MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(VerifyError, match=match):
        verify(pack, quick=True)


def test_edited_manifest_with_recomputed_digest_is_still_refused(packs, tmp_path):
    from ggml_expert_pack.packer.format import manifest_digest
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    m = json.loads((pack / MANIFEST_FILE).read_text())
    m["layers"][0]["roles"][0]["offset"] += 256
    m["manifest_digest"] = manifest_digest(m)
    (pack / MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(VerifyError, match="does not match its pack_id"):
        verify(pack, quick=True)


def test_trunk_from_another_model(packs, tmp_path):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    other = packs("qwen3moe-mixed-types")[1]
    shutil.copyfile(other / TRUNK_FILE, pack / TRUNK_FILE)
    with pytest.raises(VerifyError, match="trunk.gguf"):
        verify(pack, quick=True)


def test_pack_from_another_model(packs, tmp_path):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    shutil.copyfile(packs("qwen3moe-role-types")[1] / PACK_FILE, pack / PACK_FILE)
    with pytest.raises(VerifyError, match="experts.pack"):
        verify(pack, quick=True)


# ---- bad input -----------------------------------------------------------------------------------------

def _tiny_gguf(path: Path, tensors: list[TensorInfo], arch="qwen3moe", extra_kvs=()):
    w = GGUFStreamWriter(path, [kv_str("general.architecture", arch), *extra_kvs], tensors)
    with open(path, "wb") as f:
        w.begin(f)
        for t in tensors:
            w.write_tensor_data([np.zeros(t.nbytes, np.uint8)])
        w.end()
    return path


def _HPARAMS(n_embd: int, n_layer: int, used: int = 2):
    """The hyperparameters llama.cpp requires of every model (a source without them is refused)."""
    return [kv_u32("qwen3moe.block_count", n_layer), kv_u32("qwen3moe.context_length", 256),
            kv_u32("qwen3moe.embedding_length", n_embd), kv_u32("qwen3moe.expert_used_count", used)]


def _assert_nothing_written(out: Path):
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


@pytest.mark.parametrize("make, match", [
    (lambda d: (d / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf at all"), "not a GGUF"),
    (lambda d: _tiny_gguf(d / "x.gguf", [TensorInfo("token_embd.weight", (64, 8), T.F16)]), "no routed experts"),
    (lambda d: _tiny_gguf(d / "x.gguf", [TensorInfo("blk.0.ffn_gate_exps.weight", (64, 8, 4), T.F16)]),
     "unsupported layout"),
    (lambda d: _tiny_gguf(d / "x.gguf", [TensorInfo("blk.0.ffn_up_exps.weight", (64, 8, 4), T.F16),
                                         TensorInfo("blk.0.ffn_down_exps.weight", (8, 64, 4), T.F16),
                                         TensorInfo("blk.1.ffn_up_exps.weight", (64, 8, 2), T.F16),
                                         TensorInfo("blk.1.ffn_down_exps.weight", (8, 64, 2), T.F16)]),
     "different expert counts"),
])
def test_bad_sources(tmp_path, make, match):
    make(tmp_path)
    with pytest.raises(SourceError, match=match):
        build(tmp_path / "x.gguf", tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")
    assert cli(["build", str(tmp_path / "x.gguf"), "-o", str(tmp_path / "out"), "--quiet"]) == 2


def test_truncated_gguf(synth_model, tmp_path):
    src = tmp_path / "t.gguf"
    shutil.copyfile(synth_model("qwen3moe"), src)
    os.truncate(src, src.stat().st_size // 2)
    with pytest.raises(SourceError, match="truncated"):
        build(src, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_missing_shard(synth_model, tmp_path):
    first = synth_model("qwen3moe", shards=3)
    for p in first.parent.glob(first.name.replace("00001-of", "0000?-of")):
        if "00002-of" not in p.name:
            shutil.copyfile(p, tmp_path / p.name)
    with pytest.raises(SourceError, match="missing shard.*00002-of-00003"):
        build(tmp_path / first.name, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_merged_gate_up(tmp_path):
    """gate_up_exps (merged) + down, two MoE layers after a dense one."""
    t = [TensorInfo("token_embd.weight", (64, 16), T.F32), TensorInfo("blk.0.ffn_down.weight", (64, 64), T.F16)]
    for il in (1, 2):
        t += [TensorInfo(f"blk.{il}.ffn_gate_up_exps.weight", (64, 256, 4), T.Q8_0),
              TensorInfo(f"blk.{il}.ffn_down_exps.weight", (128, 64, 4), T.Q8_0)]
    src = _tiny_gguf(tmp_path / "m.gguf", t, extra_kvs=[kv_u32("qwen3moe.expert_count", 4), *_HPARAMS(64, 3)])
    # random content so that a misplaced byte shows
    rng = np.random.default_rng(0)
    h = read_header(src)
    with open(src, "r+b") as f:
        for e in h.tensors:
            f.seek(e.offset)
            f.write(rng.integers(0, 255, e.nbytes, dtype=np.uint8).tobytes())
    pack = build(src, tmp_path / "p").pack_dir
    m = load_manifest(pack)
    assert [l["layer"] for l in m["layers"]] == [1, 2]
    assert [r["role"] for r in m["layers"][0]["roles"]] == ["gate_up", "down"]
    verify(pack)


def test_no_room(synth_model, tmp_path, monkeypatch):
    b = importlib.import_module("ggml_expert_pack.packer.build")
    monkeypatch.setattr(b.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 3 << 20))
    with pytest.raises(BuildError, match=r"not enough space .*need .*MiB \(pack .* \+ trunk .*\), 3.0 MiB free"):
        build(synth_model("qwen3moe"), tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_interrupted_build_leaves_nothing_valid_and_rerun_works(synth_model, tmp_path, monkeypatch):
    b = importlib.import_module("ggml_expert_pack.packer.build")
    real = b._pack_layer
    calls = []

    def dies(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(b, "_pack_layer", dies)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build(synth_model("qwen3moe"), out)
    assert not out.exists()  # the build created the folder, so it removed it again
    # a build killed outright (no cleanup runs) leaves its folder and .partial files: the next build removes them
    out.mkdir()
    (out / ".experts.pack.partial").write_bytes(b"\0" * 8192)
    monkeypatch.setattr(b, "_pack_layer", real)
    build(synth_model("qwen3moe"), out)
    assert sorted(p.name for p in out.iterdir()) == sorted([PACK_FILE, MANIFEST_FILE, TRUNK_FILE])
    verify(out)


def test_existing_pack_needs_force(packs, tmp_path):
    src, pack = packs("qwen3moe")
    dst = _copy_pack(pack, tmp_path)
    with pytest.raises(BuildError, match="already holds an expert pack.*--force"):
        build(src, dst)
    build(src, dst, force=True)
    verify(dst)


def test_header_is_checked(packs, tmp_path):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    with open(pack / PACK_FILE, "r+b") as f:
        f.seek(20)
        f.write(b"\x07")
    with pytest.raises(VerifyError, match="header checksum mismatch"):
        verify(pack, quick=True)
    with open(pack / PACK_FILE, "r+b") as f:
        f.write(b"NOTAPACK")
    with pytest.raises(VerifyError, match="not an expert pack"):
        verify(pack, quick=True)
    assert HEADER_SIZE == 4096


def test_cli_inspect(packs, capsys):
    pack = packs("qwen3moe-mixed-types")[1]
    assert cli(["inspect", str(pack), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["n_moe_layers"] == 4 and s["n_experts"] == 16
    assert s["roles"]["gate"] == {"Q4_K": 2, "F16": 1, "Q2_K": 1}
    assert s["uniform_stride"] is False
    assert cli(["inspect", str(pack)]) == 0
    text = capsys.readouterr().out
    assert "pack id" in text and "Q2_K x1 layers" in text


# ---- what users found: every case refused in one line, or handled ----------------------------------------

def _rewrite_gguf(src: Path, dst: Path, kvs: dict | None = None, types: dict | None = None) -> Path:
    """A well-formed copy of GGUF `src` with KVs replaced (key -> KV, or None to drop it) and tensors retyped
    (name -> type; the data cut or zero-padded to the new size, every offset recomputed)."""
    from ggml_expert_pack.ggml_types import nbytes
    kvs, types = kvs or {}, types or {}
    h = read_header(src)
    out_kvs = [kvs.get(k, kv) for k, kv in h.kvs.items() if kvs.get(k, kv) is not None]
    out_kvs += [kv for k, kv in kvs.items() if k not in h.kvs and kv is not None]
    infos = [TensorInfo(t.name, t.shape, types.get(t.name, t.type)) for t in h.tensors]
    w = GGUFStreamWriter(dst, out_kvs, infos, alignment=h.alignment)
    with open(src, "rb") as f, open(dst, "wb") as o:
        w.begin(o)
        for t, info in zip(h.tensors, infos):
            f.seek(t.offset)
            n = nbytes(info.type, info.shape)
            w.write_tensor_data([(f.read(min(n, t.nbytes)) + bytes(n))[:n]])
        w.end()
    return dst


def _one_line_error(capsys, rc_expected, argv, match):
    rc = cli(argv)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == rc_expected and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


def _manifest_field_paths(m):
    """Every key of the manifest's objects (the layer table's first layer and role stand for all)."""
    out = []
    for k, v in m.items():
        out.append((k,))
        if isinstance(v, dict):
            out += [(k, kk) for kk in v]
    out += [("layers", 0, k) for k in m["layers"][0]]
    out += [("layers", 0, "roles", 0, k) for k in m["layers"][0]["roles"][0]]
    return out


def test_inspect_and_verify_refuse_every_deleted_field_in_one_line(packs, tmp_path, capsys):
    """inspect printed a KeyError/TypeError traceback when a field (e.g. a layer's offset) was missing."""
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    good = (pack / MANIFEST_FILE).read_text()
    m0 = json.loads(good)
    paths = _manifest_field_paths(m0)
    assert ("layers", 0, "offset") in paths and len(paths) > 30
    for path in paths:
        m = json.loads(good)
        obj = m
        for p in path[:-1]:
            obj = obj[p]
        del obj[path[-1]]
        (pack / MANIFEST_FILE).write_text(json.dumps(m))
        for cmd, rc in (("inspect", 2), ("verify", 1)):
            _one_line_error(capsys, rc, [cmd, str(pack)] + (["--quiet"] if cmd == "verify" else []), r"\S")
    (pack / MANIFEST_FILE).write_text(good)
    assert cli(["inspect", str(pack)]) == 0


@pytest.mark.parametrize("text, match", [("[]", "a JSON array, not an object"), ('"x"', "a JSON string"),
                                         ("0", "a JSON number"), ("{}", "not an expert-pack manifest"),
                                         ("[" * 100000, "nested too deeply|not valid JSON"),
                                         ('{"format": "expert-pack", "version": 1, "n_experts": NaN}',
                                          "not valid JSON")])
def test_manifest_that_is_not_an_object(packs, tmp_path, capsys, text, match):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    (pack / MANIFEST_FILE).write_text(text)
    with pytest.raises(VerifyError, match=match):
        verify(pack, quick=True)
    _one_line_error(capsys, 1, ["verify", str(pack), "--quiet"], match)
    _one_line_error(capsys, 2, ["inspect", str(pack)], match)


def test_reserved_header_bytes_must_be_zero(packs, tmp_path):
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    with open(pack / PACK_FILE, "r+b") as f:
        f.seek(2000)
        f.write(b"\x01")
    with pytest.raises(VerifyError, match="reserved byte 2000 is not zero"):
        verify(pack, quick=True)


def test_verify_and_inspect_name_a_missing_path_or_a_file(packs, tmp_path, capsys):
    for cmd in ("verify", "inspect"):
        _one_line_error(capsys, 2, [cmd, str(tmp_path / "nope.pack")], r"nope\.pack: no such directory$")
        _one_line_error(capsys, 2, [cmd, str(packs("qwen3moe")[1] / MANIFEST_FILE)], r"is a file, not a pack directory")
        (tmp_path / "empty").mkdir(exist_ok=True)
        _one_line_error(capsys, 2 if cmd == "inspect" else 1, [cmd, str(tmp_path / "empty")], r"no manifest\.json")


def _retype_in_place(src: Path, dst: Path, name: str, ttype) -> Path:
    """A copy of `src` in which only the type field of 1-D tensor `name`'s info changes."""
    shutil.copyfile(src, dst)
    raw = dst.read_bytes()
    at = raw.index(name.encode()) + len(name) + 4 + 8  # n_dims (u32) and one dim (u64) follow the name
    assert raw[at:at + 4] == int(T.F32).to_bytes(4, "little")
    with open(dst, "r+b") as f:
        f.seek(at)
        f.write(int(ttype).to_bytes(4, "little"))
    return dst


def test_norm_in_mxfp4_is_refused_naming_the_tensor(synth_model, tmp_path, capsys):
    """A norm retyped F32 -> MXFP4 was packed, and the pack aborted in ggml_compute_forward_mul at the first decode.
    Retyped in place (the tensor infos no longer match the data, which gguf.cpp refuses) and rewritten as a
    well-formed GGUF (which stock llama.cpp loads and then aborts on): both refused, naming the tensor."""
    src = synth_model("qwen3moe")
    name = "blk.1.attn_norm.weight"
    relaid = _rewrite_gguf(src, tmp_path / "relaid.gguf", types={name: T.MXFP4})
    with pytest.raises(SourceError, match=rf"tensor {re.escape(name)} is MXFP4, but llama.cpp needs F32"):
        build(relaid, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")
    inplace = _retype_in_place(src, tmp_path / "inplace.gguf", name, T.MXFP4)
    _one_line_error(capsys, 2, ["build", str(inplace), "-o", str(tmp_path / "out2"), "--quiet"],
                    rf"after {re.escape(name)} \(MXFP4 \[256\]: 136 bytes")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("tensor, ttype, match", [
    ("output_norm.weight", T.F16, "needs F32"),
    ("blk.0.ffn_gate_inp.weight", T.I32, "a float or quantized type"),
    ("token_embd.weight", T.I8, "a float or quantized type"),
])
def test_tensor_types_llama_cpp_cannot_run(synth_model, tmp_path, tensor, ttype, match):
    src = _rewrite_gguf(synth_model("qwen3moe"), tmp_path / "x.gguf", types={tensor: ttype})
    with pytest.raises(SourceError, match=rf"tensor {re.escape(tensor)} is {ttype.name}, .*{match}"):
        build(src, tmp_path / "out")


def test_type_whose_block_does_not_divide_the_row(synth_model, tmp_path):
    src = _retype_in_place(synth_model("qwen3moe"), tmp_path / "x.gguf", "blk.0.attn_q_norm.weight", T.Q4_K)
    with pytest.raises(SourceError, match=r"blk\.0\.attn_q_norm\.weight.*64 is not a multiple of the Q4_K block"):
        build(src, tmp_path / "out")


def test_tensor_types_are_llama_cpps_table():
    """llama_ops.TENSOR_OPS is what the vendored llama-arch.cpp says (regenerate it with parse_llama_arch)."""
    from ggml_expert_pack.packer import llama_ops
    arch = (Path(__file__).resolve().parent.parent / "vendor" / "upstream" / "llama_cpp_python-0.3.36" / "vendor" /
            "llama.cpp" / "src" / "llama-arch.cpp")
    if not arch.exists():
        pytest.skip("the vendored tree is not unpacked")
    assert llama_ops.parse_llama_arch(arch.read_text()) == llama_ops.TENSOR_OPS
    models = {p.stem: p.read_text() for p in (arch.parent / "models").glob("*.cpp")}
    assert set(llama_ops.parse_rope_full_head(arch.read_text(), models)) == llama_ops.ROPE_FULL_HEAD
    assert "qwen3moe" in llama_ops.ROPE_FULL_HEAD and "deepseek4" not in llama_ops.ROPE_FULL_HEAD
    assert llama_ops.ops_for("blk.3.attn_norm.weight") == ["MUL"]
    assert llama_ops.ops_for("blk.3.ffn_up_exps.bias") == ["ADD"]
    assert llama_ops.allowed_types("something.new", 1) == {T.F32}
    assert llama_ops.allowed_types("something.new", 2) is None


@pytest.mark.parametrize("key, kv, match", [
    ("qwen3moe.expert_count", kv_u32("qwen3moe.expert_count", 0), r"qwen3moe\.expert_count is 0"),
    ("qwen3moe.expert_used_count", kv_u32("qwen3moe.expert_used_count", 0), r"expert_used_count is 0"),
    ("qwen3moe.expert_used_count", kv_u32("qwen3moe.expert_used_count", 17), r"expert_used_count is 17, expected 1\.\.16"),
    ("qwen3moe.expert_used_count", kv_str("qwen3moe.expert_used_count", "4"), r"expert_used_count has type string"),
    ("qwen3moe.expert_used_count", None, r"expert_used_count is missing"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", kv_f32("qwen3moe.attention.layer_norm_rms_epsilon", float("-inf")),
     r"layer_norm_rms_epsilon is -inf: not a finite number"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", kv_f32("qwen3moe.attention.layer_norm_rms_epsilon", float("nan")),
     r"not a finite number"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", kv_f32("qwen3moe.attention.layer_norm_rms_epsilon", 0.0),
     r"layer_norm_rms_epsilon is 0\.0, expected a positive number"),
    ("qwen3moe.rope.freq_base", kv_f32("qwen3moe.rope.freq_base", -1.0), r"freq_base is -1\.0"),
    ("qwen3moe.block_count", kv_u32("qwen3moe.block_count", 0), r"block_count is 0"),
    ("qwen3moe.block_count", kv_u32("qwen3moe.block_count", 2), r"blk\.2 holds routed experts but qwen3moe\.block_count is 2"),
    ("qwen3moe.context_length", kv_u32("qwen3moe.context_length", 0), r"context_length is 0"),
    ("qwen3moe.embedding_length", kv_u32("qwen3moe.embedding_length", 128), r"experts take 256 inputs"),
    ("qwen3moe.attention.head_count_kv", kv_u32("qwen3moe.attention.head_count_kv", 3), r"head_count_kv is 3"),
    ("general.alignment", kv_u32("general.alignment", 48), r"general\.alignment must be a power of two"),
    # qwen3moe's graph asserts that the whole head is rotated: stock llama.cpp aborts at the first decode
    ("qwen3moe.rope.dimension_count", kv_u32("qwen3moe.rope.dimension_count", 32),
     r"rope\.dimension_count 32 must be equal"),
    ("qwen3moe.attention.head_count_kv", kv_u32("qwen3moe.attention.head_count_kv", 0), r"head_count_kv is 0"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", None, r"layer_norm_rms_epsilon is missing"),
    ("qwen3moe.expert_feed_forward_length", None, r"experts are 256 wide, but .*expert_feed_forward_length is missing"),
    ("qwen3moe.context_length", kv_u32("qwen3moe.context_length", 2**31), r"context_length is 2147483648"),
    ("tokenizer.ggml.eos_token_id", kv_f32("tokenizer.ggml.eos_token_id", 1.0), r"eos_token_id has type float32"),
])
def test_hyperparameters_out_of_range(synth_model, tmp_path, capsys, key, kv, match):
    src = _rewrite_gguf(synth_model("qwen3moe"), tmp_path / "x.gguf", kvs={key: kv})
    with pytest.raises(SourceError, match=match):
        build(src, tmp_path / "out")
    _one_line_error(capsys, 2, ["build", str(src), "-o", str(tmp_path / "out"), "--quiet"], match)
    _assert_nothing_written(tmp_path / "out")


def _reseal_trunk(pack: Path) -> None:
    """Record a replaced trunk in the manifest (size, checksums) and the new manifest digest in the pack header, as
    a build would: the pack is then consistent, and only what is inside the trunk can be wrong."""
    from ggml_expert_pack.packer.format import PackHeader, manifest_digest
    m = json.loads((pack / MANIFEST_FILE).read_text())
    data = (pack / TRUNK_FILE).read_bytes()
    head = read_header(pack / TRUNK_FILE).data_offset
    m["trunk"].update(size=len(data), checksum=xxh3_128(data).hex(), header_size=head,
                      header_checksum=xxh3_128(data[:head]).hex())
    m["manifest_digest"] = manifest_digest(m)
    (pack / MANIFEST_FILE).write_text(json.dumps(m))
    with open(pack / PACK_FILE, "r+b") as f:
        h = PackHeader.unpack(f.read(HEADER_SIZE))
        h.manifest_digest = bytes.fromhex(m["manifest_digest"])
        f.seek(0)
        f.write(h.pack())


@pytest.mark.parametrize("key, kv, match", [
    ("qwen3moe.expert_count", kv_u32("qwen3moe.expert_count", 0), r"expert_count is 0"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", kv_f32("qwen3moe.attention.layer_norm_rms_epsilon", float("-inf")),
     r"layer_norm_rms_epsilon is -inf"),
])
def test_trunk_hyperparameters_are_checked_by_verify(packs, tmp_path, key, kv, match):
    """A trunk whose expert_count is 0 or whose epsilon is -inf made llama.cpp abort at load: verify --quick
    refuses it, also when the manifest was rewritten to match the trunk."""
    pack = _copy_pack(packs("qwen3moe")[1], tmp_path)
    _rewrite_gguf(packs("qwen3moe")[1] / TRUNK_FILE, pack / TRUNK_FILE, kvs={key: kv})
    with pytest.raises(VerifyError, match="trunk.gguf"):
        verify(pack, quick=True)
    _reseal_trunk(pack)
    with pytest.raises(VerifyError, match=rf"trunk.gguf: .*{match}"):
        verify(pack, quick=True)


def test_progress_bar_units_match_its_counts(monkeypatch):
    """The bar said MB/s while counting MiB: its units are decimal now, as tqdm labels them."""
    import io
    from ggml_expert_pack.progress import Progress
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    bar = Progress(10_000_000, "pack", True)
    bar.update(5_000_000)
    bar.bar.refresh()
    bar.close()
    assert "5.00M/10.0M" in buf.getvalue(), buf.getvalue()  # with 1024 it read 4.77M/9.54M


def test_interrupted_build_leaves_no_folder(synth_model, tmp_path, monkeypatch):
    b = importlib.import_module("ggml_expert_pack.packer.build")
    real = b._pack_layer

    def dies(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(b, "_pack_layer", dies)
    out = tmp_path / "new" / "out.pack"
    with pytest.raises(KeyboardInterrupt):
        build(synth_model("qwen3moe"), out)
    assert not out.exists() and not out.parent.exists()
    # a folder that existed stays
    out.mkdir(parents=True)
    with pytest.raises(KeyboardInterrupt):
        build(synth_model("qwen3moe"), out)
    assert out.is_dir() and not any(out.iterdir())
    monkeypatch.setattr(b, "_pack_layer", real)


def test_failed_forced_rebuild_keeps_the_old_pack(packs, tmp_path, monkeypatch):
    src, pack = packs("qwen3moe")
    dst = _copy_pack(pack, tmp_path)
    b = importlib.import_module("ggml_expert_pack.packer.build")

    def dies(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(b, "_pack_layer", dies)
    with pytest.raises(OSError):
        build(src, dst, force=True)
    verify(dst)  # the old pack, intact


def test_inspect_shows_top_k_and_cache_sizes(packs, capsys):
    pack = packs("qwen3moe")[1]
    assert cli(["inspect", str(pack), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["n_expert_used"] == 4
    c = s["cache"]
    assert c["suggested_slots"] == 8  # 16 experts, top-4: a quarter of them, and at least two tokens' worth
    assert c["minimum_bytes"] < c["suggested_bytes"] < c["all_resident_bytes"]
    assert cli(["inspect", str(pack)]) == 0
    text = capsys.readouterr().out
    assert "top-4 per token" in text and "expert cache  suggested" in text and "--cache-mib" in text


def test_inspect_minimum_cache_is_what_loading_needs(packs):
    """The minimum inspect prints is the provider's: a cache of it loads, 0.2 MiB less is refused."""
    from llama_cpp import Llama
    from ggml_expert_pack.packer.inspect import summary
    pack = packs("qwen3moe")[1]
    need = summary(pack)["cache"]["minimum_bytes"] / 2**20
    llm = Llama(model_path=str(pack / TRUNK_FILE), expert_pack={"pack_dir": str(pack), "cache_vram_mib": need + 0.05},
                n_ctx=64, verbose=False)
    llm.close()
    with pytest.raises(ValueError, match="expert cache too small"):
        Llama(model_path=str(pack / TRUNK_FILE), expert_pack={"pack_dir": str(pack), "cache_vram_mib": need - 0.2},
              n_ctx=64, verbose=False)


def test_bench_client_against_a_dead_server_writes_nothing(tmp_path, capsys):
    from expert_pack_devtools.bench_client import free_port
    out = tmp_path / "results"
    _one_line_error(capsys, 2, ["bench-client", f"http://127.0.0.1:{free_port()}", "--system", "x", "--out", str(out)],
                    r"cannot reach http://127\.0\.0\.1:\d+")
    assert not out.exists()
    _one_line_error(capsys, 2, ["bench-client", "localhost:8080", "--system", "x", "--out", str(out)],
                    "not an http:// or https:// URL")


def test_bench_plot_is_linear_from_zero_with_value_labels():
    pytest.importorskip("matplotlib")
    from expert_pack_devtools.bench_client import figure
    reports = [{"system": s, "summary": {"alpaca": {"prefill_tok_s": p, "decode_tok_s": d},
                                         "mmlu": {"prefill_tok_s": p, "decode_tok_s": d}}}
               for s, p, d in (("a", 800.0, 59.5), ("b", 810.0, 60.5))]
    fig = figure(reports)
    for ax in fig.axes:
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    labels = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {"59.5", "60.5", "800", "810"} <= labels


@pytest.mark.parametrize("argv, match", [
    (["build", "nope.gguf", "-o", "x"], "nope.gguf: no such file"),
    (["synth", "x.gguf", "--config", "nope.json"], "nope.json"),
    (["policy-sim", "nope.npz"], "nope.npz"),
    (["routing-stats", "nope.gguf"], "nope.gguf"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, monkeypatch, argv, match):
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, 2, argv, match)


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        cli(["--debug", "inspect", str(tmp_path / "nope")])


def test_repeated_token_strings_are_refused(tmp_path):
    """llama.cpp asserts that token strings are distinct (an empty one counts as [EMPTY_<id>]): the fuzz found a
    flipped byte in a token that made two equal, and the loader aborted."""
    from gguf import GGUFValueType
    from ggml_expert_pack.gguf_stream import kv_arr
    from ggml_expert_pack.packer.source import _check_tokens
    for tokens, match in ((["a", "b", "a"], r"tokens 0 and 2 are both 'a'"), (["[EMPTY_1]", ""], r"tokens 0 and 1")):
        p = _tiny_gguf(tmp_path / "v.gguf", [], extra_kvs=[kv_arr("tokenizer.ggml.tokens", GGUFValueType.STRING, tokens)])
        with pytest.raises(SourceError, match=match):
            _check_tokens(read_header(p))
    p = _tiny_gguf(tmp_path / "v.gguf", [], extra_kvs=[kv_arr("tokenizer.ggml.tokens", GGUFValueType.STRING, ["a", ""])])
    _check_tokens(read_header(p))
