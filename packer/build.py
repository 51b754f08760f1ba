"""`expert-pack build`: GGUF -> expert pack + manifest + trunk GGUF, in one sequential pass over the source.

I/O: bytes move with copy_file_range, in the kernel, as `cp` does (a read/write loop through user space
measured 2-3x slower on our VMs): every role tensor is read front to back and each expert's slice lands at
its block's 4096-aligned offset; trunk tensors are copied at their GGUF offsets. Checksums are computed by
worker threads from the pack's pages (still in the page cache) while the next layer is copied.

Safety: a free-space check up front (numbers in the message), everything written under temporary names,
fsynced, and renamed into place at the end; the pack header -- what makes a pack valid -- is written
last, and the manifest is renamed last. An interrupted build leaves only *.partial files, which the next
build removes, and removes the output folder again if it created it. With --force the old pack stays until
the new one is complete, unless the disk has no room for both.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .. import __version__
from ..gguf_stream import GGUFStreamWriter, TensorInfo, fsync_path, kv_str
from ..progress import Progress
from .format import (ALIGNMENT, CHECKSUM_ALGO, FLAG_UNIFORM_STRIDE, HEADER_SIZE, MANIFEST_FILE, PACK_FILE,
                     TRUNK_FILE, TRUNK_KV_PACK_ID, TRUNK_KV_SOURCE, VERSION, LayerLayout, PackHeader,
                     layout_identity, manifest_digest, pack_id, plan_block, plan_layers, xxh3_hex)
from .source import Source, describe, open_source

PARTIAL = ".partial"
CHUNK_BYTES = 64 << 20
SPACE_MARGIN = 16 << 20


class BuildError(RuntimeError):
    pass


@dataclass
class BuildResult:
    pack_dir: Path
    pack_id: str
    pack_bytes: int
    trunk_bytes: int
    source_bytes: int
    seconds: float
    uniform_stride: bool

    @property
    def rate(self) -> float:
        """Source bytes read per second."""
        return self.source_bytes / max(self.seconds, 1e-9)


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    view, done = memoryview(buf), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise BuildError(f"unexpected end of file at offset {offset + done} (source truncated?)")
        done += n


def _pwrite_all(fd: int, buf, offset: int) -> None:
    view, done = memoryview(buf), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def existing_pack_files(out_dir: Path) -> list[Path]:
    return [out_dir / f for f in (PACK_FILE, TRUNK_FILE, MANIFEST_FILE) if (out_dir / f).exists()]


def plan(src: Source, force_uniform: bool | None = None) -> tuple[list[LayerLayout], bool]:
    blocks = []
    for layer in sorted(src.experts):
        roles = [(role, t.name, t.entry.type, t.entry.shape) for role, t in src.experts[layer].items()]
        laid, block_bytes = plan_block(roles)
        blocks.append((layer, laid, block_bytes))
    return plan_layers(blocks, src.n_experts, force_uniform=force_uniform)


class _Files:
    """Open source shards, by index."""

    def __init__(self, src: Source):
        self.fds = [os.open(p, os.O_RDONLY) for p in src.paths]
        for fd in self.fds:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def build(model: str | Path, out_dir: str | Path, force: bool = False, progress: bool | None = None,
          log: Callable[[str], None] | None = None, force_uniform: bool | None = None) -> BuildResult:
    log = log or (lambda m: None)
    t0 = time.time()
    src = open_source(model)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BuildError(f"{out} exists and is not a directory")
    # the folders this build creates go again if it fails: an interrupted build leaves nothing behind
    created = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _build(src, out, force, progress, log, force_uniform, t0)
    except BaseException:
        for p in created:  # deepest first; only if empty (another process may have put something there)
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _build(src: Source, out: Path, force: bool, progress: bool | None, log: Callable[[str], None],
           force_uniform: bool | None, t0: float) -> BuildResult:
    for stale in out.glob(f".*{PARTIAL}"):
        stale.unlink()
    existing = existing_pack_files(out)
    if existing and not force:
        raise BuildError(f"{out} already holds an expert pack ({', '.join(p.name for p in existing)}); "
                         f"pass --force to replace it")
    log(f"source: {describe(src)}")

    layers, uniform = plan(src, force_uniform)
    n_exp = src.n_experts
    data_size = sum(l.expert_stride for l in layers) * n_exp
    pack_size = HEADER_SIZE + data_size
    fp = src.fingerprint()
    pid = pack_id(layout_identity(fp, n_exp, layers))

    expert_names = {t.name for roles in src.experts.values() for t in roles.values()}
    trunk_tensors = [t for t in src.tensors if t.name not in expert_names]
    trunk_kvs = [kv for k, kv in src.meta.kvs.items() if not k.startswith("split.") and not k.startswith("expert_pack.")]
    trunk_kvs += [kv_str(TRUNK_KV_PACK_ID, pid), kv_str(TRUNK_KV_SOURCE, fp)]
    trunk = GGUFStreamWriter(out / TRUNK_FILE, trunk_kvs,
                             [TensorInfo(t.name, t.entry.shape, t.entry.type) for t in trunk_tensors],
                             alignment=src.meta.alignment)
    trunk_size = trunk.total_size

    free = shutil.disk_usage(out).free
    need = pack_size + trunk_size + SPACE_MARGIN
    if existing and free < need:
        # --force without room for both: the old pack makes the room (otherwise it stays until the new one is
        # complete, so that a failed rebuild loses nothing)
        old = sum(p.stat().st_size for p in existing)
        if free + old >= need:
            log(f"removing the old pack in {out} first: no room for both ({_fmt(free)} free)")
            for p in existing:
                p.unlink()
            free = shutil.disk_usage(out).free
    if free < need:
        raise BuildError(f"not enough space in {out}: need {_fmt(need)} (pack {_fmt(pack_size)} + trunk "
                         f"{_fmt(trunk_size)}), {_fmt(free)} free")

    pack_tmp, trunk_tmp, man_tmp = (out / f".{n}{PARTIAL}" for n in (PACK_FILE, TRUNK_FILE, MANIFEST_FILE))
    source_bytes = src.total_bytes
    bar = Progress(source_bytes, "pack", progress)
    files = _Files(src)
    try:
        pack_fd = os.open(pack_tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        trunk_fd = os.open(trunk_tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # sparse files of the final size (not posix_fallocate: on ext4, writing into its unwritten extents
            # measured ~40% slower; the space check above guards against running out)
            os.ftruncate(pack_fd, pack_size)
            os.ftruncate(trunk_fd, trunk_size)
            pack_map = np.memmap(pack_tmp, dtype=np.uint8, mode="r")
            trunk_header = trunk.header_bytes()
            _pwrite_all(trunk_fd, trunk_header, 0)
            trunk_offsets = dict(zip((t.name for t in trunk_tensors), trunk.offsets))
            by_layer = {l.layer: l for l in layers}
            hashes: dict[int, Future] = {}
            with ThreadPoolExecutor(2) as hasher:  # checksums of finished layers overlap the copying
                for t in src.tensors:  # source file order: one sequential pass
                    if t.name in expert_names:
                        layer = int(t.name.split(".")[1])
                        if layer not in hashes:
                            _pack_layer(src, files, by_layer[layer], pack_fd, bar)
                            hashes[layer] = hasher.submit(_hash_layer, pack_map, by_layer[layer], n_exp)
                    else:
                        _copy_range(files.fds[t.shard], t.entry.offset, trunk_fd,
                                    len(trunk_header) + trunk_offsets[t.name], t.entry.nbytes)
                        bar.update(t.entry.nbytes)
                checksums = {layer: f.result() for layer, f in hashes.items()}
                trunk_sum = hasher.submit(_file_checksum, trunk_fd, trunk_size).result()
            del pack_map
            manifest = _manifest(src, layers, uniform, pid, fp, pack_size, data_size, checksums, trunk_size,
                                 trunk_sum, len(trunk_tensors), len(trunk_header), xxh3_hex(trunk_header))
            header = PackHeader(n_layers=len(layers), n_experts=n_exp,
                                flags=FLAG_UNIFORM_STRIDE if uniform else 0, data_start=HEADER_SIZE,
                                data_size=data_size, expert_stride=layers[0].expert_stride if uniform else 0,
                                pack_id=bytes.fromhex(pid), manifest_digest=bytes.fromhex(manifest["manifest_digest"]),
                                source_fingerprint=bytes.fromhex(fp))
            os.fsync(trunk_fd)
            os.fsync(pack_fd)
            _pwrite_all(pack_fd, header.pack(), 0)  # last: until now the pack is not valid
            os.fsync(pack_fd)
        finally:
            os.close(pack_fd)
            os.close(trunk_fd)
        with open(man_tmp, "w") as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pack_tmp, out / PACK_FILE)
        os.replace(trunk_tmp, out / TRUNK_FILE)
        os.replace(man_tmp, out / MANIFEST_FILE)  # the manifest appears last
        fsync_path(out)
    except BaseException:
        for p in (pack_tmp, trunk_tmp, man_tmp):
            p.unlink(missing_ok=True)
        raise
    finally:
        files.close()
    bar.close()
    dt = time.time() - t0
    res = BuildResult(out, pid, pack_size, trunk_size, source_bytes, dt, uniform)
    log(f"wrote {out}: pack {_fmt(pack_size)} ({len(layers)} layers x {n_exp} experts, "
        f"{'one stride' if uniform else 'per-layer strides'}), trunk {_fmt(trunk_size)}; "
        f"{_fmt(source_bytes)} read in {dt:.1f} s ({_fmt(res.rate)}/s)")
    return res


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    """Copy n bytes between files in the kernel (copy_file_range: no trip through user space, what cp does);
    pread/pwrite where the kernel or filesystem cannot."""
    while n > 0:
        try:
            k = os.copy_file_range(src_fd, dst_fd, n, src_off, dst_off)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                raise
            buf = np.empty(min(n, CHUNK_BYTES), dtype=np.uint8)
            while n > 0:
                k = min(n, len(buf))
                _pread_into(src_fd, buf[:k], src_off)
                _pwrite_all(dst_fd, buf[:k], dst_off)
                src_off, dst_off, n = src_off + k, dst_off + k, n - k
            return
        if k == 0:
            raise BuildError(f"unexpected end of the source at offset {src_off} (truncated?)")
        src_off, dst_off, n = src_off + k, dst_off + k, n - k


def _pack_layer(src: Source, files: _Files, layer: LayerLayout, pack_fd: int, bar: Progress) -> None:
    """Copy every expert of a layer into its block, role by role: each role is one source tensor read
    front to back (sequential for readahead); writes land at the blocks' offsets in the page cache."""
    for r in layer.roles:
        t = src.experts[layer.layer][r.role]
        fd = files.fds[t.shard]
        for e in range(src.n_experts):
            _copy_range(fd, t.entry.offset + e * r.bytes, pack_fd, layer.expert_offset(e) + r.offset, r.bytes)
        bar.update(r.bytes * src.n_experts)


