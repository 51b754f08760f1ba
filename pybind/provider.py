"""The expert-pack provider from Python: open a pack, hand it to llama.cpp, read its counters."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from . import ffi, lib

# The keys the provider takes (names as in the reference design); the C library validates the values.
CONFIG_KEYS = ("pack_path", "manifest_path", "cache_vram_mib", "cache_vram_reserve_mib", "stage_slots", "read_splits",
               "read_threads",
               "direct_io", "stats_path", "stats_flush_interval", "verify_pack_sha256", "ram_cache_mib", "trace_path",
               "ram_tier_mode", "prefetch")
# the command-line spellings (expert-pack serve's flags, without dashes) of keys whose names differ
FLAG_NAMES = {"cache_mib": "cache_vram_mib", "cache_reserve_mib": "cache_vram_reserve_mib", "stats_file": "stats_path",
              "expert_pack": "pack_dir", "pack": "pack_dir", "ram_mib": "ram_cache_mib", "verify": "verify_pack_sha256"}
LLAMA_SPLIT_MODE_ROW = 2  # llama.h's enum llama_split_mode (llama_cpp.LLAMA_SPLIT_MODE_ROW)
STATS_FIELDS = ("cache_hits", "cache_misses", "cache_evictions", "pack_read_bytes", "h2d_bytes", "fallback_count",
                "io_errors", "steps", "ram_hits", "ram_misses", "ram_evictions", "ram_spills", "ram_blocks",
                "ram_bytes",
                "prefetch_issued", "prefetch_used", "prefetch_wasted", "prefetch_cancelled", "predicted",
                "predicted_correct")


def config_schema() -> list[dict]:
    """Every configuration key as the C library describes it: name, type, default, help, min/max, values."""
    n = lib().expert_pack_config_schema(ffi().NULL, 0)
    buf = ffi().new("char[]", n + 1)
    lib().expert_pack_config_schema(buf, n + 1)
    return json.loads(ffi().string(buf).decode())


def _err():
    return ffi().new("char[1024]")


def normalize_config(expert_pack: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> dict:
    """A pack directory or a dict of provider keys (a dict may name the directory as `pack_dir`) -> the
    provider's configuration. Raises ValueError naming an unknown key or a bad value."""
    if isinstance(expert_pack, (str, os.PathLike)):
        cfg: dict = {"pack_dir": os.fspath(expert_pack)}
    elif isinstance(expert_pack, Mapping):
        cfg = dict(expert_pack)
    else:
        raise ValueError(f"expert_pack must be a pack directory or a dict, not {type(expert_pack).__name__}")
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    pack_dir = cfg.pop("pack_dir", None)
    if pack_dir is not None:
        if not isinstance(pack_dir, (str, os.PathLike)):
            raise ValueError(f"expert_pack key 'pack_dir' must be a path, got {pack_dir!r}")
        d = Path(pack_dir)
        if not d.exists():
            raise ValueError(f"expert_pack: {d}: no such directory")
        if not d.is_dir():
            raise ValueError(f"expert_pack: {d} is a file, not a pack directory (give the folder that holds "
                             f"manifest.json, experts.pack and trunk.gguf)")
        if not (d / "manifest.json").is_file():
            raise ValueError(f"expert_pack: {d} is not an expert pack (no manifest.json; build one with "
                             f"`expert-pack build MODEL.gguf -o {d}`)")
        cfg.setdefault("pack_path", str(d / "experts.pack"))
        cfg.setdefault("manifest_path", str(d / "manifest.json"))
    for key in cfg:
        if key not in CONFIG_KEYS:
            import difflib
            close = ([FLAG_NAMES[key]] if key in FLAG_NAMES else
                     difflib.get_close_matches(key, CONFIG_KEYS + ("pack_dir",), n=1, cutoff=0.5))
            hint = f"; did you mean '{close[0]}'?" if close else f" (the keys: pack_dir, {', '.join(CONFIG_KEYS)})"
            raise ValueError(f"unknown expert_pack key '{key}'{hint}")
    try:
        text = json.dumps(cfg)
    except TypeError as e:
        raise ValueError(f"expert_pack configuration is not JSON-serializable: {e}") from e
    err = _err()
    if lib().expert_pack_config_validate(text.encode(), err, len(err)) != 0:
        raise ValueError(ffi().string(err).decode())
    return cfg


