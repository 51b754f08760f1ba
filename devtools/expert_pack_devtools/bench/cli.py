"""`expert-pack bench` (also `python -m expert_pack_devtools.bench`): list, show, run, report, tables."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_MODEL = Path("/tmp/ep-bench/30b-a3b.gguf")
DEFAULT_PACK = Path("/tmp/ep-bench/30b-a3b.pack")


def _question(args) -> dict:
    from . import harness
    q = harness.load_question(args.question)
    if getattr(args, "set", None):
        q["workload"] = harness.override(q["workload"], args.set)
    return q


def cmd_list(args) -> int:
    from . import harness
    print("questions:")
    for n in harness.question_names():
        print(f"  {n:24s} {harness.load_question(n)['question']}")
    print("systems:")
    for n in harness.system_names():
        s = harness.load_system(n)
        print(f"  {n:42s} {s['description']}" + (f" (formerly ({s['formerly']}))" if s.get("formerly") else ""))
    return 0


def cmd_show(args) -> int:
    from . import harness
    q = _question(args)
    print(json.dumps({k: v for k, v in q.items() if k != "path"}, indent=1))
    return 0


def cmd_run(args) -> int:
    from . import harness
    if args.prepare_only:
        harness.prepare(_question(args), args.model, args.pack)
        return 0
    systems = [s for s in args.systems.split(",") if s] if args.systems else None
    return harness.run(_question(args), args.out, args.model, args.pack, systems, dry_run=args.dry_run)


def cmd_report(args) -> int:
    from . import harness
    print(harness.write_report(args.dir), end="")
    return 0


def cmd_tables(args) -> int:
    from . import tables
    doc = args.doc or tables.DEFAULT_DOC
    return tables.tables(doc, check=args.check)


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="the benchmark harness: run a question's systems under a RAM cap, report",
                       description="Benchmarks by question (docs/BENCHMARKS.md): a question names systems (one JSON "
                       "file each, every flag written out), a baseline, metrics and a workload. `run` starts each "
                       "system in turn inside a cgroup v2 RAM cap, sends the reference workload and writes one JSON "
                       "per system with the commit, the machine, the date and the resolved configuration; `report` "
                       "turns a results folder into Markdown.")
    bs = p.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    a = bs.add_parser("list", help="the questions and systems")
    a.set_defaults(func=cmd_list)
    a = bs.add_parser("show", help="a question with its systems, as resolved from the files")
    a.add_argument("question", help="question name (questions/NAME.json) or path to a question file")
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a workload field")
    a.set_defaults(func=cmd_show)
    a = bs.add_parser("run", help="run a question: one JSON per system in --out, then report.md")
    a.add_argument("question", help="question name (questions/NAME.json) or path to a question file")
    a.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help=f"the original GGUF, generated with the workload's shape if missing (default {DEFAULT_MODEL})")
    a.add_argument("--pack", type=Path, default=DEFAULT_PACK, help=f"its pack, built if missing (default {DEFAULT_PACK})")
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a workload field (recorded with the results), e.g. budget_s=90")
    a.add_argument("--out", type=Path, required=True, help="results folder")
    a.add_argument("--systems", help="comma-separated subset of the question's systems, in this order")
    a.add_argument("--dry-run", action="store_true",
                   help="print every system's command line and write OUT/plan.json; start nothing")
    a.add_argument("--prepare-only", action="store_true",
                   help="generate the benchmark model and pack it where missing, then stop")
    a.set_defaults(func=cmd_run)
    a = bs.add_parser("report", help="OUT/report.md, table.md and rates.png from a results folder")
    a.add_argument("dir", type=Path, help="results folder of `bench run`")
    a.set_defaults(func=cmd_report)
    a = bs.add_parser("tables", help="regenerate docs/BENCHMARKS.md's tables from the raw results they name",
                      description="Every table between '<!-- table KIND: results/PATH[,PATH...] -->' and "
                      "'<!-- end table -->' is recomputed from the raw files it names (paths relative to the document) "
                      "and the region rewritten. --check rewrites nothing and exits 1 naming the tables that differ.")
    a.add_argument("doc", type=Path, nargs="?", help="the Markdown file (default: docs/BENCHMARKS.md of this checkout)")
    a.add_argument("--check", action="store_true", help="only compare; exit 1 if a table differs from its raw results")
    a.set_defaults(func=cmd_tables)


def main(argv: list[str] | None = None) -> int:
    """Standalone: the same commands as `expert-pack bench`, errors as one line."""
    import sys
    ap = argparse.ArgumentParser(prog="python -m expert_pack_devtools.bench")
    add_bench(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2
