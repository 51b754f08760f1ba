"""The development subcommands of `expert-pack`: demo, synth, routing-stats, bench-client, policy-sim, bench. The
product's CLI (ggml_expert_pack/cli.py) registers them, in one place, when this package is installed."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_commands(sub) -> None:
    """Register the development subcommands on the `expert-pack` parser's subparsers."""
    add_demo(sub)
    add_synth(sub)
    add_routing_stats(sub)
    add_bench_client(sub)
    add_policy_sim(sub)
    from .bench.cli import add_bench
    add_bench(sub)


def _kv_list(text: str) -> dict[str, str]:
    """'gate=q4_k,down=q6_k' -> {'gate': 'q4_k', 'down': 'q6_k'}"""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


# ---------------------------------------------------------------------------------------------------------
# synth

SYNTH_FIELDS = {  # CLI flag -> SynthConfig field
    "layers": "n_layer", "embd": "n_embd", "heads": "n_head", "heads_kv": "n_head_kv", "head_dim": "head_dim",
    "experts": "n_expert", "experts_used": "n_expert_used", "ff_exp": "n_ff_exp", "ff": "n_ff",
    "dense_lead": "n_dense_lead", "shared_experts": "n_expert_shared", "hash_layers": "n_hash_layers",
    "mtp_layers": "n_mtp_layers", "expert_latent": "n_expert_latent", "ctx": "n_ctx_train",
    "expert_type": "expert_type", "weight_type": "weight_type", "embd_type": "embd_type", "seed": "seed",
    "vocab": "vocab", "name": "name",
}


def synth_config_from_args(args):
    from .synth import SHAPES, RoutingConfig, SynthConfig
    base: dict = {}
    if args.config:
        base.update(json.loads(Path(args.config).read_text()))
    if args.shape:
        base = {**SHAPES[args.shape], **base}
    if args.arch:
        base["arch"] = args.arch
    for flag, fld in SYNTH_FIELDS.items():
        v = getattr(args, flag)
        if v is not None:
            base[fld] = v
    if args.expert_types:
        base["expert_types"] = args.expert_types
    if args.layer_types:
        base["layer_expert_types"] = args.layer_types
    routing = base.pop("routing", {}) or {}
    preset = args.routing or routing.get("preset", "realistic")
    overrides = {k: getattr(args, k) for k in ("zipf", "context", "window", "layer_corr", "drift")}
    routing = {k: v for k, v in routing.items() if k != "preset"}
    routing.update({k: v for k, v in overrides.items() if v is not None})
    base["routing"] = RoutingConfig.from_preset(preset, **routing)
    return SynthConfig.from_dict(base)


def cmd_synth(args) -> int:
    from .synth import generate
    cfg = synth_config_from_args(args)
    if args.print_config:
        print(cfg.to_json())
        return 0
    paths = generate(cfg, args.out, shards=args.shards, progress=None if not args.quiet else False,
                     log=lambda m: print(m, file=sys.stderr))
    print(paths[0])
    return 0


