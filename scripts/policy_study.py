#!/usr/bin/env python3
"""Policy study: for each routing setting of the generator (uniform, realistic, skewed), generate the
"routing"-shaped model (128 experts, top-8, 12 MoE layers), record its routing on the built-in prompts, and replay
the trace through LRU, LFU, our hybrid and Belady's optimum at several cache sizes.

    python3 scripts/policy_study.py OUT_DIR          # writes OUT_DIR/{SETTING}.npz, policy.json, policy.md, policy.png
"""
import json
import sys
import time
from pathlib import Path

from expert_pack_devtools import policy_sim, routing
from expert_pack_devtools.synth import SHAPES, RoutingConfig, SynthConfig, generate

SETTINGS = ("uniform", "realistic", "skewed")


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    results, md = {}, [f"Machine: {sys.platform}, date {time.strftime('%Y-%m-%d')}, command: "
                       f"`python3 scripts/policy_study.py {out}`", ""]
    for setting in SETTINGS:
        trace_path = out / f"{setting}.npz"
        if trace_path.exists():
            trace = routing.trace.RoutingTrace.load(trace_path)
        else:
            model = out / f"routing-{setting}.gguf"
            if not model.exists():
                cfg = SynthConfig.from_dict({**SHAPES["routing"], "routing": RoutingConfig.from_preset(setting)})
                generate(cfg, model, progress=False)
            trace = routing.capture(model, routing.PROMPTS)
            trace.save(trace_path)
            model.unlink()
        t0 = time.time()
        results[setting] = policy_sim.sweep(trace)
        n_tok = sum(e.shape[0] for e in trace.experts)
        label = f"{setting} routing ({n_tok} tokens x {len(trace.layers)} layers, {trace.n_expert} experts, top-" \
                f"{trace.experts[0].shape[2]})"
        md.append(policy_sim.markdown(results[setting], label))
        print(md[-1], f"({time.time() - t0:.1f} s)", flush=True)
    (out / "policy.json").write_text(json.dumps(results, indent=1))
    (out / "policy.md").write_text("\n".join(md))
    try:
        policy_sim.plot(results, out / "policy.png")
    except ImportError:
        print("no matplotlib: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "policy-study")))
