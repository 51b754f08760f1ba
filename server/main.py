"""`expert-pack serve`: load a model (with or without an expert pack) and serve it over HTTP with waitress,
wherever llama-server would be used (same flags for the common options, same /completion and /metrics).

Start-up order: every flag and path is checked first (one line naming the flag, exit 2), then the port is bound
(a port in use fails before minutes of loading), then the model loads in a thread while the server already answers
503 "Loading model" (as llama-server does), then the API is served. SIGINT / SIGTERM stop new work, cancel the running
generation, wait for the requests in flight, free the model (its final stats file is written then) and exit 0;
a second signal exits at once.
"""
from __future__ import annotations

import argparse
import difflib
import errno
import functools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# provider key -> the serve flag that sets it, so that the C library's messages speak the command line
KEY_FLAGS = {"cache_vram_mib": "--cache-mib", "cache_vram_reserve_mib": "--cache-reserve-mib",
             "ram_cache_mib": "--ram-cache-mib", "stage_slots": "--stage-slots", "read_splits": "--read-splits",
             "read_threads": "--read-threads", "direct_io": "--direct-io", "ram_tier_mode": "--ram-tier-mode",
             "prefetch": "--prefetch", "stats_path": "--stats-file", "pack_dir": "--expert-pack",
             "pack_path": "--expert-pack", "manifest_path": "--expert-pack",
             "stats_flush_interval": "--stats-interval", "verify_pack_sha256": "--verify-checksums",
             "trace_path": "--trace-file"}
PACK_FLAGS = ("cache_mib", "cache_reserve_mib", "ram_cache_mib", "stage_slots", "read_splits", "read_threads",
              "direct_io", "ram_tier_mode", "prefetch", "stats_file", "stats_interval", "verify_checksums",
              "trace_file")
STOP_WAIT_S = 10.0       # how long a stop waits for requests in flight before leaving without freeing the model
MAX_BODY = 64 << 20      # request bodies beyond this get waitress's 413 (a context's worth of JSON is far smaller)


def flag_terms(message: str) -> str:
    """Rewrite provider key names in a message as the serve flags that set them."""
    message = re.sub(r"expert_pack key '(\w+)'", lambda m: KEY_FLAGS.get(m[1], m[0]), message)
    # bare keys too ("... (cache_vram_mib 1.0, ...)", "set ram_cache_mib"); only names with an underscore, which
    # cannot be ordinary words
    bare = "|".join(k for k in KEY_FLAGS if "_" in k)
    return re.sub(rf"\b({bare})\b", lambda m: KEY_FLAGS[m[1]], message)


# --- the command line -----------------------------------------------------------------------------------------

