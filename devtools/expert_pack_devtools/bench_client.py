"""The reference workload against any llama-server-compatible endpoint (stock llama-server, `expert-pack serve`,
the fork's llama-server): 10 fixed requests — 5 Alpaca-style, 5 MMLU-style — sent one at a time to `/completion`
at temperature 0 with EOS ignored. Rates come from the server's own `timings`; for a server that exposes
`expert_pack_*` counters on /metrics, the hit rate and SSD bytes per generated token come from their deltas;
requests are streamed and the counters read again when the first token arrives, so the decode phase's hit rate
and bytes per token are reported apart from the prompt's (exact when a token takes longer than a /metrics round
trip, as it does on any model worth streaming; on a toy model the phases blur).

A budget (tokens per request, seconds in all) lets a slow system report rates over what it completed.
Only the standard library is needed to measure (the GPU machine lacks most packages); plots need matplotlib.
"""
from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ALPACA = [
    ("toy-story", "Summarize the movie \"Toy Story\" in a few sentences."),
    ("activity", "Suggest a fun activity for a child who has a pencil, paper and markers."),
    ("translate", "Translate the following sentence into English: \"El sol no brilla hoy.\""),
    ("ai-bias", "Give an example of bias in an AI algorithm and explain how it arises."),
    ("dish", "Design a restaurant dish using salmon, avocado and spinach. Describe it."),
]
MMLU = [
    ("abstract-algebra", "Find the maximum possible order for an element of S_10.",
     ["6", "12", "30", "105"]),
    ("moral-disputes", "Hardin's \"ratchet effect\" refers to which consequence of giving food aid to poor "
     "countries?", ["It lets populations grow past what the land can feed, so each famine is larger",
                    "It raises food prices in donor countries", "It makes recipient governments corrupt",
                    "It lowers the quality of donated food over time"]),
    ("macroeconomics", "Which of the following best describes the crowding-out effect of government borrowing?",
     ["Higher interest rates reduce private investment", "Lower taxes raise consumption",
      "Higher government spending raises imports", "A larger money supply raises prices"]),
    ("professional-law", "A landowner excavates near the boundary of her lot and the neighbour's land subsides. "
     "Under the right to lateral support, which is most likely correct?",
     ["The landowner is strictly liable for subsidence of land in its natural state",
      "The neighbour has no claim unless the excavation was negligent in all cases",
      "The neighbour may recover only for damage to buildings",
      "The landowner is liable only if she knew of the subsidence risk"]),
    ("jurisprudence", "Which is the strongest argument against the claim that ethical relativism is hostile to "
     "human rights?", ["Relativism can itself value tolerance, which supports rights",
                       "Human rights are universally accepted", "Relativism is logically incoherent",
                       "Rights are legal, not moral, claims"]),
]


def requests() -> list[tuple[str, str, str]]:
    """(dataset, name, prompt) for the 10 fixed requests, in the order sent: the two datasets alternate, so that a
    system stopped by its budget still reports both."""
    alpaca = [("alpaca", name, f"### Instruction:\n{text}\n\n### Response:\n") for name, text in ALPACA]
    mmlu = []
    for name, q, opts in MMLU:
        letters = "\n".join(f"{'ABCD'[i]}. {o}" for i, o in enumerate(opts))
        mmlu.append(("mmlu", name, f"Question: {q}\n{letters}\nGive the answer letter and a short explanation.\n"
                                   "Answer:"))
    return [r for pair in zip(alpaca, mmlu) for r in pair]


@dataclass
class RequestResult:
    dataset: str
    name: str
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    wall_s: float = 0.0
    cache_hits: int | None = None        # the whole request (prefill and decode)
    cache_misses: int | None = None
    pack_read_bytes: int | None = None
    decode_hits: int | None = None       # from the first streamed token to the end: the decode phase
    decode_misses: int | None = None
    decode_read_bytes: int | None = None
    error: str | None = None


@dataclass
class Report:
    system: str
    url: str
    date: str
    n_predict: int
    budget_s: float
    completed: int = 0
    skipped: int = 0
    results: list[RequestResult] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def free_port() -> int:
    """A free TCP port on localhost, for a server about to start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc, timeout_s: float) -> bool:
    """Poll base/health until it answers 200 (True), or until `proc` (a subprocess.Popen starting the server)
    exits or `timeout_s` passes (False)."""
    deadline = time.time() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.2)


def pack_counters(base: str) -> dict | None:
    """expert_pack_* counters from /metrics, or None when the server has none (stock llama-server)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("expert_pack_") and not line.startswith("#"):
            name, _, value = line.partition(" ")
            out[name.removeprefix("expert_pack_").removesuffix("_total")] = float(value)
    return out or None


