"""The host-RAM tier and concurrent miss reads. The tier is a pool of whole expert blocks in host
memory between the pack and the device cache. With it the logits stay bit-identical to stock llama.cpp, every
device-cache miss is a RAM hit or a pack read, a tier that holds everything serves a second run without
touching the pack, an I/O error fails only the request it hits, and bad sizes are refused naming the key; the
same holds with read_threads > 1."""
from __future__ import annotations

import numpy as np
import pytest

from expert_pack_devtools.lossless import Session, cache_mib_for_slots, ram_mib_for_blocks, run
from ggml_expert_pack.packer.format import TRUNK_FILE, layers_from_manifest, load_manifest
from ggml_expert_pack.pybind.provider import Provider, normalize_config

K = 4  # experts per token in the tiny models (4 MoE layers of 16 experts: 64 keys)
MIXED = dict(expert_type="q4_k", expert_types={"down": "q8_0"},
             layer_expert_types={"1": "q2_k", "2": "f16", "3": {"gate": "q3_k", "up": "q3_k"}})


def _provider(pack, slots, ram_blocks, **kw):
    return Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, slots), cache_vram_reserve_mib=0,
                         ram_cache_mib=ram_mib_for_blocks(pack, ram_blocks), **kw)


def _decode(src, p, n_decode):
    """Run src with provider p (closed afterwards); return p's counters and stats file."""
    try:
        run(src, p, n_ubatch=256, n_decode=n_decode)
        return p.counters(), p.stats()
    finally:
        p.close()


def _decode_like_stock(stock, src, p, n_decode):
    """Run src with provider p (closed afterwards) and without a pack (the run's shared reference, conftest.py);
    assert bit-identical tokens and logits; return p's counters."""
    try:
        got = run(src, p, n_ubatch=256, n_decode=n_decode)
        c = p.counters()
    finally:
        p.close()
    ref = stock.run(src, n_ubatch=256, n_decode=n_decode)
    assert got.error == 0 and got.tokens == ref.tokens
    assert np.array_equal(got.logits, ref.logits), f"max |diff| {np.abs(got.logits - ref.logits).max()}"
    return c


def _eio_fails_the_request_then_recovers(stock, src, pack, p, check_failure=None):
    """Generate with p, make the disk fail after 2 more block reads: the request fails at a step that needed the
    disk, every token produced before equals stock's; readable again, the next request is stock's. p is closed.
    check_failure(p, counters_before_the_fault) adds the caller's checks at the failure."""
    prompt = [(i * 7919) % 1000 + 100 for i in range(8)]
    want, rc = stock.generate(src, prompt, 24, n_gpu_layers=0)
    assert rc == 0
    s = Session(pack / TRUNK_FILE, p, n_gpu_layers=0)
    try:
        got, rc = s.generate(prompt, 6)
        assert rc == 0 and got == want[:6]
        before = p.counters()
        p.inject_eio(2)                           # the disk fails after 2 more block reads
        while rc == 0 and len(got) < 24:
            got.append(int(np.argmax(s.logits())))
            rc = s.decode([got[-1]])
        assert rc != 0 and len(got) < 24          # the request fails at a step that needed the disk
        assert got == want[:len(got)]             # every token produced came from complete data
        assert "Input/output error" in p.last_error
        c = p.counters()
        assert c["cache_misses"] == c["ram_hits"] + c["ram_misses"]
        if check_failure:
            check_failure(c, before)
        p.inject_eio(-1)                          # readable again: the next request is served, and no block
        s.reset()                                 # that a failed read was meant to fill is used
        again, rc = s.generate(prompt, 24)
        assert rc == 0 and again == want
    finally:
        s.close()
        p.close()


