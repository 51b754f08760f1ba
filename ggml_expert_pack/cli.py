"""The `expert-pack` command."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from . import __version__


# ---------------------------------------------------------------------------------------------------------
# build / verify / inspect

def cmd_build(args) -> int:
    from .packer import build
    res = build(args.model, args.out, force=args.force, progress=False if args.quiet else None,
                log=lambda m: print(m, file=sys.stderr))
    print(res.pack_dir)
    return 0


def add_build(sub) -> None:
    p = sub.add_parser("build", help="pack a GGUF model: expert pack + manifest + trunk GGUF",
                       description="Rewrite every routed expert of MODEL as one contiguous 4096-aligned block in "
                       "DIR/experts.pack, describe them in DIR/manifest.json, and write everything else to "
                       "DIR/trunk.gguf. Afterwards the original GGUF is no longer needed. docs/FORMAT.md. A source "
                       "that stock llama.cpp would refuse or abort on (a tensor type its op cannot take, a type "
                       "whose block does not divide the row, hyperparameters out of range) is refused, naming "
                       "the tensor or key (exit 2); nothing is written.")
    p.add_argument("model", help="GGUF model, or the first shard (NAME-00001-of-0000N.gguf) of a split one")
    p.add_argument("-o", "--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="replace an existing pack in the output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_build)


def cmd_verify(args) -> int:
    from .packer import verify
    from .packer.format import check_pack_dir
    from .packer.verify import VerifyError
    check_pack_dir(args.pack)  # a path that is not a pack directory is bad input (exit 2), not a failed check
    try:
        rep = verify(args.pack, quick=args.quick, progress=False if args.quiet else None)
    except VerifyError as e:
        print(f"{args.pack}: FAILED: {e}", file=sys.stderr)
        return 1
    what = "structure and identities" if args.quick else f"{rep.blocks_checked} blocks and the trunk"
    print(f"{args.pack}: OK ({rep.n_layers} layers x {rep.n_experts} experts; checked {what}; pack {rep.pack_id})")
    return 0


def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check a pack: structure, alignment, every checksum, the trio belongs together",
                       description="Exit 0 if DIR is a complete, intact expert pack; otherwise exit 1 naming the "
                       "first problem (e.g. the first bad block). Checked: every manifest field (presence, type, "
                       "range), the digests, the layout against the packer's, the pack header (reserved bytes "
                       "included), the trunk's header, tensor types and hyperparameters, and (without --quick) "
                       "every block's checksum and zero padding and the trunk's checksum. A path that is not a "
                       "pack directory: exit 2.")
    p.add_argument("pack", help="pack directory")
    p.add_argument("--quick", action="store_true", help="structure and identities only, no data read")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)


def cmd_inspect(args) -> int:
    from .packer.format import check_pack_dir
    from .packer.inspect import render, summary
    check_pack_dir(args.pack)
    s = summary(args.pack)
    print(json.dumps(s, indent=2) if args.json else render(s))
    return 0


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show what a pack holds: layers, experts, types, sizes, source, hashes",
                       description="Show what DIR holds: MoE layers, experts and top-k, expert types and sizes, "
                       "strides, the source, hashes, and the expert cache sizes (minimum, suggested, all resident). "
                       "The pack is checked first as verify --quick checks it; a pack that fails is refused with "
                       "verify's message (exit 2).")
    p.add_argument("pack", help="pack directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)


# ---------------------------------------------------------------------------------------------------------
# development tooling: the one place the product reaches into it

DEV_PACKAGE = "expert_pack_devtools"  # source folder devtools/expert_pack_devtools/ (pyproject.toml)


def add_dev_commands(sub) -> bool:
    """demo, synth, routing-stats, bench-client, policy-sim and bench live in the development tooling package, which
    the wheel ships beside this one; they are registered when it is installed (only then is it imported)."""
    if importlib.util.find_spec(DEV_PACKAGE) is None:
        return False
    importlib.import_module(DEV_PACKAGE + ".cli").add_commands(sub)
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="expert-pack", description="Run MoE models larger than GPU memory by "
                                 "streaming routed experts from an SSD expert pack.")
    ap.add_argument("--version", action="version", version=f"expert-pack {__version__} (llama_cpp: patched "
                    f"llama-cpp-python 0.3.36 with llama.cpp 0c1e570)")
    ap.add_argument("--debug", action="store_true", help="on an error, show the Python traceback too")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_build(sub)
    add_verify(sub)
    add_inspect(sub)
    from .server.main import add_serve
    add_serve(sub)
    if add_dev_commands(sub):
        ap.epilog = (f"demo, synth, routing-stats, bench-client, policy-sim and bench are development tooling (the "
                     f"{DEV_PACKAGE} package).")
    for tool in ("llama-server", "llama-cli", "llama-bench"):  # listed for --help; main() passes them through
        sub.add_parser(tool, add_help=False, help=f"the fork's {tool} (takes --expert-pack DIR and the --expert-* "
                       f"flags; everything after it goes to {tool})")
    return ap


def _one_line(e: BaseException) -> str:
    """An exception as one line: the message (OSError: file and reason), never a traceback."""
    if isinstance(e, OSError) and e.strerror:
        msg = f"{e.filename}: {e.strerror}" if e.filename is not None else e.strerror
    else:
        msg = str(e) or type(e).__name__
        if not isinstance(e, (ValueError, RuntimeError, OSError)):  # not a refusal we raise: say what it was
            msg = f"{type(e).__name__}: {msg} (--debug shows where)"
    return " ".join(msg.split())


def main(argv: list[str] | None = None) -> int:
    from .tools import TOOLS, exec_tool
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = bool(argv) and argv[0] == "--debug"
    if debug and len(argv) > 1 and argv[1] in TOOLS:
        argv = argv[1:]
    if argv and argv[0] in TOOLS:  # the fork's own tools take their own flags: pass everything through
        try:
            exec_tool(argv[0], argv[1:])
        except (ValueError, FileNotFoundError, OSError) as e:
            if debug:
                raise
            print(f"expert-pack {argv[0]}: error: {_one_line(e)}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"expert-pack {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # bad input ends in one line; --debug shows the traceback
        if args.debug:
            raise
        print(f"expert-pack {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
