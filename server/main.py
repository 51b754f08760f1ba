"""`expert-pack serve`: load a model (with or without an expert pack) and serve it over HTTP with waitress,
wherever llama-server would be used (same flags for the common options, same /completion and /metrics)."""
from __future__ import annotations

import sys
from pathlib import Path


def add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over HTTP: OpenAI /v1 endpoints, llama-server's /completion, a chat page",
        description="Serve a model over HTTP, a drop-in for llama-server: /v1/chat/completions, /v1/completions, "
                    "/v1/models, /completion (with timings), /tokenize, /detokenize, /health, /props, /metrics, "
                    "and a chat page at /. One generation runs at a time; others wait in arrival order.")
    p.add_argument("-m", "--model", required=True, help="GGUF model: a pack's trunk.gguf, or the original model")
    p.add_argument("--expert-pack", metavar="DIR", help="expert pack directory: stream routed experts from it")
    # each flag also under the fork's llama-server spelling (--expert-cache-mib, ...), so that one command line
    # serves with either server
    g = p.add_argument_group("expert cache (with --expert-pack)")
    g.add_argument("--cache-mib", "--expert-cache-mib", dest="cache_mib", type=float, metavar="MIB",
                   help="expert cache budget in MiB (default: all free memory less the reserve)")
    g.add_argument("--cache-reserve-mib", "--expert-cache-reserve-mib", dest="cache_reserve_mib", type=float,
                   metavar="MIB", help="memory left free for the rest of the model and compute buffers (default 1024)")
    g.add_argument("--ram-cache-mib", "--expert-ram-cache-mib", dest="ram_cache_mib", type=float, metavar="MIB",
                   help="host-RAM tier of whole experts between the pack and the cache, in MiB (pinned on a GPU: "
                        "leave the OS, the model and the page cache room; default 0 = off)")
    g.add_argument("--stage-slots", "--expert-stage-slots", dest="stage_slots", type=int, metavar="N",
                   help="pinned staging buffers for pack reads")
    g.add_argument("--read-splits", "--expert-read-splits", dest="read_splits", type=int, metavar="N",
                   help="parallel reads per expert")
    g.add_argument("--read-threads", "--expert-read-threads", dest="read_threads", type=int, metavar="N",
                   help="threads reading a step's missed experts concurrently (default 4)")
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
                   help="write the expert-pack counters to this JSON file")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1,
                   help="layers offloaded to the GPU (-1 = all, the default; ignored on a CPU build)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="logical batch size for the prompt (default 512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for generation (default: auto)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--alias", help="model name reported by /v1/models and accepted in requests "
                                   "(default: the model file's name)")
    p.add_argument("--threads-http", type=int, default=8,
                   help="HTTP worker threads; requests beyond the one generating wait in order (default 8)")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's own logging")
    p.set_defaults(func=cmd_serve)


def pack_config(args) -> dict | None:
    if not args.expert_pack:
        for flag in ("cache_mib", "cache_reserve_mib", "ram_cache_mib", "stage_slots", "read_splits", "read_threads",
                     "direct_io", "ram_tier_mode", "prefetch", "stats_file"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --expert-pack")
        return None
    cfg: dict = {"pack_dir": args.expert_pack}
    for flag, key in (("cache_mib", "cache_vram_mib"), ("cache_reserve_mib", "cache_vram_reserve_mib"),
                      ("ram_cache_mib", "ram_cache_mib"),
                      ("stage_slots", "stage_slots"), ("read_splits", "read_splits"),
                      ("read_threads", "read_threads"), ("ram_tier_mode", "ram_tier_mode"),
                      ("stats_file", "stats_path")):
        v = getattr(args, flag)
        if v is not None:
            cfg[key] = v
    if args.direct_io is not None:
        cfg["direct_io"] = args.direct_io == "on"
    if args.prefetch is not None:
        cfg["prefetch"] = args.prefetch == "on"
    return cfg


def load(args):
    from llama_cpp import Llama
    if not Path(args.model).is_file():
        raise FileNotFoundError(f"--model {args.model}: no such file")
    kw = dict(model_path=args.model, n_ctx=args.ctx_size, n_batch=args.batch_size, n_gpu_layers=args.n_gpu_layers,
              verbose=args.verbose)
    if args.threads:
        kw["n_threads"] = args.threads
    cfg = pack_config(args)
    if cfg is not None:
        kw["expert_pack"] = cfg
    return Llama(**kw)


def make_app(llm, model_path: str, alias: str | None = None):
    from .api import create_app
    from .engine import Engine
    engine = Engine(llm, alias or Path(model_path).name)
    stats = (lambda: llm.expert_pack_stats()) if getattr(llm, "_expert_pack", None) is not None else None
    return create_app(engine, model_path=model_path, stats=stats)


def cmd_serve(args) -> int:
    import waitress
    llm = load(args)
    app = make_app(llm, args.model, args.alias)
    print(f"expert-pack serve: {args.model} as '{args.alias or Path(args.model).name}'"
          f"{' with pack ' + args.expert_pack if args.expert_pack else ''} on http://{args.host}:{args.port}/",
          file=sys.stderr, flush=True)
    # channel_request_lookahead > 0 lets waitress tell a generation that its client has gone
    waitress.serve(app, host=args.host, port=args.port, threads=args.threads_http, channel_request_lookahead=5,
                   ident="expert-pack", _quiet=not args.verbose)
    return 0