# 5 blocks: fewer than the misses of one round (up to 9), so the misses go through the tier in groups;
# 24 blocks: more than a step needs, less than the 64 keys, so the tier evicts too
@pytest.mark.parametrize("ram_blocks", [5, 24], ids=["grouped", "evicting"])
@pytest.mark.parametrize("kind", ["q4_k", "mixed"])
def test_lossless_with_ram_tier(packs, stock, kind, ram_blocks):
    src, pack = packs("qwen3moe", **(MIXED if kind == "mixed" else {}))
    p = _provider(pack, 2 * K + 1, ram_blocks)
    try:
        got = run(src, p, record_routing=True, n_ubatch=256)
        c = p.counters()
        s = p.stats()
    finally:
        p.close()
    ref = stock.run(src, n_ubatch=256)
    assert got.error == 0 and got.tokens == ref.tokens
    assert np.array_equal(got.logits, ref.logits), f"max |diff| {np.abs(got.logits - ref.logits).max()}"

    m = load_manifest(pack)
    layers = layers_from_manifest(m)
    assert c["io_errors"] == 0
    keys = sum(len(np.unique(ids)) for step in got.routing for ids in step.values())
    assert c["cache_hits"] + c["cache_misses"] == keys
    # every device-cache miss came from the RAM tier or from the pack, never both
    assert c["cache_misses"] == c["ram_hits"] + c["ram_misses"]
    assert c["ram_evictions"] > 0
    if ram_blocks > 2 * K + 1:  # a tier larger than the device cache serves some of its misses
        assert c["ram_hits"] > 0
    assert c["ram_misses"] - c["ram_evictions"] <= ram_blocks  # free blocks are filled once
    read = {l.read_bytes for l in layers}
    if len(read) == 1:
        assert c["pack_read_bytes"] == c["ram_misses"] * read.pop()
    assert c["h2d_bytes"] > 0 and s["ram_hit_rate"] == pytest.approx(c["ram_hits"] / c["cache_misses"], abs=1e-6)  # printed with 6 digits


def test_tier_off_counts_every_miss_as_a_pack_read(packs):
    src, pack = packs("qwen3moe")
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 2 * K + 1), cache_vram_reserve_mib=0)
    try:
        run(src, p, prompt_len=2, n_decode=4)
        c = p.counters()
    finally:
        p.close()
    assert c["ram_blocks"] == c["ram_bytes"] == c["ram_hits"] == c["ram_evictions"] == 0
    assert c["ram_misses"] == c["cache_misses"] > 0


def test_a_tier_that_holds_everything_serves_the_second_run(packs):
    src, pack = packs("qwen3moe")
    n_keys = 4 * 16
    p = _provider(pack, 2 * K + 1, n_keys)
    s = Session(pack / TRUNK_FILE, p, n_ctx=256, n_ubatch=256, n_gpu_layers=0)
    try:
        prompt = [(i * 7919) % 1000 + 100 for i in range(8)]
        first, rc = s.generate(prompt, 16)
        assert rc == 0
        c1 = p.counters()
        assert c1["pack_read_bytes"] > 0 and c1["ram_evictions"] == 0  # the tier holds every key: no evictions
        p.reset_stats()
        p.reset_cache()  # the device cache forgets everything; the RAM tier keeps its blocks
        s.reset()
        second, rc = s.generate(prompt, 16)
        c2 = p.counters()
        js = p.stats()
    finally:
        s.close()
        p.close()
    stride = max(l["expert_stride"] for l in load_manifest(pack)["layers"])
    # the geometry while attached (a detached provider has freed its tier and reports 0 blocks)
    assert js["ram_blocks"] == n_keys and js["ram_bytes"] == n_keys * stride and js["ram_block_bytes"] == stride
    assert js["ram_pinned"] is False  # plain memory on the CPU backend
    assert rc == 0 and second == first
    assert c2["cache_misses"] > 0 and c2["pack_read_bytes"] == 0 and c2["ram_misses"] == 0
    assert c2["ram_hits"] == c2["cache_misses"]
    assert c2["ram_blocks"] == n_keys  # reset_stats keeps the geometry


def test_eio_with_ram_tier_fails_the_request_then_recovers(packs, stock):
    src, pack = packs("qwen3moe")

    def check(c, before):
        assert c["io_errors"] == 1
        assert c["ram_misses"] - before["ram_misses"] == 2  # the two reads that landed; the failed one is not counted
    # one read thread: reads land in order, so exactly the 2 reads before the fault are counted
    _eio_fails_the_request_then_recovers(stock, src, pack, _provider(pack, 2 * K + 1, 12, read_threads=1), check)


@pytest.mark.parametrize("value, match", [
    (-1, "'ram_cache_mib' must be a size in MiB"),
    ("64 blocks", "'ram_cache_mib' must be a size in MiB"),  # "64", "64M", "1G" and "auto" are sizes
    (True, "'ram_cache_mib' must be a size in MiB"),
    ([1], "'ram_cache_mib' must be a size in MiB"),
])
def test_bad_ram_cache_mib_names_the_key(packs, value, match):
    _, pack = packs("qwen3moe")
    with pytest.raises(ValueError, match=match):
        normalize_config(pack, ram_cache_mib=value)


