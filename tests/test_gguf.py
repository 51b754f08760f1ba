"""Our streaming GGUF writer and fast header reader agree with each other and with gguf-py's reader."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType

from ggml_expert_pack.gguf_file import GGUFFormatError, read_header
from ggml_expert_pack.gguf_stream import GGUFStreamWriter, TensorInfo, kv_arr, kv_bool, kv_f32, kv_str, kv_u32


def test_roundtrip(tmp_path):
    kvs = [kv_str("general.architecture", "qwen3moe"), kv_u32("a.u", 7), kv_f32("a.f", 0.5), kv_bool("a.b", True),
           kv_arr("a.arr", GGUFValueType.INT32, [1, -2, 3]), kv_arr("a.strs", GGUFValueType.STRING, ["x", "yz"])]
    infos = [TensorInfo("t0", (256, 3), T.Q4_K), TensorInfo("t1", (5,), T.F32)]
    data = [np.arange(infos[0].nbytes, dtype=np.uint32).astype(np.uint8), np.arange(5, dtype=np.float32)]
    w = GGUFStreamWriter(tmp_path / "m.gguf", kvs, infos, alignment=64)
    with open(tmp_path / "m.gguf", "wb") as f:
        w.begin(f)
        for d in data:
            w.write_tensor_data([d])
        w.end()
    h = read_header(tmp_path / "m.gguf")
    assert h.alignment == 64 and h.data_offset % 64 == 0
    assert h.get("a.u") == 7 and h.get("a.f") == 0.5 and h.get("a.b") is True
    assert h.get("a.arr") == [1, -2, 3] and h.get("a.strs") == ["x", "yz"]
    assert [(t.name, t.shape, t.type) for t in h.tensors] == [(i.name, i.shape, i.type) for i in infos]
    r = GGUFReader(tmp_path / "m.gguf")
    for t, d in zip(h.tensors, data):
        rt = next(x for x in r.tensors if x.name == t.name)
        assert rt.data_offset == t.offset
        assert bytes(rt.data.tobytes()) == d.tobytes()
    # raw KVs copy verbatim
    w2 = GGUFStreamWriter(tmp_path / "c.gguf", list(h.kvs.values()), [])
    with open(tmp_path / "c.gguf", "wb") as f:
        w2.begin(f)
    h2 = read_header(tmp_path / "c.gguf")
    assert {k: v.value for k, v in h2.kvs.items()} == {k: v.value for k, v in h.kvs.items()}


def test_wrong_size_is_refused(tmp_path):
    w = GGUFStreamWriter(tmp_path / "m.gguf", [], [TensorInfo("t", (4,), T.F32)])
    with open(tmp_path / "m.gguf", "wb") as f:
        w.begin(f)
        with pytest.raises(RuntimeError, match="wrote 8 bytes, expected 16"):
            w.write_tensor_data([b"\0" * 8])


@pytest.mark.parametrize("content, match", [(b"", "not a GGUF"), (b"GGML\3\0\0\0", "not a GGUF"),
                                            (b"GGUF\3\0\0\0" + b"\1" * 7, "truncated")])
def test_bad_files(tmp_path, content, match):
    (tmp_path / "x.gguf").write_bytes(content)
    with pytest.raises(GGUFFormatError, match=match):
        read_header(tmp_path / "x.gguf")