def _int_range(lo: int, hi: int | None = None, note: str = ""):
    def conv(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            want = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {want}{note}, got {v}")
        return v
    conv.__name__ = "int"
    return conv


def _float_range(lo: float, hi: float | None = None, above: bool = False):
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or (v <= lo if above else v < lo) or (hi is not None and v > hi):
            want = f"> {lo:g}" if above else (f"in {lo:g}..{hi:g}" if hi is not None else f">= {lo:g}")
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return v
    conv.__name__ = "float"
    return conv


def _size(text: str) -> float | str:
    """A size flag's value: a plain number (MiB) as a float, anything else ("8G", "512M", "auto") as given, for the
    provider to parse (its error names the key, which is translated to the flag)."""
    s = text.strip()
    try:
        return float(s)
    except ValueError:
        return s


@functools.lru_cache(maxsize=1)
def llama_server_flags() -> frozenset[str]:
    """The flag names of the fork's own llama-server (shipped beside this package), from its --help: the first
    column of each option line, up to its value hint. Empty where the tool is not installed or does not answer;
    only asked about a flag serve does not know."""
    from ggml_expert_pack.tools import tool_path
    try:
        r = subprocess.run([str(tool_path("llama-server")), "--help"], capture_output=True, text=True, timeout=15,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    flags = set()
    for line in r.stdout.splitlines():
        if not line.startswith("-") or line.startswith("--- ") or line.startswith("-----"):
            continue
        for word in line.split():
            word = word.rstrip(",")
            if not re.fullmatch(r"--?[A-Za-z][\w.-]*", word):
                break
            flags.add(word)
    return frozenset(flags)


class _ServeParser(argparse.ArgumentParser):
    """serve's own parser: every complaint is one line (no usage block), and an unknown flag gets a suggestion."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            flags = [e for e in extras if e.startswith("-") and len(e) > 1]
            if flags:
                flag = flags[0].split("=", 1)[0]
                if flag in llama_server_flags():
                    print(f"{self.prog}: error: {flag} is a llama-server flag that {self.prog} does not implement",
                          file=sys.stderr)
                    sys.exit(2)
                known = [o for a in self._actions for o in a.option_strings]
                near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]}?)" if near else f" ({self.prog} --help lists them)"
                print(f"{self.prog}: error: unrecognized argument {flag}{hint}", file=sys.stderr)
            else:
                print(f"{self.prog}: error: unexpected argument {extras[0]!r}: give one model", file=sys.stderr)
            sys.exit(2)
        return ns, extras


def add_serve(sub) -> None:
    cls = sub._parser_class
    sub._parser_class = type("ServeParser", (_ServeParser, cls), {}) if cls is not argparse.ArgumentParser \
        else _ServeParser
    try:
        p = sub.add_parser(
            "serve", help="serve a model over HTTP: OpenAI /v1 endpoints, llama-server's /completion, a chat page",
            description="Serve a model over HTTP, a drop-in for llama-server: /v1/chat/completions, /v1/completions, "
                        "/v1/models, /completion (with timings), /tokenize, /detokenize, /apply-template, /slots, "
                        "/v1/embeddings and /embedding (with --embedding), /health, /props, /metrics, "
                        "and a chat page at /. One generation runs at a time; others wait in arrival order. The port "
                        "is bound before the model loads; until it is loaded every request gets 503. Each request "
                        "is logged as one line on stderr. Ctrl-C or SIGTERM cancels the running generation, frees "
                        "the model (writing the final --stats-file) and exits 0. A llama-server flag that serve "
                        "does not implement is refused, naming it.",
            epilog="Sizes (--cache-mib, --cache-reserve-mib, --ram-cache-mib) are MiB, or a number with a binary "
                   "unit: 512M, 8G, 1.5G; --ram-cache-mib also takes auto (sized by the provider at load).")
    finally:
        sub._parser_class = cls
    p.add_argument("pack", nargs="?", metavar="PACK",
                   help="a pack folder (serves PACK/trunk.gguf with --expert-pack PACK) or a GGUF file; instead of -m")
    p.add_argument("-m", "--model", help="GGUF model: a pack's trunk.gguf (with --expert-pack), the original model, "
                                         "or a pack folder")
    p.add_argument("--expert-pack", metavar="DIR", help="expert pack directory: stream routed experts from it")
    # each flag also under the fork's llama-server spelling (--expert-cache-mib, ...), so that one command line
    # serves with either server
    g = p.add_argument_group("expert cache (with --expert-pack)")
    g.add_argument("--cache-mib", "--expert-cache-mib", dest="cache_mib", type=_size, metavar="SIZE",
                   help="expert cache budget (default: all free memory less the reserve)")
    g.add_argument("--cache-reserve-mib", "--expert-cache-reserve-mib", dest="cache_reserve_mib", type=_size,
                   metavar="SIZE", help="memory left free for the rest of the model and compute buffers (default 1024)")
    g.add_argument("--ram-cache-mib", "--expert-ram-cache-mib", dest="ram_cache_mib", type=_size, metavar="SIZE",
                   help="host-RAM tier of whole experts between the pack and the cache (pinned on a GPU: "
                        "leave the OS, the model and the page cache room; default 0 = off)")
    g.add_argument("--stage-slots", "--expert-stage-slots", dest="stage_slots", type=int, metavar="N",
                   help="pinned staging buffers for pack reads (1..1024)")
    g.add_argument("--read-splits", "--expert-read-splits", dest="read_splits", type=int, metavar="N",
                   help="parallel reads per expert (1..64)")
    g.add_argument("--read-threads", "--expert-read-threads", dest="read_threads", type=int, metavar="N",
                   help="threads reading a step's missed experts concurrently (1..64, default 4)")
    g.add_argument("--direct-io", "--expert-direct-io", dest="direct_io", choices=("on", "off"),
                   help="O_DIRECT pack reads (default on; off = buffered reads, for comparison only)")
    g.add_argument("--ram-tier-mode", "--expert-ram-tier-mode", dest="ram_tier_mode",
                   choices=("spill", "victim", "inclusive"),
                   help="what the host-RAM tier keeps: spill (default: the most popular experts the device cache "
                        "does not hold, copying the ones it evicts back into RAM), victim (the experts the cache "
                        "evicted that are still in RAM, most recent first) or inclusive (every expert read)")
    g.add_argument("--prefetch", "--expert-prefetch", dest="prefetch", choices=("on", "off"),
                   help="predict the next layer's experts with its router and read them into the host-RAM tier "
                        "while the GPU computes (needs --ram-cache-mib; default off)")
    g.add_argument("--stats-file", "--expert-stats-file", dest="stats_file", metavar="PATH",
                   help="write the expert-pack counters to this JSON file (its folder must exist)")
    g.add_argument("--stats-interval", "--expert-stats-interval", dest="stats_interval", type=_int_range(1),
                   metavar="N", help="write the stats file every N steps (default 64) and at exit")
    g.add_argument("--verify-checksums", "--expert-verify-checksums", dest="verify_checksums", choices=("on", "off"),
                   help="check every expert block's XXH3-128 as it is read (default on)")
    g.add_argument("--trace-file", "--expert-trace-file", dest="trace_file", metavar="PATH",
                   help="record the router's expert ids of every step and layer (docs/FORMAT.md, routing traces)")
    p.add_argument("-c", "--ctx-size", type=_int_range(0, note=" (0 = the model's training context)"), default=4096,
                   metavar="N",
                   help="context size in tokens (default 4096; 0 = the model's training context)")
    p.add_argument("-ngl", "--n-gpu-layers", type=_int_range(-1, note=" (-1 = all)"), default=-1, metavar="N",
                   help="layers offloaded to the GPU (-1 = all, the default; ignored on a CPU build)")
    p.add_argument("-b", "--batch-size", type=_int_range(1), default=None, metavar="N",
                   help="logical batch size for the prompt (default 512; with --expert-pack and neither -b nor -ub "
                        "given, both are sized for whole prompts: see -ub)")
    p.add_argument("-ub", "--ubatch-size", type=_int_range(1), default=None, metavar="N",
                   help="physical batch size (default 512; with --expert-pack and neither -b nor -ub given, the "
                        "largest of min(-c, 8192), halved down to 512, whose buffers fit in memory: each ubatch reads "
                        "nearly every expert, so a prompt in fewer ubatches reads the pack fewer times)")
    p.add_argument("-t", "--threads", type=_int_range(1), default=None, metavar="N",
                   help="CPU threads for generation (default: auto)")
    p.add_argument("-np", "--parallel", type=_int_range(1, 256), default=1, metavar="N",
                   help="slots: up to N requests generate together, one token each per batch, each slot with -c/N of "
                        "the context (default 1: one at a time, in arrival order). With an expert pack, a batch "
                        "needs the union of its sequences' experts: with a small cache that union thrashes it, so "
                        "N sequences can decode slower in total than one; the larger the share of the experts "
                        "cached, the more N > 1 adds throughput. --embedding needs --parallel 1")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_int_range(1, 65535), default=8080, help="port to listen on, 1..65535 (default 8080)")
    p.add_argument("--alias", metavar="NAME", help="model name reported by /v1/models and accepted in requests "
                                   "(default: the model's general.name, else the pack folder's or file's name)")
    p.add_argument("--threads-http", type=_int_range(1), default=8, metavar="N",
                   help="HTTP worker threads; requests beyond the one generating wait in order (default 8)")
    g = p.add_argument_group("request defaults (llama-server's; a request's own field wins)")
    g.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=_int_range(-1, note=" (-1 = unlimited)"),
                   default=-1, metavar="N",
                   help="tokens to generate when a request gives no n_predict (/completion) or max_tokens (/v1/*) "
                        "(default -1 = until end of generation or the context is full)")
    g.add_argument("-s", "--seed", type=_int_range(-1, 2**32 - 1, " (-1 = random)"), default=-1, metavar="SEED",
                   help="sampling seed (default -1 = random)")
    g.add_argument("--temp", "--temperature", dest="temp", type=_float_range(0.0), default=0.8, metavar="F",
                   help="temperature (default 0.8; 0 = greedy)")
    g.add_argument("--top-k", type=_int_range(0, note=" (0 = off)"), default=40, metavar="N",
                   help="top-k sampling (default 40, 0 = off)")
    g.add_argument("--top-p", type=_float_range(0.0, 1.0), default=0.95, metavar="F",
                   help="top-p sampling (default 0.95, 1.0 = off)")
    g.add_argument("--min-p", type=_float_range(0.0, 1.0), default=0.05, metavar="F",
                   help="min-p sampling (default 0.05, 0.0 = off)")
    g.add_argument("--repeat-penalty", type=_float_range(0.0, above=True), default=1.0, metavar="F",
                   help="repeat penalty (default 1.0 = off)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("LLAMA_API_KEY"),
                   help="require Authorization: Bearer KEY (or X-Api-Key: KEY) on every endpoint but /health and "
                        "/; several keys as a comma-separated list (default: $LLAMA_API_KEY, else none)")
    p.add_argument("--metrics", action="store_true",
                   help="accepted for llama-server's command lines: /metrics is always served")
    p.add_argument("--no-webui", "--no-ui", dest="webui", action="store_false",
                   help="no chat page at / (it answers 404)")
    p.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="serve GET /slots, the one slot's state (the default, as llama-server's)")
    p.add_argument("--no-slots", dest="slots", action="store_false",
                   help="no /slots: it answers llama-server's 501")
    p.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                   help="serve /v1/embeddings and /embedding(s) (llama-server's flag; generation still works)")
    p.add_argument("--pooling", choices=("none", "mean", "cls", "last"), default=None,
                   help="pooling of the embeddings (default: the model's; 'none' gives one vector per token, on "
                        "/embedding only, as llama-server)")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's own logging")
    p.set_defaults(func=cmd_serve)


# --- checking the command line against the files ---------------------------------------------------------------

def _is_pack(d: Path) -> bool:
    return d.is_dir() and (d / "manifest.json").is_file()


def _check_pack_dir(text: str) -> Path:
    d = Path(text)
    if not d.exists():
        raise ValueError(f"--expert-pack {text}: no such file or directory")
    if not d.is_dir():
        raise ValueError(f"--expert-pack {text} is a file; it takes the pack folder (the one holding manifest.json, "
                         "experts.pack and trunk.gguf)")
    if not (d / "manifest.json").is_file():
        raise ValueError(f"--expert-pack {text} is not an expert pack: it has no manifest.json")
    return d


def resolve_model(args) -> tuple[Path, Path | None]:
    """(the GGUF to load, the pack folder or None) from -m / PACK / --expert-pack, or ValueError in the command
    line's terms."""
    if args.model and args.pack and Path(args.model) != Path(args.pack):
        raise ValueError(f"two models: -m {args.model} and {args.pack}; give one")
    text = args.model or args.pack
    if not text:
        raise ValueError("no model: give -m MODEL.gguf (a GGUF, or a pack's trunk.gguf with --expert-pack) "
                         "or a pack folder (expert-pack serve PACK)")
    flag = "-m " if args.model else ""
    path = Path(text)
    if not path.exists():
        raise ValueError(f"{flag}{text}: no such file or directory")
    pack = _check_pack_dir(args.expert_pack) if args.expert_pack else None
    if path.is_dir():
        if not _is_pack(path):
            raise ValueError(f"{flag}{text} is a folder, neither a GGUF file nor an expert pack (no manifest.json)")
        if pack is not None and pack.resolve() != path.resolve():
            raise ValueError(f"{flag}{text}: this is a pack folder: use {path / 'trunk.gguf'} or pass the folder to "
                             "--expert-pack")
        trunk = path / "trunk.gguf"
        if not trunk.is_file():
            raise ValueError(f"{flag}{text}: the pack folder has no trunk.gguf")
        return trunk, path
    return path, pack


def _header(path: Path, flag: str):
    from ggml_expert_pack.gguf_file import GGUFFormatError, read_header
    try:
        return read_header(path)
    except GGUFFormatError as e:
        msg = str(e)
        raise ValueError(flag + msg if msg.startswith(str(path)) else f"{flag}{path}: {msg}") from None
    except OSError as e:
        raise ValueError(f"{flag}{path}: {e.strerror}") from None


def check_trunk(model: Path, pack: Path | None, header, flag: str = "-m ") -> None:
    """A trunk needs its pack, and its own one."""
    trunk_id = header.get("expert_pack.pack_id")
    if not trunk_id:
        return
    if pack is None:
        hint = model.parent if _is_pack(model.parent) else "PACK_DIR"
        raise ValueError(f"{flag}{model} is the trunk of an expert pack (its routed experts are in the pack): "
                         f"add --expert-pack {hint}")
    try:
        pack_id = json.loads((pack / "manifest.json").read_text()).get("pack_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"--expert-pack {pack}: manifest.json is unreadable: {e}") from None
    if pack_id and str(trunk_id) != str(pack_id):
        raise ValueError(f"{flag}{model} is the trunk of another pack (pack_id {trunk_id}) than --expert-pack {pack} "
                         f"(pack_id {pack_id})")


def check_stats_file(text: str) -> None:
    p = Path(text)
    if p.is_dir():
        raise ValueError(f"--stats-file {text} is a folder; it takes a file path")
    parent = p.parent
    if not parent.is_dir():
        raise ValueError(f"--stats-file {text}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--stats-file {text}: cannot write in {parent}")


def check_embedding_flags(args) -> None:
    if args.pooling is not None and not args.embedding:
        raise ValueError(f"--pooling {args.pooling} needs --embedding")
    if args.embedding and getattr(args, "parallel", 1) > 1:
        raise ValueError("--embedding with --parallel > 1 is not supported: serve embeddings with --parallel 1")


def pack_config(args) -> dict | None:
    if not args.expert_pack:
        for flag in PACK_FLAGS:
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --expert-pack")
        return None
    cfg: dict = {"pack_dir": args.expert_pack}
    for flag, key in (("cache_mib", "cache_vram_mib"), ("cache_reserve_mib", "cache_vram_reserve_mib"),
                      ("ram_cache_mib", "ram_cache_mib"),
                      ("stage_slots", "stage_slots"), ("read_splits", "read_splits"),
                      ("read_threads", "read_threads"), ("ram_tier_mode", "ram_tier_mode"),
                      ("stats_file", "stats_path"), ("stats_interval", "stats_flush_interval"),
                      ("trace_file", "trace_path")):
        v = getattr(args, flag)
        if v is not None:
            cfg[key] = v
    if args.direct_io is not None:
        cfg["direct_io"] = args.direct_io == "on"
    if args.prefetch is not None:
        cfg["prefetch"] = args.prefetch == "on"
    if args.verify_checksums is not None:
        cfg["verify_pack_sha256"] = args.verify_checksums == "on"
    return cfg


def validate_pack_config(cfg: dict) -> None:
    """The provider's own validation (no pack is opened), its complaints in flag names."""
    from ggml_expert_pack.pybind.provider import normalize_config
    try:
        normalize_config(cfg)
    except ValueError as e:
        raise ValueError(flag_terms(str(e))) from None


def served_name(model: Path, pack: Path | None, header) -> str:
    name = header.get("general.name") if header is not None else None
    if isinstance(name, str) and name.strip():
        return name.strip()
    return pack.resolve().name if pack is not None else model.name


class Plan:
    """What a checked command line serves. `inspect()` (reading the model's GGUF header: the trunk and its pack, the
    name to serve it under) is apart, so that serve can bind its port first: a vocabulary takes a while to read."""

    def __init__(self, args, inspect: bool = True):
        self.args = args
        self.model, pack = resolve_model(args)
        if pack is not None:
            args.expert_pack = str(pack)
        self.pack = pack
        if args.alias is not None and not args.alias.strip():
            raise ValueError("--alias must not be empty")
        if args.stats_file is not None:
            check_stats_file(args.stats_file)
        check_embedding_flags(args)
        self.cfg = pack_config(args)
        if self.cfg is not None:
            validate_pack_config(self.cfg)
        self.alias = args.alias
        if inspect:
            self.inspect()

    def inspect(self) -> None:
        from ggml_expert_pack.model_path import model_path_error
        flag = "-m " if self.args.model else ""
        header = _header(self.model, flag)
        check_trunk(self.model, self.pack, header, flag)
        err = model_path_error(self.model, pack_given=True)  # what else llama.cpp would refuse: a later shard
        if err is not None:
            raise ValueError(flag + err)
        self.alias = self.args.alias or served_name(self.model, self.pack, header)


# --- loading and serving ----------------------------------------------------------------------------------------

def load(args, plan: Plan | None = None):
    from llama_cpp import Llama
    plan = plan or Plan(args)
    kw = dict(model_path=str(plan.model), n_ctx=args.ctx_size, n_gpu_layers=args.n_gpu_layers, verbose=args.verbose)
    if args.batch_size is not None:
        kw["n_batch"] = args.batch_size
    if args.ubatch_size is not None:
        kw["n_ubatch"] = args.ubatch_size
    if args.threads:
        kw["n_threads"] = args.threads
    if plan.cfg is not None:
        kw["expert_pack"] = plan.cfg
    if getattr(args, "embedding", False):
        import llama_cpp
        kw["embedding"] = True
        if args.pooling is not None:
            kw["pooling_type"] = {"none": llama_cpp.LLAMA_POOLING_TYPE_NONE, "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                                  "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
                                  "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}[args.pooling]
    try:
        llm = Llama(**kw)
        if getattr(args, "parallel", 1) > 1:
            from .batch_engine import with_sequences
            with_sequences(llm, args.parallel)
        return llm
    except (ValueError, RuntimeError) as e:
        msg = flag_terms(str(e))
        if "Failed to create llama_context" in msg:
            msg += (f" (-c {args.ctx_size}, -b {args.batch_size or 'auto'}, -ub {args.ubatch_size or 'auto'}: too "
                    "large for the memory there is? "
                    "--verbose shows llama.cpp's log)")
        raise (ValueError if isinstance(e, ValueError) else RuntimeError)(msg) from None


def request_defaults(args) -> dict:
    """What a request that does not say gets: llama-server's flags, under the engine's names."""
    return {"n_predict": args.n_predict, "seed": args.seed, "temperature": args.temp, "top_k": args.top_k,
            "top_p": args.top_p, "min_p": args.min_p, "repeat_penalty": args.repeat_penalty}


def api_keys(args) -> tuple[str, ...]:
    """--api-key's comma-separated keys (empty ones dropped, as llama-server does)."""
    return tuple(k.strip() for k in (args.api_key or "").split(",") if k.strip())


def make_app(llm, model_path: str, alias: str | None = None, names: tuple[str, ...] = (), args=None,
             start_time: int | None = None):
    from .api import create_app
    from .engine import Engine
    n_parallel = getattr(args, "parallel", 1) if args is not None else 1
    if n_parallel > 1:
        from .batch_engine import BatchEngine
        engine = BatchEngine(llm, alias or Path(model_path).name, n_parallel)
    else:
        engine = Engine(llm, alias or Path(model_path).name)
    stats = (lambda: llm.expert_pack_stats()) if getattr(llm, "_expert_pack", None) is not None else None
    extra = {} if args is None else dict(defaults=request_defaults(args), api_keys=api_keys(args), webui=args.webui,
                                         slots=args.slots)
    return create_app(engine, model_path=model_path, stats=stats, names=names, start_time=start_time, **extra)


_log_lock = threading.Lock()


def _log(line: str) -> None:
    """One log line as one write under a lock: requests finish on several threads, and print() writes the text and
    its newline separately, which interleaves two lines into one."""
    with _log_lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class Gate:
    """The WSGI app waitress serves from the moment the port is bound: 503 while the model loads and once stopping,
    the API in between. Counts the requests in flight (a stop waits for them before freeing the model) and logs one
    line per request when its response is done."""

    def __init__(self):
        self.app = None
        self.engine = None
        self.stopping = False
        self.inflight = 0
        self.cv = threading.Condition()
        self.start_time = int(time.time())  # every response's Process-Start-Time-Unix

    def __call__(self, environ, start_response):
        t0 = time.perf_counter()
        seen: list[str] = []

        def sr(status, headers, exc_info=None):
            seen[:] = [status.split(" ", 1)[0]]
            return start_response(status, headers, exc_info)
        with self.cv:
            app = None if self.stopping else self.app
            if app is not None:
                self.inflight += 1
        if app is None:
            message = "Shutting down" if self.stopping else "Loading model"
            body = json.dumps({"error": {"code": 503, "message": message, "type": "unavailable_error"}}).encode()
            sr("503 Service Unavailable", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                           ("Retry-After", "1"),
                                           ("Process-Start-Time-Unix", str(self.start_time))])
            self._log(environ, seen, t0)
            return [body]
        done = threading.Lock()

        def finish():
            if done.acquire(blocking=False):
                self._log(environ, seen, t0)
                with self.cv:
                    self.inflight -= 1
                    self.cv.notify_all()
        try:
            it = app(environ, sr)
        except BaseException:
            finish()
            raise
        return _Closing(it, finish)

    def _log(self, environ, seen, t0) -> None:
        path = environ.get("PATH_INFO", "")
        status = seen[0] if seen else "-"
        if path == "/health" and status in ("200", "503"):
            return  # polled by every client and load balancer while it loads and after: noise
        ms = 1e3 * (time.perf_counter() - t0)
        line = f"request: {environ.get('REQUEST_METHOD', '')} {path} {environ.get('REMOTE_ADDR', '-')} {status} " \
               f"{ms:.1f} ms"
        usage = environ.get("expert_pack.usage")
        if usage is not None:
            n_prompt, result = usage
            line += f" prompt_tokens={n_prompt} completion_tokens={result.timings.predicted_n}"
        gone = environ.get("waitress.client_disconnected")
        if gone is not None and gone():
            line += " (client disconnected)"
        _log(line)

    def stop(self, timeout_s: float) -> bool:
        """Refuse new requests, cancel the generation, wait for the requests in flight; False if some still run."""
        with self.cv:
            self.stopping = True
        if self.engine is not None:
            self.engine.stop()
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while self.inflight and time.monotonic() < deadline:
                self.cv.wait(deadline - time.monotonic())
            return self.inflight == 0


class _Closing:
    """A response iterable that calls `on_close` after the server closes it (the response is done or abandoned)."""

    def __init__(self, it, on_close):
        self._it, self._on_close = it, on_close

    def __iter__(self):
        return iter(self._it)

    def close(self):
        try:
            close = getattr(self._it, "close", None)
            if close is not None:
                close()
        finally:
            self._on_close()


def bind(args, app):
    """Create the waitress server (binds and listens now), or ValueError naming --host / --port."""
    import waitress
    try:
        # channel_request_lookahead > 0 lets waitress tell a generation that its client has gone
        return waitress.create_server(app, host=args.host, port=args.port, threads=args.threads_http,
                                      channel_request_lookahead=5, ident="expert-pack",
                                      max_request_body_size=MAX_BODY)
    except socket.gaierror as e:
        raise ValueError(f"--host {args.host}: cannot resolve it ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {args.port}: {args.host}:{args.port} is already in use") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise ValueError(f"--port {args.port}: permission denied (ports below 1024 need privileges)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {args.host}: not an address of this machine") from None
        raise ValueError(f"--host {args.host} --port {args.port}: {e.strerror or e}") from None


def _leave(code: int) -> None:
    """Exit now, without freeing what another thread still uses."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_serve(args) -> int:
    plan = Plan(args, inspect=False)
    gate = Gate()
    server = bind(args, gate)
    plan.inspect()
    url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{args.port}/"
    what = f"{plan.model}" + (f" with pack {plan.pack}" if plan.pack is not None else "")

    wake = threading.Event()
    signals: list[str] = []

    def on_signal(signum, frame):
        if signals:  # the second one: leave at once
            _leave(130)
        signals.append(signal.Signals(signum).name)
        wake.set()
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, on_signal)

    _log(f"expert-pack serve: listening on {url}; loading {what} ...")
    threading.Thread(target=server.run, name="waitress-loop", daemon=True).start()

    loaded: dict = {}

    def loader():
        try:
            loaded["llm"] = load(args, plan)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            loaded["error"] = e
        wake.set()
    threading.Thread(target=loader, name="load", daemon=True).start()
    t0 = time.perf_counter()
    while not (signals or loaded):
        wake.wait(0.5)
        wake.clear()
    if signals and not loaded:
        _log(f"expert-pack serve: {signals[0]} while loading: stopped")
        _leave(0)  # the loader runs inside llama.cpp and cannot be interrupted; nothing is served yet
    if "error" in loaded:
        e = loaded["error"]
        if isinstance(e, (ValueError, RuntimeError, OSError)):
            raise e
        raise RuntimeError(f"loading failed: {type(e).__name__}: {e}")
    llm = loaded["llm"]
    names = tuple(n for n in (plan.model.name, str(plan.model), plan.pack.name if plan.pack else None) if n)
    app = make_app(llm, str(plan.model), plan.alias, names, args=args, start_time=gate.start_time)
    with gate.cv:
        gate.engine = app.config["engine"]
        gate.app = app
    if getattr(llm, "_expert_pack", None) is not None:  # how the cache was sized, and the batch for prompts
        _log(f"expert-pack serve: {llm._expert_pack.summary}; n_batch {llm.n_batch}, "
             f"n_ubatch {llm.context_params.n_ubatch}")
    _log(f"expert-pack serve: serving '{plan.alias}' ({what}) on {url} "
         f"(loaded in {time.perf_counter() - t0:.1f} s; Ctrl-C stops)")
    while not signals:
        wake.wait(1.0)
        wake.clear()
    if not gate.stop(STOP_WAIT_S):
        _log(f"expert-pack serve: {signals[0]}: {gate.inflight} request(s) still running after {STOP_WAIT_S:.0f} s; "
             "leaving without freeing the model")
        _leave(0)
    llm.close()  # frees the model, then the pack's provider (which writes the final --stats-file)
    _log(f"expert-pack serve: {signals[0]}: stopped")
    _leave(0)  # everything is written; the interpreter's own teardown would only add a few tenths of a second
    return 0