def test_ram_tier_below_one_block_is_a_startup_error(packs):
    src, pack = packs("qwen3moe")
    p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 2 * K + 1), cache_vram_reserve_mib=0,
                      ram_cache_mib=0.01)
    try:
        with pytest.raises(RuntimeError, match=r"'ram_cache_mib' \(0\.010\) holds no expert block of .* MiB"):
            run(src, p, n_decode=1)
    finally:
        p.close()


def _tier_fails_at_load(src, pack, ram_blocks, message, slots=2 * K + 1):
    p = _provider(pack, slots, ram_blocks)
    try:
        with pytest.raises(RuntimeError, match=message):
            run(src, p, n_decode=1)
    finally:
        p.close()


def test_ram_tier_larger_than_the_free_memory_is_a_startup_error(packs, monkeypatch):
    """A tier that this process cannot take (MemAvailable, or a cgroup's memory.max less its usage) fails closed at
    load, naming the key and both sizes, instead of swapping or being OOM-killed later."""
    src, pack = packs("qwen3moe")
    # test seam: stands in for MemAvailable. On the CPU the device cache is host memory too and takes its budget from
    # the same headroom: room for the cache (K + 1 slots), not for a tier of every expert
    room = round(cache_mib_for_slots(pack, K + 1) + 0.5, 1)
    assert ram_mib_for_blocks(pack, 64) > room
    monkeypatch.setenv("EXPERT_PACK_TEST_MEM_AVAILABLE_MIB", str(room))
    _tier_fails_at_load(src, pack, 64, r"'ram_cache_mib' asks for a host-RAM tier of [0-9.]+ MiB \(64 blocks "
                                       rf"of .* MiB\), but this process can take only {room:.1f} MiB more", slots=K + 1)
    monkeypatch.delenv("EXPERT_PACK_TEST_MEM_AVAILABLE_MIB")
    _decode(src, _provider(pack, 2 * K + 1, 24), 1)  # the real headroom of this machine takes it


def test_ram_tier_sizing_takes_the_cgroups_page_cache_as_reclaimable(packs, monkeypatch, tmp_path):
    """In a cgroup, the page cache counts in memory.current but the kernel reclaims it before failing an allocation:
    the check takes memory.current less the file-list cache (memory.stat active_file + inactive_file) as used, so a
    cgroup that has just read the trunk still takes a tier that fits, and one whose usage is its own memory does
    not. (The H200's benchmark cgroup refused a tier it had run with because of the page cache.)"""
    src, pack = packs("qwen3moe")
    n = 64  # every expert: a tier larger than twice the device cache, which on the CPU takes from the same headroom
    need = int(ram_mib_for_blocks(pack, n) * 2**20)  # the tier's bytes (a little more than n blocks)
    assert need // 2 > cache_mib_for_slots(pack, K + 1) * 2**20
    limit = 2 * need
    cg = tmp_path / "cgroup"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{limit}\n")
    (cg / "memory.current").write_text(f"{limit - need // 2}\n")  # only half the tier left, counting the cache
    monkeypatch.setenv("EXPERT_PACK_TEST_CGROUP_DIR", str(cg))  # test seam: read as the process's cgroup
    monkeypatch.setenv("EXPERT_PACK_TEST_MEM_AVAILABLE_MIB", "1000000")
    (cg / "memory.stat").write_text(f"anon {limit - need}\nfile {need // 2 + 8192}\n"
                                     f"active_file {need // 4 + 4096}\ninactive_file {need // 4 + 4096}\nshmem 0\n")
    _decode(src, _provider(pack, K + 1, n), 1)  # the cache is reclaimable: the tier fits
    (cg / "memory.stat").write_text(f"anon {limit - need // 2}\nfile 0\nactive_file 0\ninactive_file 0\n")
    _tier_fails_at_load(src, pack, n, r"can take only [0-9.]+ MiB more \(memory\.max - \(memory\.current - "
                                      r"page cache 0 MiB\) of cgroup /\)", slots=K + 1)


# ---- concurrent miss reads (read_threads) -------------------------------------------------------------------

