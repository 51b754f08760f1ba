"""Machine-level pieces of a benchmark run: page cache, O_DIRECT and host-to-device bandwidth, the host-RAM cap (a
cgroup v2), and a server process inside it."""
from __future__ import annotations

import ctypes
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import bench_client
from ..proc import shown

CGROUP = Path("/sys/fs/cgroup")


# ---- page cache and bandwidths -------------------------------------------------------------------------------
def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def odirect_bandwidth(pack_dir: Path, n_blocks: int = 256, seed: int = 0) -> dict:
    """Random whole-expert reads from the pack with O_DIRECT, one thread (what a cache miss does)."""
    from ggml_expert_pack.packer.format import layers_from_manifest, load_manifest
    m = load_manifest(pack_dir)
    layers = layers_from_manifest(m)
    rng = random.Random(seed)
    size = max(l.read_bytes for l in layers)
    buf = mmap.mmap(-1, size)
    fd = os.open(pack_dir / m["pack"]["file"], os.O_RDONLY | os.O_DIRECT)
    try:
        total, t0 = 0, time.perf_counter()
        for _ in range(n_blocks):
            l = rng.choice(layers)
            e = rng.randrange(m["n_experts"])
            total += os.preadv(fd, [memoryview(buf)[:l.read_bytes]], l.expert_offset(e))
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"bytes": total, "seconds": dt, "bytes_per_s": total / dt, "block_bytes": size}


def h2d_bandwidth(mib: int = 256, reps: int = 8) -> dict | None:
    """Pinned and pageable host-to-device copy bandwidth through the CUDA runtime (ctypes), or None."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    n = mib << 20
    dev, pinned = ctypes.c_void_p(), ctypes.c_void_p()
    if rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(n)) or rt.cudaMallocHost(ctypes.byref(pinned), ctypes.c_size_t(n)):
        return None
    pageable = ctypes.create_string_buffer(n)
    out = {}
    for label, src in (("pinned", pinned), ("pageable", ctypes.cast(pageable, ctypes.c_void_p))):
        rt.cudaMemcpy(dev, src, ctypes.c_size_t(n), 1)  # warm-up; 1 = cudaMemcpyHostToDevice
        rt.cudaDeviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            rt.cudaMemcpy(dev, src, ctypes.c_size_t(n), 1)
        rt.cudaDeviceSynchronize()
        out[f"{label}_bytes_per_s"] = reps * n / (time.perf_counter() - t0)
    rt.cudaFree(dev)
    rt.cudaFreeHost(pinned)
    return out


# ---- cgroup (host-RAM cap) -----------------------------------------------------------------------------------
def make_cgroup(name: str, max_bytes: int) -> Path | None:
    """A cgroup v2 with memory.max (page cache counts against it, swap off); None where cgroups are unavailable."""
    try:
        ctl = (CGROUP / "cgroup.subtree_control")
        if "memory" not in ctl.read_text().split():
            ctl.write_text("+memory")
        cg = CGROUP / name
        cg.mkdir(exist_ok=True)
        (cg / "memory.max").write_text(str(max_bytes))
        try:
            (cg / "memory.swap.max").write_text("0")
        except OSError:
            pass
        return cg
    except OSError as e:
        print(f"no cgroup v2 memory controller ({e}): running without the RAM cap", file=sys.stderr)
        return None


def cgroup_figures(cg: Path | None) -> dict:
    if cg is None:
        return {}
    out = {}
    for f in ("memory.peak", "memory.current", "memory.max"):
        try:
            out[f.replace(".", "_")] = (cg / f).read_text().strip()
        except OSError:
            pass
    try:
        stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines())
        out.update({f"stat_{k}": int(stat[k]) for k in ("anon", "file", "pgmajfault") if k in stat})
    except OSError:
        pass
    return out


# ---- servers -------------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class Server:
    def __init__(self, cmd: list[str], log: Path, cg: Path | None, timeout_s: float = 600):
        self.port = bench_client.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.log = open(log, "w")
        print("$", shown(cmd), flush=True)

        def enter_cgroup():
            os.setsid()
            if cg is not None:
                (cg / "cgroup.procs").write_text(str(os.getpid()))
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=enter_cgroup)
        if not bench_client.wait_healthy(self.base, self.proc, timeout_s):
            self.stop()
            raise RuntimeError(f"server did not start (exit {self.proc.returncode}); log: {log}")
        self.load_s = time.time() - t0

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