def _stream_completion(url: str, body: dict, timeout: float, on_first_token) -> dict:
    """POST a streamed /completion; call on_first_token() when the first token arrives (prefill is over) and
    return the final chunk (the one with `timings`)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    last, first = None, True
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if first:
                first = False
                on_first_token()
            last = chunk
            if chunk.get("stop"):
                break
    if last is None or "timings" not in last:
        raise ValueError("the stream ended without timings")
    return last


def run(base: str, system: str, n_predict: int = 200, budget_s: float = 3600.0, timeout_s: float = 3600.0,
        log=print) -> Report:
    """Send the workload. Requests are streamed so that the expert-pack counters can be read when the first token
    arrives: what was read for the prompt and what was read while decoding are reported apart."""
    base = base.rstrip("/")
    rep = Report(system=system, url=base, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), n_predict=n_predict,
                 budget_s=budget_s)
    t_start = time.time()
    for dataset, name, prompt in requests():
        left = budget_s - (time.time() - t_start)
        if left <= 0:
            rep.skipped += 1
            continue
        before = pack_counters(base)
        mid: list = []
        r = RequestResult(dataset, name)
        t0 = time.time()
        try:
            out = _stream_completion(base + "/completion", {"prompt": prompt, "n_predict": n_predict,
                                                            "temperature": 0, "ignore_eos": True,
                                                            "cache_prompt": False},
                                     timeout=min(timeout_s, max(left, 1.0)),
                                     on_first_token=lambda: mid.append(pack_counters(base) if before else None))
            t = out["timings"]
            r.prompt_n, r.prompt_ms = int(t["prompt_n"]), float(t["prompt_ms"])
            r.predicted_n, r.predicted_ms = int(t["predicted_n"]), float(t["predicted_ms"])
            rep.completed += 1
        except (urllib.error.URLError, OSError, KeyError, ValueError, TypeError) as e:
            r.error = f"{type(e).__name__}: {e}"
        r.wall_s = time.time() - t0
        after = pack_counters(base)
        if before and after:
            r.cache_hits = int(after.get("cache_hits", 0) - before.get("cache_hits", 0))
            r.cache_misses = int(after.get("cache_misses", 0) - before.get("cache_misses", 0))
            r.pack_read_bytes = int(after.get("pack_read_bytes", 0) - before.get("pack_read_bytes", 0))
            if mid and mid[0]:
                r.decode_hits = int(after.get("cache_hits", 0) - mid[0].get("cache_hits", 0))
                r.decode_misses = int(after.get("cache_misses", 0) - mid[0].get("cache_misses", 0))
                r.decode_read_bytes = int(after.get("pack_read_bytes", 0) - mid[0].get("pack_read_bytes", 0))
        rep.results.append(r)
        log(f"{system} {dataset}/{name}: " + (r.error or f"prefill {r.prompt_n} tok {_rate(r.prompt_n, r.prompt_ms):.1f} "
            f"tok/s, decode {r.predicted_n} tok {_rate(r.predicted_n, r.predicted_ms):.2f} tok/s"))
    rep.summary = summarize(rep.results)
    return rep


def _rate(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


def summarize(results: list[RequestResult]) -> dict:
    """Per dataset and overall: mean prefill and decode tok/s over completed requests, hit rate and SSD bytes
    per generated token (pack servers only)."""
    out = {}
    for ds in ("alpaca", "mmlu", "all"):
        rs = [r for r in results if r.error is None and (ds == "all" or r.dataset == ds)]
        if not rs:
            continue
        row = {"requests": len(rs),
               "prefill_tok_s": sum(_rate(r.prompt_n, r.prompt_ms) for r in rs) / len(rs),
               "decode_tok_s": sum(_rate(r.predicted_n, r.predicted_ms) for r in rs) / len(rs),
               "predicted_tokens": sum(r.predicted_n for r in rs)}
        if all(r.cache_hits is not None for r in rs):
            hits, misses = sum(r.cache_hits for r in rs), sum(r.cache_misses for r in rs)
            row["hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
            # all bytes read for these requests (prefill included) over the tokens they generated
            row["ssd_bytes_per_token_all"] = sum(r.pack_read_bytes for r in rs) / max(1, row["predicted_tokens"])
            row["ssd_bytes_per_token"] = row["ssd_bytes_per_token_all"]
        if all(r.decode_hits is not None for r in rs):
            hits, misses = sum(r.decode_hits for r in rs), sum(r.decode_misses for r in rs)
            row["decode_hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
            # the decode phase: tokens after the first (the first comes from the prompt's step)
            row["ssd_bytes_per_token"] = (sum(r.decode_read_bytes for r in rs) /
                                          max(1, sum(max(0, r.predicted_n - 1) for r in rs)))
        out[ds] = row
    return out


def write_json(rep: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(rep), indent=1) + "\n")


def load_reports(paths) -> list[dict]:
    """The bench reports among `paths`; other JSON files in the folder are skipped with a note on stderr."""
    out = []
    for p in paths:
        try:
            rep = json.loads(Path(p).read_text())
            ok = isinstance(rep, dict) and isinstance(rep.get("system"), str) and isinstance(rep.get("summary"), dict)
        except (OSError, ValueError):
            ok = False
        if ok:
            out.append(rep)
        else:
            print(f"bench-client: skipping {p}: not a bench-client report", file=sys.stderr)
    return out


def markdown_table(reports: list[dict], baseline: str | None = None) -> str:
    """One row per system and dataset; with a baseline, decode/prefill ratios to it."""
    base = {}
    if baseline:
        for rep in reports:
            if rep["system"] == baseline:
                base = rep["summary"]
    head = ("| system | dataset | requests | prefill tok/s | decode tok/s | hit rate (all / decode) | "
            "SSD MB per decode token |")
    sep = "|---|---|---|---|---|---|---|"
    if base:
        head += f" prefill ÷ {baseline} | decode ÷ {baseline} |"
        sep += "---|---|"
    lines = [head, sep]
    for rep in reports:
        for ds, row in rep["summary"].items():
            hr = f"{row['hit_rate']:.3f}" if "hit_rate" in row else "–"
            if "decode_hit_rate" in row:
                hr += f" / {row['decode_hit_rate']:.3f}"
            mb = f"{row['ssd_bytes_per_token'] / 1e6:.1f}" if "ssd_bytes_per_token" in row else "–"
            line = (f"| {rep['system']} | {ds} | {row['requests']} | {row['prefill_tok_s']:.1f} | "
                    f"{row['decode_tok_s']:.2f} | {hr} | {mb} |")
            if base:
                b = base.get(ds)
                line += (f" {row['prefill_tok_s'] / b['prefill_tok_s']:.2f}x | {row['decode_tok_s'] / b['decode_tok_s']:.2f}x |"
                         if b and b["prefill_tok_s"] and b["decode_tok_s"] else " – | – |")
            lines.append(line)
    return "\n".join(lines) + "\n"


def plot(reports: list[dict], path: Path) -> None:
    """Bar charts of prefill and decode tok/s per system and dataset (PNG)."""
    fig = figure(reports)
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(reports: list[dict]):
    """The plot's figure: linear axes from 0, each bar labelled with its value, so that bars compare by length
    (a log axis made 59.5 and 60.5 tok/s look 10x apart)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    systems = [r["system"] for r in reports]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill tok/s"), (axes[1], "decode_tok_s", "decode tok/s")):
        width = 0.38
        top = 0.0
        for j, ds in enumerate(("alpaca", "mmlu")):
            vals = [r["summary"].get(ds, {}).get(key, 0.0) for r in reports]
            top = max([top, *vals])
            bars = ax.bar([i + (j - 0.5) * width for i in range(len(systems))], vals, width, label=ds)
            ax.bar_label(bars, labels=[_label(v) for v in vals], padding=2, fontsize=8)
        ax.set_xticks(range(len(systems)), systems, rotation=20, ha="right")
        ax.set_title(title)
        ax.set_yscale("linear")
        ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)  # from 0, with room for the labels
        ax.legend()
    fig.tight_layout()
    return fig