@pytest.mark.parametrize("ram_blocks", [None, 5, 24], ids=["staging", "ram-grouped", "ram-evicting"])
@pytest.mark.parametrize("kind", ["q4_k", "mixed"])
def test_lossless_with_read_threads(packs, stock, kind, ram_blocks):
    src, pack = packs("qwen3moe", **(MIXED if kind == "mixed" else {}))
    kw = dict(read_threads=4, stage_slots=2)  # fewer staging buffers than threads: reads wait for a buffer
    if ram_blocks is None:
        p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 2 * K + 1), cache_vram_reserve_mib=0, **kw)
    else:
        p = _provider(pack, 2 * K + 1, ram_blocks, **kw)
    try:
        got = run(src, p, record_routing=True, n_ubatch=256)
        c = p.counters()
    finally:
        p.close()
    ref = stock.run(src, n_ubatch=256)
    assert got.error == 0 and got.tokens == ref.tokens
    assert np.array_equal(got.logits, ref.logits), f"max |diff| {np.abs(got.logits - ref.logits).max()}"
    keys = sum(len(np.unique(ids)) for step in got.routing for ids in step.values())
    assert c["cache_hits"] + c["cache_misses"] == keys
    assert c["cache_misses"] == c["ram_hits"] + c["ram_misses"] and c["io_errors"] == 0
    read = {l.read_bytes for l in layers_from_manifest(load_manifest(pack))}
    if len(read) == 1:
        assert c["pack_read_bytes"] == c["ram_misses"] * read.pop()


@pytest.mark.parametrize("ram_blocks", [None, 12], ids=["staging", "ram"])
def test_eio_with_read_threads_fails_the_request_then_recovers(packs, stock, ram_blocks):
    src, pack = packs("qwen3moe")
    kw = dict(read_threads=4)
    if ram_blocks is None:
        p = Provider.open(pack, cache_vram_mib=cache_mib_for_slots(pack, 2 * K + 1), cache_vram_reserve_mib=0, **kw)
    else:
        p = _provider(pack, 2 * K + 1, ram_blocks, **kw)

    def check(c, before):
        assert c["io_errors"] == 1
    _eio_fails_the_request_then_recovers(stock, src, pack, p, check)


def test_bad_read_threads_names_the_key(packs):
    _, pack = packs("qwen3moe")
    for v in (0, 65, "4", 2.5):
        with pytest.raises(ValueError, match="'read_threads' must be an integer in \\[1, 64\\]"):
            normalize_config(pack, read_threads=v)


@pytest.mark.parametrize("mode", ["spill", "victim", "inclusive"])
def test_ram_tier_modes_are_lossless(packs, stock, mode):
    src, pack = packs("qwen3moe")
    c = _decode_like_stock(stock, src, _provider(pack, K, 24, ram_tier_mode=mode), n_decode=48)
    assert c["cache_misses"] == c["ram_hits"] + c["ram_misses"]
    assert (c["ram_spills"] > 0) == (mode == "spill")  # only spill copies the device's victims back


def test_tier_modes_rank_as_designed(packs):
    """On the same decode, each mode serves more device misses from RAM than the one before it: inclusive (every
    block read, most of them copies of what the device holds), victim (a copy of an expert on the device goes
    first, the device's victims stay), spill (blocks rank by popularity, and popular victims the tier no longer
    held are copied back from the device). scripts/ram_tier_sim.py on a realistic trace at a 10% tier: victim
    saves 7.1% of the reads, spill 19.8%."""
    src, pack = packs("qwen3moe")
    got = {mode: _decode(src, _provider(pack, K, 24, ram_tier_mode=mode), 96)[0]
           for mode in ("inclusive", "victim", "spill")}
    misses = {m: c["cache_misses"] for m, c in got.items()}
    assert len(set(misses.values())) == 1, misses  # the device cache does not depend on the tier
    reads = {m: c["ram_misses"] for m, c in got.items()}
    assert reads["spill"] < reads["victim"] < reads["inclusive"], reads
    assert got["spill"]["ram_spills"] > 0
    assert got["spill"]["pack_read_bytes"] < got["victim"]["pack_read_bytes"]


def test_ram_tier_mode_is_validated(packs):
    _, pack = packs("qwen3moe")
    with pytest.raises(ValueError, match="ram_tier_mode"):
        normalize_config(pack, ram_tier_mode="lru")


# ---- next-layer prefetch (prefetch) ---------------------------------------------------------------------------