class Provider:
    """An open expert pack. `use_in(model_params)` makes it the model's expert source; free it after the model."""

    def __init__(self, config: Mapping[str, Any]):
        self.config = dict(config)
        err = _err()
        h = lib().expert_pack_open(json.dumps(self.config).encode(), err, len(err))
        if h == ffi().NULL:
            raise RuntimeError(f"expert pack: {ffi().string(err).decode()}")
        self._h = h

    @classmethod
    def open(cls, expert_pack, **overrides) -> "Provider":
        return cls(normalize_config(expert_pack, **overrides))

    @property
    def handle(self) -> int:
        """The provider pointer as an int (for ctypes structs such as llama_model_params)."""
        self._check()
        return int(ffi().cast("uintptr_t", self._h))

    def use_in(self, model_params) -> None:
        """Make this provider the expert source of a llama_model_params (ctypes): the table of
        expert_pack_llama_source() as expert_source, the provider as expert_source_ctx. The row split is refused
        (ValueError): the caches hold whole experts on the device of each layer."""
        if getattr(model_params, "split_mode", None) == LLAMA_SPLIT_MODE_ROW:
            raise ValueError("expert pack: split_mode LLAMA_SPLIT_MODE_ROW is not supported with an expert pack; "
                             "use LLAMA_SPLIT_MODE_LAYER")
        model_params.expert_source = int(ffi().cast("uintptr_t", lib().expert_pack_llama_source()))
        model_params.expert_source_ctx = self.handle

    def _check(self) -> None:
        if self._h is None:
            raise RuntimeError("expert pack provider is closed")

    def _text(self, fn) -> str:
        """A string from a C function that writes it into a buffer and returns its length (the length needed when
        the buffer is too small): expert_pack_stats_json, expert_pack_summary, expert_pack_timeline_json."""
        self._check()
        n = fn(self._h, ffi().NULL, 0)
        buf = ffi().new("char[]", n + 1)
        fn(self._h, buf, n + 1)
        return ffi().string(buf).decode()

    def stats(self) -> dict:
        """The counters, plus derived figures and the cache geometry (what the stats file holds)."""
        return json.loads(self._text(lib().expert_pack_stats_json))

    def counters(self) -> dict:
        self._check()
        s = ffi().new("expert_pack_stats *")
        lib().expert_pack_get_stats(self._h, s)
        return {f: getattr(s, f) for f in STATS_FIELDS}

    def reset_stats(self) -> None:
        self._check()
        lib().expert_pack_reset_stats(self._h)

    def reset_cache(self) -> None:
        self._check()
        lib().expert_pack_reset_cache(self._h)

    @property
    def last_error(self) -> str:
        self._check()
        return ffi().string(lib().expert_pack_last_error(self._h)).decode()

    @property
    def slots_per_layer(self) -> int:
        self._check()
        return lib().expert_pack_slots_per_layer(self._h)

    @property
    def summary(self) -> str:
        """One line saying how the cache was sized ("" before a model is loaded with the provider)."""
        return self._text(lib().expert_pack_summary)

    def timeline(self) -> dict:
        """The per-layer timeline of the last complete step (src/timeline.h): microseconds from its first acquire."""
        return json.loads(self._text(lib().expert_pack_timeline_json))

    @property
    def max_ubatch(self) -> int:
        self._check()
        return lib().expert_pack_max_ubatch(self._h)

    def distinct_round_slots(self, on: bool = True) -> None:
        """Test seam: serve rounds with the GPU's slot assignment (a token's slot ids distinct) on any device."""
        self._check()
        lib().expert_pack_test_distinct_round_slots(self._h, int(on))

    def hold_prefetch(self, on: bool = True) -> None:
        """Test seam: while on, no prefetch read starts, so every prefetch is dropped at the next layer's acquire."""
        self._check()
        lib().expert_pack_test_hold_prefetch(self._h, int(on))

    def inject_eio(self, after_reads: int) -> None:
        """Test seam: after `after_reads` more block reads, reads fail with EIO; -1 disarms."""
        self._check()
        lib().expert_pack_test_inject_eio(self._h, after_reads)

    @property
    def pack_id(self) -> str:
        self._check()
        return ffi().string(lib().expert_pack_id(self._h)).decode()

    def close(self) -> None:
        """Free the provider. Only after every model using it is freed."""
        if self._h is not None:
            lib().expert_pack_free(self._h)
            self._h = None


class Policy:
    """The cache policy alone (the provider's own code), for tests and simulators."""

    def __init__(self, n_slots: int, n_experts: int):
        self._p = ffi().gc(lib().expert_pack_policy_new(n_slots, n_experts), lib().expert_pack_policy_free)
        if self._p == ffi().NULL:
            raise ValueError("n_slots and n_experts must be > 0")
        self.hits = self.misses = self.evictions = 0

    def set_busy(self, slot: int, busy: bool = True) -> None:
        """Mark a slot busy (a read still writes it): a victim only when every other unpinned slot is busy too."""
        lib().expert_pack_policy_set_busy(self._p, slot, int(busy))

    def step(self, experts: list[int]) -> list[int]:
        n = len(experts)
        arr = ffi().new("int32_t[]", list(experts))
        out = ffi().new("int32_t[]", max(n, 1))
        h, m, e = ffi().new("uint64_t *"), ffi().new("uint64_t *"), ffi().new("uint64_t *")
        if lib().expert_pack_policy_step(self._p, arr, n, out, h, m, e) != 0:
            raise ValueError("the step needs more distinct experts than there are slots (or an id is out of range)")
        self.hits += h[0]
        self.misses += m[0]
        self.evictions += e[0]
        return list(out)[:n]
