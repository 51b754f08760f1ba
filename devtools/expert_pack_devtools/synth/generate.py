"""Write a synthetic model as GGUF (one file or llama.cpp split shards), streaming: tensors are generated in
worker threads a few ahead of the writer and never all held in memory."""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from ggml_expert_pack.gguf_file import RawKV, read_header
from ggml_expert_pack.gguf_stream import KV, GGUFStreamWriter, TensorInfo, fsync_path, kv_i32, kv_u16, split_path
from ggml_expert_pack.progress import Progress

from .archs import ARCH_KVS, ARCH_TENSORS, TensorSpec
from .config import SynthConfig
from .weights import WeightFactory

VOCAB_NAME = "ggml-vocab-qwen2.gguf"


def default_vocab() -> Path:
    """The vocab GGUF the wheel ships (copied from the vendored llama.cpp's models/ by the build); in a
    source checkout, the one in the prepared upstream tree."""
    import ggml_expert_pack
    pkg = Path(ggml_expert_pack.__file__).parent  # the installed package's data/ (the build puts it there)
    checkout = Path(__file__).resolve().parents[3]  # devtools/expert_pack_devtools/synth/generate.py -> the repository root
    for p in (pkg / "data" / VOCAB_NAME,
              *sorted((checkout / "vendor" / "upstream").glob(f"*/vendor/llama.cpp/models/{VOCAB_NAME}"))):
        if p.exists():
            return p
    raise FileNotFoundError(f"{VOCAB_NAME} not found (neither packaged nor in vendor/upstream/)")


def vocab_kvs(path: str | Path) -> tuple[list[RawKV], int]:
    """The tokenizer.* metadata of a vocab GGUF, and its vocabulary size."""
    path = Path(path) if path else default_vocab()
    if not path.exists():
        raise FileNotFoundError(f"vocab GGUF not found: {path}")
    return _vocab_kvs(path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _vocab_kvs(path: Path, mtime_ns: int) -> tuple[list[RawKV], int]:
    header = read_header(path)
    tokens = header.kvs.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens")
    return [kv for k, kv in header.kvs.items() if k.startswith("tokenizer.")], tokens.n_items


def plan(cfg: SynthConfig) -> tuple[list[KV | RawKV], list[TensorSpec], int]:
    """(metadata, tensors, n_vocab) of the model `cfg` describes."""
    tok_kvs, n_vocab = vocab_kvs(cfg.vocab)
    kvs = ARCH_KVS[cfg.arch](cfg) + tok_kvs
    return kvs, ARCH_TENSORS[cfg.arch](cfg, n_vocab), n_vocab


def _split(specs: list[TensorSpec], n: int) -> list[list[TensorSpec]]:
    """n contiguous groups of roughly equal bytes (llama.cpp's gguf-split keeps tensor order too)."""
    if n <= 1:
        return [specs]
    if n > len(specs):
        raise ValueError(f"cannot split {len(specs)} tensors into {n} shards")
    starts = np.cumsum([0] + [TensorInfo(s.name, s.shape, s.type).nbytes for s in specs])[:-1]
    total = starts[-1] + TensorInfo(specs[-1].name, specs[-1].shape, specs[-1].type).nbytes
    cuts = [0]
    for j in range(1, n):
        c = int(np.searchsorted(starts, total * j / n))
        cuts.append(min(max(c, cuts[-1] + 1), len(specs) - (n - j)))  # every shard gets >= 1 tensor
    cuts.append(len(specs))
    return [specs[cuts[j]:cuts[j + 1]] for j in range(n)]


def generate(cfg: SynthConfig, out: str | Path, shards: int = 1, progress: bool | None = None,
             log: Callable[[str], None] | None = None) -> list[Path]:
    """Write the model; returns the file(s). `out` is a .gguf path; with shards > 1 the files are
    OUT-00001-of-0000N.gguf (pass the first to llama.cpp). Files appear only when complete."""
    out = Path(out)
    kvs, specs, n_vocab = plan(cfg)
    groups = _split(specs, shards)
    n = len(groups)
    if n == 1:
        paths = [out]
    else:
        stem = str(out)[:-5] if str(out).endswith(".gguf") else str(out)
        paths = [split_path(stem, i, n) for i in range(n)]
    out.parent.mkdir(parents=True, exist_ok=True)

    writers = []
    for i, (p, g) in enumerate(zip(paths, groups)):
        infos = [TensorInfo(s.name, s.shape, s.type) for s in g]
        if n == 1:
            shard_kvs = kvs
        else:
            split = [kv_u16("split.no", i), kv_u16("split.count", n), kv_i32("split.tensors.count", len(specs))]
            shard_kvs = (kvs + split) if i == 0 else split
        writers.append(GGUFStreamWriter(p, shard_kvs, infos))

    total = sum(w.data_size for w in writers)
    bar = Progress(total, f"synth {cfg.arch}", progress)
    factory = WeightFactory(cfg, n_vocab)
    tmp_paths = [p.with_name(p.name + f".tmp-{os.getpid()}") for p in paths]

    def materialize(spec: TensorSpec) -> list[np.ndarray]:
        return list(factory.chunks(spec))

    try:
        # routers are sequential (layer-correlated): build them before the worker threads start
        factory.routers()
        workers = min(8, os.cpu_count() or 2)
        with ThreadPoolExecutor(workers) as pool:
            for w, g, tmp in zip(writers, groups, tmp_paths):
                with open(tmp, "wb", buffering=16 << 20) as f:
                    w.begin(f)
                    # bounded look-ahead: at most `workers` tensors in flight
                    pending = []
                    it = iter(g)
                    for spec in it:
                        pending.append(pool.submit(materialize, spec))
                        if len(pending) >= workers:
                            break
                    for spec in it:
                        bar.update(w.write_tensor_data(pending.pop(0).result()))
                        pending.append(pool.submit(materialize, spec))
                    for fut in pending:
                        bar.update(w.write_tensor_data(fut.result()))
                    w.end()
                    f.flush()
                    os.fsync(f.fileno())
        for tmp, p in zip(tmp_paths, paths):
            os.replace(tmp, p)
        fsync_path(out.parent)
    except BaseException:
        for tmp in tmp_paths:
            tmp.unlink(missing_ok=True)
        raise
    rate = bar.close()
    if log:
        log(f"wrote {', '.join(str(p) for p in paths)}: {total / 2**20:.1f} MiB at {rate / 2**20:.0f} MiB/s")
    return paths