def _prefetch_counters_hold(c):
    # every prefetch read queued is used, wasted, dropped before it started, or still waiting for its use
    assert c["prefetch_used"] + c["prefetch_wasted"] + c["prefetch_cancelled"] <= c["prefetch_issued"]
    assert c["predicted_correct"] <= c["predicted"]
    assert c["cache_misses"] == c["ram_hits"] + c["ram_misses"]
    assert c["prefetch_used"] <= c["ram_hits"]  # a used prefetch is a RAM hit


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4", "kimi-k3"])
@pytest.mark.parametrize("ram_blocks, read_threads", [(12, 1), (24, 4)], ids=["small-tier", "evicting-4-threads"])
def test_lossless_with_prefetch(packs, stock, arch, ram_blocks, read_threads):
    """Prefetch only adds RAM-tier reads: the logits stay bit-identical to stock, and the predictions are scored."""
    src, pack = packs(arch)
    c = _decode_like_stock(stock, src, _provider(pack, K, ram_blocks, prefetch=True, read_threads=read_threads), n_decode=48)
    assert c["io_errors"] == 0
    # every decode step predicts each MoE layer after the first from the one before it
    assert c["predicted"] > 0 and c["prefetch_issued"] > 0
    _prefetch_counters_hold(c)


def test_prefetch_serves_misses_from_the_ram_tier(packs):
    """On a model whose consecutive layers route alike (the realistic preset), some prefetched experts are then
    needed: their misses become RAM hits, and prediction accuracy is reported."""
    src, pack = packs("qwen3moe")
    c, s = _decode(src, _provider(pack, K, 24, prefetch=True), 64)
    _prefetch_counters_hold(c)
    assert c["predicted_correct"] > 0 and c["prefetch_used"] > 0
    assert s["prediction_accuracy"] == pytest.approx(c["predicted_correct"] / c["predicted"], abs=1e-6)
    assert s["prefetch_wait_ms"] >= 0  # the graph's ops waiting for running prefetch reads
    for k in ("prefetch_issued", "prefetch_used", "prefetch_wasted", "prefetch_cancelled"):
        assert s[k] == c[k]


def test_prefetch_never_touches_the_device_cache(packs):
    """A guess only takes RAM-tier blocks: with prefetch on, the device cache sees exactly the same steps, so its hits,
    misses and evictions are those of the same run without prefetch; only where the misses come from changes."""
    src, pack = packs("qwen3moe")
    got = {pf: _decode(src, _provider(pack, K, 24, prefetch=pf), 64)[0] for pf in (False, True)}
    for k in ("cache_hits", "cache_misses", "cache_evictions", "h2d_bytes", "steps"):
        assert got[True][k] == got[False][k], k
    assert got[True]["ram_hits"] > got[False]["ram_hits"] and got[True]["prefetch_used"] > 0


def test_prefetches_dropped_before_their_reads_change_nothing_but_the_tier(packs, stock):
    """With every prefetch read held back (the test seam), each guess is dropped at the next layer's acquire: all
    count as cancelled, none as used or wasted, the device cache sees the run without prefetch, no prefetch byte is
    read, and the logits stay stock's."""
    src, pack = packs("qwen3moe")
    base = _decode(src, _provider(pack, K, 24), 64)[0]
    p = _provider(pack, K, 24, prefetch=True)
    p.hold_prefetch()
    held = _decode_like_stock(stock, src, p, 64)
    assert held["prefetch_issued"] > 0 and held["prefetch_cancelled"] == held["prefetch_issued"]
    assert held["prefetch_used"] == held["prefetch_wasted"] == 0
    for k in ("cache_hits", "cache_misses", "cache_evictions", "h2d_bytes"):
        assert held[k] == base[k], k
    assert held["cache_misses"] == held["ram_hits"] + held["ram_misses"]
    assert held["pack_read_bytes"] == held["ram_misses"] * base["pack_read_bytes"] // base["ram_misses"]


def test_eio_during_prefetch_fails_only_the_request_then_recovers(packs, stock):
    """Prefetch and demand reads fail alike after the fault: a failed prefetch only empties its block (the demand
    read then fails the step), and no block a failed prefetch was meant to fill is trusted afterwards."""
    src, pack = packs("qwen3moe")

    def check(c, before):
        assert c["io_errors"] >= 1
    _eio_fails_the_request_then_recovers(stock, src, pack, _provider(pack, K, 12, prefetch=True), check)


def test_prefetch_needs_the_ram_tier(packs):
    _, pack = packs("qwen3moe")
    with pytest.raises(ValueError, match="'prefetch' needs the host-RAM tier"):
        normalize_config(pack, prefetch=True)
    with pytest.raises(ValueError, match="'prefetch' must be true or false"):
        normalize_config(pack, prefetch=1, ram_cache_mib=8)