def add_synth(sub) -> None:
    from .synth import ARCHS, SHAPES, RoutingConfig
    p = sub.add_parser("synth", help="write a synthetic MoE model (random weights, realistic routing) as GGUF",
                       description="Write a random-weight MoE model in a real llama.cpp architecture, with a real "
                       "tokenizer and configurable routing realism. Flags override --shape, which overrides --config.")
    p.add_argument("out", help="output .gguf (with --shards N: OUT-00001-of-0000N.gguf ...)")
    p.add_argument("--arch", choices=ARCHS, help="architecture (default qwen3moe)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a named shape (tiny, routing, 30b-a3b)")
    p.add_argument("--config", help="JSON file with SynthConfig fields")
    g = p.add_argument_group("shape")
    for flag, help_ in [("layers", "transformer blocks"), ("embd", "hidden size"), ("heads", "attention heads"),
                        ("heads_kv", "KV heads"), ("head_dim", "head size"), ("experts", "routed experts per layer"),
                        ("experts_used", "experts per token (top-k)"), ("ff_exp", "expert FFN width"),
                        ("ff", "dense FFN width"), ("dense_lead", "kimi-k3: leading dense layers"),
                        ("shared_experts", "deepseek4/kimi-k3: shared experts"),
                        ("hash_layers", "deepseek4: hash-routed first layers"),
                        ("mtp_layers", "deepseek4: MTP layers"), ("expert_latent", "kimi-k3: latent expert width"),
                        ("ctx", "training context length")]:
        g.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int, help=help_)
    t = p.add_argument_group("tensor types (ggml names: f16, bf16, q8_0, q4_k, q2_k, q3_k, q6_k, mxfp4, ...)")
    t.add_argument("--expert-type", help="routed experts (default q4_k)")
    t.add_argument("--expert-types", type=_kv_list, help="per role, e.g. gate=q4_k,up=q4_k,down=q6_k")
    t.add_argument("--layer-types", type=_kv_list, help="per layer, e.g. 0=q8_0,1=q2_k")
    t.add_argument("--weight-type", help="attention, shared experts, dense FFN (default f16)")
    t.add_argument("--embd-type", help="token embedding and output (default q8_0)")
    r = p.add_argument_group("routing realism (docs/SYNTH.md)")
    r.add_argument("--routing", choices=sorted(RoutingConfig.PRESETS), help="preset (default realistic)")
    for k in ("zipf", "context", "window", "layer_corr", "drift"):
        r.add_argument("--" + k.replace("_", "-"), dest=k, type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--vocab", help="vocab GGUF to take the tokenizer from (default: packaged qwen2)")
    p.add_argument("--name", help="general.name")
    p.add_argument("--shards", type=int, default=1, help="write llama.cpp split shards")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(func=cmd_synth)


# ---------------------------------------------------------------------------------------------------------
# routing-stats

def cmd_routing_stats(args) -> int:
    from . import routing
    prompts = None
    if args.prompts:
        prompts = [p for p in Path(args.prompts).read_text().split("\n\n") if p.strip()]
    trace = routing.capture(args.model, prompts or routing.PROMPTS, router_inputs=True, n_threads=args.threads)
    if args.save_trace:
        trace.save(args.save_trace)
    routers, select = routing.router_selector(args.model, trace.layers)
    stats = routing.stats.compute(trace, routers, select)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        n_tok = sum(e.shape[0] for e in trace.experts)
        print(f"{args.model}: {len(trace.layers)} MoE layers, {trace.n_expert} experts, "
              f"top-{trace.experts[0].shape[2]}, {n_tok} tokens from {len(trace.experts)} prompts")
        print(routing.stats.table(stats))
    return 0


def add_routing_stats(sub) -> None:
    p = sub.add_parser("routing-stats", help="measure a model's routing against the bands of real MoE models",
                       description="Teacher-force a fixed prompt set through the model (stock llama.cpp), record "
                       "the experts chosen per token and layer, and print the routing statistics of docs/SYNTH.md, 'Routing realism'.")
    p.add_argument("model", help="GGUF model (first shard of a split model)")
    p.add_argument("--prompts", help="text file, prompts separated by blank lines (default: built-in set)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: llama.cpp's)")
    p.add_argument("--save-trace", help="save the routing trace (.npz) for the policy simulator")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_routing_stats)


# ---------------------------------------------------------------------------------------------------------
# demo

def cmd_demo(args) -> int:
    """The product end to end on a small model: synthesize, pack, run with a cache that evicts, compare."""
    from ggml_expert_pack.packer import build

    from .synth import SHAPES, SynthConfig, generate
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = SynthConfig(arch="qwen3moe", **{**SHAPES["tiny"], "n_layer": 8, "n_expert": 32, "n_expert_used": 4,
                                          "name": "expert-pack demo"})
    model, pack = d / "demo-qwen3moe.gguf", d / "demo-qwen3moe.pack"
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if not model.exists():
        say(f"1. synthesizing a small MoE model (qwen3moe, {cfg.n_layer} layers x {cfg.n_expert} experts, "
            f"top-{cfg.n_expert_used}, random weights) -> {model}")
        generate(cfg, model, progress=False)
    else:
        say(f"1. model: {model}")
    if not (pack / "manifest.json").exists():
        say(f"2. packing it: every routed expert as one 4096-aligned block -> {pack}/")
        build(model, pack, force=True, progress=False, log=lambda m: None)
    else:
        say(f"2. pack: {pack}/")
    from llama_cpp import Llama
    slots = max(cfg.n_expert_used + 1, cfg.n_expert // 4)
    from .lossless import cache_mib_for_slots
    cache_mib = cache_mib_for_slots(pack, slots)
    say(f"3. running {pack}/trunk.gguf with experts streamed from the pack (O_DIRECT) into a cache of "
        f"{cache_mib:.2f} MiB: {slots} of {cfg.n_expert} experts per layer, so it evicts")
    llm = Llama(model_path=str(pack / "trunk.gguf"), expert_pack={"pack_dir": str(pack), "cache_vram_mib": cache_mib},
                n_ctx=512, verbose=False, seed=0)
    say("   " + llm._expert_pack.summary)
    t0 = time.perf_counter()
    out = llm(args.prompt, max_tokens=args.tokens, temperature=0)
    dt = time.perf_counter() - t0
    st = llm.expert_pack_stats()
    text, n = out["choices"][0]["text"], out["usage"]["completion_tokens"]
    llm.close()
    say("4. the same prompt through stock llama.cpp on the original GGUF (every expert in memory)")
    ref = Llama(model_path=str(model), n_ctx=512, verbose=False, seed=0)
    ref_text = ref(args.prompt, max_tokens=args.tokens, temperature=0)["choices"][0]["text"]
    ref.close()
    same = ref_text == text
    print(f"prompt:      {args.prompt!r}")
    print(f"completion:  {text!r}  (random weights: gibberish by design)")
    print(f"speed:       {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s (prompt included)")
    print(f"cache:       hit rate {st['hit_rate']:.3f} ({st['cache_hits']} hits, {st['cache_misses']} misses, "
          f"{st['cache_evictions']} evictions), {st['pack_read_bytes'] / max(n, 1) / 1e6:.2f} MB read from the "
          f"pack per token")
    print(f"lossless:    {'identical to' if same else 'DIFFERENT FROM'} stock llama.cpp's output on the original")
    return 0 if same else 1


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the product on a small model: synthesize, pack, run with an evicting cache, "
                       "compare with stock llama.cpp",
                       description="Synthesize a small MoE model (once), build its expert pack, generate with the "
                       "experts streamed from the pack into a cache that holds a quarter of them, and print the text, "
                       "tok/s, hit rate, MB read per token and whether the output equals stock llama.cpp's on the "
                       "original. Exit 1 if it does not.")
    p.add_argument("--dir", default="models", help="where the demo model and pack live (default ./models)")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.set_defaults(func=cmd_demo)