def _hash_layer(pack_map: np.ndarray, layer: LayerLayout, n_experts: int) -> list[str]:
    """Block checksums, read back from the pack (page cache): gaps are holes, so they hash as zeros."""
    from ..pybind import xxh3_128
    return [xxh3_128(pack_map[layer.expert_offset(e):layer.expert_offset(e) + layer.block_bytes]).hex()
            for e in range(n_experts)]


def _file_checksum(fd: int, size: int) -> str:
    from ..pybind import Hasher
    h = Hasher()
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        for off in range(0, size, CHUNK_BYTES):
            h.update(view[off:off + CHUNK_BYTES])
        del view
    return h.digest().hex()


def _manifest(src: Source, layers: list[LayerLayout], uniform: bool, pid: str, fp: str, pack_size: int,
              data_size: int, checksums: dict[int, list[str]], trunk_size: int, trunk_checksum: str,
              n_trunk: int, trunk_header_size: int, trunk_header_checksum: str) -> dict:
    m = {
        "format": "expert-pack", "version": VERSION, "pack_id": pid, "created_by": f"expert-pack {__version__}",
        "source": {"fingerprint": fp, "arch": src.arch, "name": src.meta.get("general.name", ""),
                   "files": [p.name for p in src.paths], "sizes": [h_.file_size for h_ in src.headers],
                   "tensor_names": [t.name for t in src.tensors]},
        "pack": {"file": PACK_FILE, "size": pack_size, "header_size": HEADER_SIZE, "data_start": HEADER_SIZE,
                 "data_size": data_size, "alignment": ALIGNMENT, "uniform_stride": uniform,
                 "expert_stride": layers[0].expert_stride if uniform else 0, "checksum": CHECKSUM_ALGO},
        # header_checksum covers the trunk's header and KV region ([0, header_size)): what loading checks cheaply
        "trunk": {"file": TRUNK_FILE, "size": trunk_size, "checksum": trunk_checksum, "n_tensors": n_trunk,
                  "header_size": trunk_header_size, "header_checksum": trunk_header_checksum},
        "n_experts": src.n_experts,
        "layers": [dict(l.to_json(), checksums=checksums[l.layer]) for l in layers],
    }
    m["manifest_digest"] = manifest_digest(m)
    return m
