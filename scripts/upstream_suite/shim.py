"""The executable llama.cpp's server test suite starts as `llama-server` (LLAMA_SERVER_BIN_PATH) for the fork's two
servers; scripts/upstream_server_suite.py writes a one-line wrapper that runs this file with the paths baked in.

--mode fork: the fork's llama-server with the pack. `--model MODEL` (a synthetic model the suite's servers get,
ep_upstream_plugin.py; --map MODEL=PACK names its pack) becomes `--model PACK/trunk.gguf --expert-pack PACK` plus an
expert cache of --cache-mib (small enough to evict); every other flag passes through. Without a mapped `--model`
(a router server) nothing is added.

--mode serve: `expert-pack serve PACK` with the same cache, and llama-server's flags as they are, except the few below
that serve has no counterpart for and whose absence does not change what a request can observe beyond what the tests
check themselves (each test's own assertions then say whether serve behaves as llama-server does). One of these that
serve does accept (--keep FLAG: the runner reads serve's --help) passes through. Any other flag
serve does not implement passes through, and serve refuses it by name: that test fails at server start.
LLAMA_ARG_THREADS (which the runner sets for all three servers) becomes serve's --threads.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

# flag -> why serve drops it
SERVE_DROPPED = {
    "--offline": "serve never downloads",
    "--cont-batching": "serve runs one generation at a time; later requests wait in arrival order",
    "--jinja": "serve always renders the model's chat template with Jinja2",
    "--no-jinja": "serve always renders the model's chat template with Jinja2",
}
# flag with a value -> why serve drops it
SERVE_DROPPED_WITH_VALUE = {
    "--parallel": "a serve without --parallel has one slot; requests beyond it wait (a test that counts slots fails "
                  "on its own assertion)",
}


def _pack_of(path: str, packs: dict[str, str]) -> str | None:
    real = os.path.realpath(path)
    return next((p for m, p in packs.items() if os.path.realpath(m) == real), None)


def fork_argv(args: list[str], bin_path: str, packs: dict[str, str], cache_mib: str) -> list[str]:
    """`packs`: model path -> its pack folder."""
    out, pack = [], None
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--model", "-m") and i + 1 < len(args) and _pack_of(args[i + 1], packs):
            pack = _pack_of(args[i + 1], packs)
            out += [a, os.path.join(pack, "trunk.gguf")]
            i += 2
            continue
        out.append(a)
        i += 1
    if pack:
        out += ["--expert-pack", pack, "--expert-cache-mib", cache_mib, "--expert-cache-reserve-mib", "0"]
    return [bin_path, *out]


def serve_argv(args: list[str], bin_path: str, packs: dict[str, str], cache_mib: str,
               keep: frozenset[str] = frozenset()) -> list[str]:
    """`keep`: flags of SERVE_DROPPED* that this serve accepts (they pass through)."""
    out, positional = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a in SERVE_DROPPED and a not in keep:
            i += 1
        elif a in SERVE_DROPPED_WITH_VALUE and a not in keep:
            i += 2
        elif a in ("--model", "-m") and i + 1 < len(args):
            if pack := _pack_of(args[i + 1], packs):
                positional = [pack, "--cache-mib", cache_mib, "--cache-reserve-mib", "0"]
            else:
                out += [a, args[i + 1]]
            i += 2
        else:
            out.append(a)
            i += 1
    # the runner sets the servers' threads with llama-server's environment variable; serve takes the flag
    if os.environ.get("LLAMA_ARG_THREADS") and not {"-t", "--threads"} & set(out):
        out += ["--threads", os.environ["LLAMA_ARG_THREADS"]]
    return [bin_path, "serve", *positional, *out]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fork", "serve"], required=True)
    p.add_argument("--bin", required=True)
    p.add_argument("--map", action="append", required=True, metavar="MODEL=PACK")
    p.add_argument("--cache-mib", required=True)
    p.add_argument("--keep", action="append", default=[], metavar="FLAG")
    ns = p.parse_args(argv[:split])
    packs = dict(m.split("=", 1) for m in ns.map)
    if ns.mode == "fork":
        cmd = fork_argv(argv[split + 1:], ns.bin, packs, ns.cache_mib)
    else:
        cmd = serve_argv(argv[split + 1:], ns.bin, packs, ns.cache_mib, frozenset(ns.keep))
    print(f"shim ({ns.mode}): {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