def add_bench_client(sub) -> None:
    p = sub.add_parser("bench-client", help="run the reference workload (10 fixed requests) against a "
                       "llama-server-compatible endpoint; JSON, Markdown table, PNG plot",
                       description="Send the reference workload (5 Alpaca-style and 5 MMLU-style prompts) one at "
                       "a time to URL/completion at temperature 0 with EOS ignored; report mean prefill and decode "
                       "tok/s per dataset from the server's timings, and for an expert-pack server the hit rate and "
                       "SSD bytes per generated token. Writes OUT/SYSTEM.json, and OUT/table.md and OUT/rates.png "
                       "over every JSON in OUT.")
    p.add_argument("url", help="base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--system", required=True, help="name of the system under test (file name of its JSON)")
    p.add_argument("--out", default="bench-results", help="results folder (default ./bench-results)")
    p.add_argument("--n-predict", type=int, default=200, help="tokens generated per request (default 200)")
    p.add_argument("--budget-s", type=float, default=3600.0,
                   help="seconds for the whole run; requests not started by then are skipped (default 3600)")
    p.add_argument("--baseline", help="system whose rates the table divides by")

    def run(args):
        from .bench_client import main_run
        return main_run(args)
    p.set_defaults(func=run)


def add_policy_sim(sub) -> None:
    p = sub.add_parser("policy-sim", help="replay routing traces through LRU, LFU, our hybrid, A0 and Belady's optimum",
                       description="Replay routing traces (saved by `routing-stats --save-trace`, or recorded by the "
                       "runtime with the expert_pack key trace_path) through the cache policies, one cache per MoE "
                       "layer, at cache sizes given as fractions of a layer's experts. A0 evicts the expert least used "
                       "over the whole trace (popularity known in advance); Belady the one used again farthest in the "
                       "future (the optimum).")
    p.add_argument("traces", nargs="*", help=".npz routing traces (routing-stats --save-trace)")
    p.add_argument("--trace", action="append", default=[], metavar="FILE", dest="runtime_traces",
                   help="a routing trace recorded by the runtime (trace_path; docs/FORMAT.md), replayed step by "
                        "step; may be given several times")
    p.add_argument("--fractions", default="0.1,0.14,0.25,0.5",
                   help="cache sizes as fractions of a layer's experts (default 0.1,0.14,0.25,0.5)")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--json", action="store_true")

    def run(args):
        from . import policy_sim
        from .routing.trace import RoutingTrace, StepTrace
        if not args.traces and not args.runtime_traces:
            raise ValueError("no trace: give .npz traces and/or --trace FILE")
        try:
            fractions = tuple(float(x) for x in args.fractions.split(","))
        except ValueError:
            raise ValueError(f"--fractions: not a comma-separated list of numbers: {args.fractions!r}") from None
        if not all(0 < f <= 1 for f in fractions):
            raise ValueError("--fractions must lie in (0, 1]")
        traces = [(t, RoutingTrace.load(t)) for t in args.traces] + [(t, StepTrace.load(t)) for t in args.runtime_traces]
        results = {Path(t).stem: policy_sim.sweep(tr, fractions) for t, tr in traces}
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            for label, rows in results.items():
                print(policy_sim.markdown(rows, label))
        if args.plot:
            policy_sim.plot(results, args.plot)
        return 0
    p.set_defaults(func=run)