def _label(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


class BenchError(RuntimeError):
    """The workload could not run (server unreachable, nothing completed); the message says why in one line."""


def check_reachable(base: str, timeout_s: float = 10.0) -> None:
    """Fail with one line unless something answers HTTP at `base` (any status: a server that is still loading
    answers 503 and the run's requests then wait for it)."""
    if not base.startswith(("http://", "https://")):
        raise BenchError(f"{base}: not an http:// or https:// URL")
    try:
        with urllib.request.urlopen(base.rstrip("/") + "/health", timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        pass  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise BenchError(f"cannot reach {base}: {reason}") from None


def main_run(args) -> int:
    if args.n_predict <= 0:
        raise BenchError(f"--n-predict must be positive, not {args.n_predict}")
    if not args.budget_s > 0:
        raise BenchError(f"--budget-s must be positive, not {args.budget_s}")
    if not args.system or "/" in args.system or args.system.startswith("."):
        raise BenchError(f"--system {args.system!r}: give a plain name (it names the JSON file)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} exists and is not a folder")
    check_reachable(args.url)
    rep = run(args.url, args.system, n_predict=args.n_predict, budget_s=args.budget_s)
    if not rep.completed:  # nothing measured: no JSON, which would enter every later table and plot as zeros
        first = next((r.error for r in rep.results if r.error), "no request was sent")
        raise BenchError(f"no request completed against {args.url} ({first}); nothing written")
    out.mkdir(parents=True, exist_ok=True)
    write_json(rep, out / f"{args.system}.json")
    reports = load_reports(sorted(out.glob("*.json")))
    (out / "table.md").write_text(markdown_table(reports, args.baseline))
    try:
        plot(reports, out / "rates.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    print(markdown_table([asdict(rep)]))
    return 0
