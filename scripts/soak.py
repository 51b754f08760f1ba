#!/usr/bin/env python3
"""Soak `expert-pack serve`: start it on 127.0.0.1, drive it for --seconds with a bounded mixed load, and report
whether it stayed healthy and flat.

The load: --clients threads, each sending one request at a time until the time is up (or --max-requests in all),
picking at random (seeded) between
  normal      /v1/completions, /v1/chat/completions, /completion, /tokenize: expects 200
  stream      a streamed chat or /completion read to its end: expects 200
  disconnect  a stream closed after its first event, a non-streamed generation abandoned, a connection closed
              before or halfway through its request: no reply expected
  malformed   bad JSON, 100,000 '[', lone surrogates, bytes that are not UTF-8, non-JSON Content-Types, NaN, wrong
              types, an unknown endpoint or method: expects a 4xx
  slow        a request sent in slow pieces and its reply read slowly: expects 200
Every request has a timeout; nothing goes beyond 127.0.0.1.

Reported at the start (after a warm-up request of each kind) and at the end: the server's RSS, open file
descriptors and threads (from /proc), VRAM (nvidia-smi, when there is one), request latency percentiles per kind in
the first and the last fifth of the run; in all: requests by kind and status, 5xx replies, tracebacks in the
server's log, /health at the end, and the server's exit after SIGTERM. Exit status 0 when there was no 5xx, no
unexpected reply, no traceback, the server was healthy at the end and stopped cleanly; 1 otherwise.

  python scripts/soak.py --seconds 600                 # a tiny synthetic model and its pack, made in a temp dir
  python scripts/soak.py --seconds 60 --pack model.pack --json soak.json -- --cache-mib 4G
(arguments after -- go to `expert-pack serve`)
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from expert_pack_devtools.proc import expert_pack_argv

HOST = "127.0.0.1"
KINDS = {"normal": 30, "stream": 20, "disconnect": 15, "malformed": 25, "slow": 10}
TIMEOUT_S = 120.0  # any one request

MALFORMED = [  # (name, method, path, headers, body)
    ("bad-json", "POST", "/v1/completions", {"Content-Type": "application/json"}, b"{not json"),
    ("deep-nesting", "POST", "/v1/completions", {"Content-Type": "application/json"}, b"[" * 100_000),
    ("deep-object", "POST", "/completion", {}, b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    ("surrogate", "POST", "/completion", {"Content-Type": "application/json"}, b'{"prompt": "\\ud800"}'),
    ("surrogate-chat", "POST", "/v1/chat/completions", {"Content-Type": "application/json"},
     b'{"messages": [{"role": "user", "content": "x\\udfff"}]}'),
    ("not-utf8", "POST", "/v1/completions", {"Content-Type": "application/json"}, b'{"prompt": "\xff\xfe"}'),
    ("text-plain", "POST", "/v1/completions", {"Content-Type": "text/plain"}, b'{"prompt": "x", "max_tokens": 1}'),
    ("image-png", "POST", "/tokenize", {"Content-Type": "image/png"}, b"\x89PNG\r\n\x1a\n"),
    ("latin1", "POST", "/tokenize", {"Content-Type": "application/json; charset=latin-1"}, b'{"content": "x"}'),
    ("nan", "POST", "/v1/completions", {"Content-Type": "application/json"},
     b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}'),
    ("huge-int", "POST", "/v1/completions", {"Content-Type": "application/json"},
     b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("wrong-type", "POST", "/v1/completions", {"Content-Type": "application/json"}, b'{"prompt": 42}'),
    ("too-many-tokens", "POST", "/v1/completions", {"Content-Type": "application/json"},
     b'{"prompt": "x", "max_tokens": 1000000000}'),
    ("not-object", "POST", "/v1/chat/completions", {"Content-Type": "application/json"}, b"[1, 2, 3]"),
    ("bad-token-ids", "POST", "/detokenize", {"Content-Type": "application/json"}, b'{"tokens": [-5, 1e300]}'),
    ("unknown-endpoint", "POST", "/v2/nothing", {"Content-Type": "application/json"}, b"{}"),
    ("wrong-method", "GET", "/completion", {}, b""),
]


# --- the server's figures ---------------------------------------------------------------------------------------

def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def n_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def n_threads(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def vram_mib(pid: int) -> float | None:
    """The process's GPU memory from nvidia-smi, or None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total = 0.0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                total += float(parts[1])
            except ValueError:
                pass
    return total


def sample(pid: int) -> dict:
    return {"t": time.time(), "rss_mib": rss_mib(pid), "fds": n_fds(pid), "threads": n_threads(pid),
            "vram_mib": vram_mib(pid)}


# --- the clients -------------------------------------------------------------------------------------------------

class Record:
    __slots__ = ("kind", "name", "status", "t0", "seconds", "error")

    def __init__(self, kind, name, status, t0, seconds, error=None):
        self.kind, self.name, self.status, self.t0, self.seconds, self.error = kind, name, status, t0, seconds, error


def _conn(port: int, timeout: float = TIMEOUT_S) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(HOST, port, timeout=timeout)


def _post_json(port: int, path: str, body: dict) -> tuple[int, bytes]:
    c = _conn(port)
    try:
        c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


PROMPTS = ["The capital of France is", "Once upon a time", "Explain experts in one line:", "1, 2, 3,",
           "Translate 'hello' into French:"]


def do_normal(port: int, rng: random.Random) -> tuple[str, int]:
    p = rng.choice(PROMPTS)
    which = rng.randrange(4)
    if which == 0:
        return "v1-completions", _post_json(port, "/v1/completions",
                                            {"prompt": p, "max_tokens": rng.randint(1, 12), "temperature": 0})[0]
    if which == 1:
        body = {"messages": [{"role": "user", "content": p}], "max_tokens": rng.randint(1, 12)}
        return "v1-chat", _post_json(port, "/v1/chat/completions", body)[0]
    if which == 2:
        return "completion", _post_json(port, "/completion",
                                        {"prompt": p, "n_predict": rng.randint(1, 12), "ignore_eos": True})[0]
    return "tokenize", _post_json(port, "/tokenize", {"content": p * rng.randint(1, 20)})[0]


def _read_stream(r, slow: bool, rng: random.Random) -> None:
    while True:
        line = r.readline()
        if not line:
            return
        if slow:
            time.sleep(rng.uniform(0.0, 0.02))


def do_stream(port: int, rng: random.Random, slow: bool = False) -> tuple[str, int]:
    c = _conn(port)
    try:
        if rng.random() < 0.5:
            name = "stream-chat"
            body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": rng.randint(2, 16),
                    "stream": True}
            path = "/v1/chat/completions"
        else:
            name = "stream-completion"
            body = {"prompt": rng.choice(PROMPTS), "n_predict": rng.randint(2, 16), "ignore_eos": True, "stream": True}
            path = "/completion"
        c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = c.getresponse()
        _read_stream(r, slow, rng)
        return name, r.status
    finally:
        c.close()


def _raw(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=timeout)


def _request_bytes(path: str, body: bytes, headers: dict | None = None, method: str = "POST") -> bytes:
    h = {"Host": f"{HOST}", "Content-Length": str(len(body)), **(headers or {})}
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode() + body


def do_disconnect(port: int, rng: random.Random) -> tuple[str, int]:
    which = rng.randrange(4)
    s = _raw(port)
    try:
        if which == 0:  # a stream, closed at its first event
            body = json.dumps({"prompt": rng.choice(PROMPTS), "n_predict": 200, "ignore_eos": True,
                               "stream": True}).encode()
            s.sendall(_request_bytes("/completion", body, {"Content-Type": "application/json"}))
            seen = b""
            deadline = time.monotonic() + TIMEOUT_S
            while b"data: " not in seen and time.monotonic() < deadline:
                chunk = s.recv(4096)
                if not chunk:
                    break
                seen += chunk
            return "stream-abandoned", 0
        if which == 1:  # a non-streamed generation, abandoned while it runs (or waits)
            body = json.dumps({"prompt": rng.choice(PROMPTS), "n_predict": 200, "ignore_eos": True}).encode()
            s.sendall(_request_bytes("/completion", body, {"Content-Type": "application/json"}))
            time.sleep(rng.uniform(0.05, 0.3))
            return "request-abandoned", 0
        if which == 2:  # connected, said nothing
            time.sleep(rng.uniform(0.0, 0.2))
            return "silent-connection", 0
        req = _request_bytes("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
                             {"Content-Type": "application/json"})
        s.sendall(req[: rng.randrange(1, len(req) - 1)])  # half a request
        time.sleep(rng.uniform(0.0, 0.2))
        return "half-request", 0
    finally:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, at once
        except OSError:
            pass
        s.close()


def do_malformed(port: int, rng: random.Random) -> tuple[str, int]:
    name, method, path, headers, body = rng.choice(MALFORMED)
    c = _conn(port)
    try:
        hdrs = dict(headers)
        c.putrequest(method, path)
        for k, v in hdrs.items():
            c.putheader(k, v)
        if method == "POST":
            c.putheader("Content-Length", str(len(body)))
        c.endheaders(body if method == "POST" else None)
        r = c.getresponse()
        data = r.read()
        if 400 <= r.status < 500:
            try:  # OpenAI-style error body, except waitress's own (413) which is text
                json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return name + " (no error body)", -r.status
        return name, r.status
    finally:
        c.close()


def do_slow(port: int, rng: random.Random) -> tuple[str, int]:
    body = json.dumps({"prompt": rng.choice(PROMPTS), "n_predict": rng.randint(2, 8), "ignore_eos": True,
                       "stream": rng.random() < 0.5}).encode()
    req = _request_bytes("/completion", body, {"Content-Type": "application/json", "Connection": "close"})
    s = _raw(port, TIMEOUT_S)
    try:
        pieces = rng.randint(3, 10)
        step = max(1, len(req) // pieces)
        for i in range(0, len(req), step):
            s.sendall(req[i:i + step])
            time.sleep(rng.uniform(0.01, 0.05))
        data = b""
        while True:
            chunk = s.recv(rng.choice((1, 16, 256)))
            if not chunk:
                break
            data += chunk
            if len(data) % 64 == 0:
                time.sleep(0.001)
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else -1
        return "slow-client", status
    finally:
        s.close()


DO = {"normal": do_normal, "stream": do_stream, "disconnect": do_disconnect, "malformed": do_malformed,
      "slow": do_slow}


def expected(kind: str, status: int) -> bool:
    if kind == "disconnect":
        return True
    if kind == "malformed":
        return 400 <= status < 500
    return status == 200


# --- the run -----------------------------------------------------------------------------------------------------

def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)

    def q(p):
        return round(1e3 * xs[min(len(xs) - 1, int(p * len(xs)))], 1)
    return {"n": len(xs), "p50_ms": q(0.50), "p90_ms": q(0.90), "p99_ms": q(0.99), "max_ms": round(1e3 * xs[-1], 1)}


def make_pack(work: Path) -> Path:
    from ggml_expert_pack.packer import build
    from expert_pack_devtools.synth import SHAPES, SynthConfig, generate
    model = work / "soak-qwen3moe.gguf"
    generate(SynthConfig(arch="qwen3moe", **SHAPES["tiny"]), model, progress=False)
    return build(model, work / "soak.pack", progress=False).pack_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        c = _conn(port, 5)
        c.request("GET", "/health")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


def run(args, extra: list[str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    target = args.pack or args.model
    if target is None:
        print("making a tiny synthetic model and its pack ...", file=sys.stderr, flush=True)
        target = str(make_pack(work))
    port = args.port or free_port()
    log_path = Path(args.log) if args.log else work / "server.log"
    cmd = [*expert_pack_argv(), "serve", target, "--port", str(port), "-c", str(args.ctx),
           "-t", str(args.threads), *extra]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    log = open(log_path, "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    report: dict = {"command": cmd, "seconds": args.seconds, "clients": args.clients, "server_log": str(log_path)}
    try:
        deadline = time.monotonic() + args.start_timeout
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"the server did not start (exit {proc.poll()}):\n{log.read()[-4000:]}")
            time.sleep(0.2)
        rng = random.Random(args.seed)
        for kind in ("normal", "stream", "malformed", "disconnect", "slow"):  # warm-up: one-time allocations
            DO[kind](port, rng)
        time.sleep(0.5)
        report["start"] = sample(proc.pid)
        records: list[Record] = []
        lock = threading.Lock()
        left = [args.max_requests]
        t_start = time.monotonic()
        t_end = t_start + args.seconds
        samples = [report["start"]]
        stop_sampling = threading.Event()

        def sampler():
            while not stop_sampling.wait(args.sample_every):
                samples.append(sample(proc.pid))

        def client(i: int):
            r = random.Random(args.seed * 1000 + i)
            kinds, weights = list(KINDS), list(KINDS.values())
            while time.monotonic() < t_end:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                kind = r.choices(kinds, weights)[0]
                t0 = time.monotonic()
                try:
                    name, status = DO[kind](port, r)
                    rec = Record(kind, name, status, t0 - t_start, time.monotonic() - t0)
                except (OSError, http.client.HTTPException, ValueError) as e:
                    rec = Record(kind, kind, -1, t0 - t_start, time.monotonic() - t0, f"{type(e).__name__}: {e}")
                    if kind == "disconnect":  # a reset is what these clients ask for
                        rec.status = 0
                with lock:
                    records.append(rec)
                if proc.poll() is not None:
                    return

        threading.Thread(target=sampler, daemon=True).start()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, t_end - time.monotonic()) + TIMEOUT_S + 10)
        stop_sampling.set()
        report["load_seconds"] = round(time.monotonic() - t_start, 1)
        report["clients_still_running"] = sum(t.is_alive() for t in threads)
        time.sleep(1.0)  # let abandoned generations notice and finish
        report["end"] = sample(proc.pid)
        samples.append(report["end"])
        report["samples"] = [{"s": round(x["t"] - samples[0]["t"], 1), "rss_mib": x["rss_mib"], "fds": x["fds"],
                              "threads": x["threads"], "vram_mib": x["vram_mib"]} for x in samples]
        report["peak_rss_mib"] = max((s["rss_mib"] or 0) for s in samples)
        report["peak_fds"] = max((s["fds"] or 0) for s in samples)
        report["healthy_at_end"] = healthy(port)
        report["server_alive_at_end"] = proc.poll() is None

        by: dict = {}
        for rec in records:
            d = by.setdefault(rec.kind, {"requests": 0, "statuses": {}, "unexpected": 0})
            d["requests"] += 1
            d["statuses"][str(rec.status)] = d["statuses"].get(str(rec.status), 0) + 1
            if not expected(rec.kind, rec.status):
                d["unexpected"] += 1
                d.setdefault("examples", [])
                if len(d["examples"]) < 5:
                    d["examples"].append({"name": rec.name, "status": rec.status, "error": rec.error})
        window = args.seconds / 5
        for kind, d in by.items():
            lat = [(r.t0, r.seconds) for r in records if r.kind == kind and r.status > 0]
            d["latency_start"] = percentiles([s for t, s in lat if t < window])
            d["latency_end"] = percentiles([s for t, s in lat if t >= args.seconds - window])
            d["latency_all"] = percentiles([s for _, s in lat])
        report["by_kind"] = by
        report["requests"] = len(records)
        report["http_5xx"] = sum(1 for r in records if r.status >= 500)
        report["unexpected"] = sum(d["unexpected"] for d in by.values())
        try:
            c = _conn(port, 10)
            c.request("GET", "/metrics")
            text = c.getresponse().read().decode()
            c.close()
            report["metrics"] = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
                                 if ln.startswith("llamacpp:n_requests") or ln.startswith("llamacpp:tokens_predicted ")}
        except (OSError, http.client.HTTPException, ValueError, IndexError):
            report["metrics"] = None
    finally:
        t0 = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        report["stop_seconds"] = round(time.monotonic() - t0, 2)
        report["server_exit"] = proc.returncode
        log.flush()
        log.seek(0)
        text = log.read()
        log.close()
        report["server_tracebacks"] = text.count("Traceback (most recent call last)")
        report["server_request_lines"] = sum(1 for ln in text.splitlines() if ln.startswith("request: "))
        if not args.keep and not args.log:
            shutil.rmtree(work, ignore_errors=True)
    report["ok"] = (report.get("http_5xx", 1) == 0 and report.get("unexpected", 1) == 0
                    and report["server_tracebacks"] == 0 and report.get("healthy_at_end", False)
                    and report["server_exit"] == 0 and report.get("clients_still_running", 1) == 0)
    return report


def render(rep: dict) -> str:
    def fig(s, k, unit=""):
        v = s.get(k) if s else None
        return "n/a" if v is None else (f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}")
    st, en = rep.get("start", {}), rep.get("end", {})
    lines = [f"soak: {rep.get('requests', 0)} requests in {rep.get('load_seconds', 0)} s from {rep['clients']} clients",
             f"  RSS      start {fig(st, 'rss_mib', ' MiB')}  end {fig(en, 'rss_mib', ' MiB')}  "
             f"peak {rep.get('peak_rss_mib', 0):.1f} MiB",
             f"  fds      start {fig(st, 'fds')}  end {fig(en, 'fds')}  peak {rep.get('peak_fds')}",
             f"  threads  start {fig(st, 'threads')}  end {fig(en, 'threads')}",
             f"  VRAM     start {fig(st, 'vram_mib', ' MiB')}  end {fig(en, 'vram_mib', ' MiB')}"]
    for kind, d in sorted(rep.get("by_kind", {}).items()):
        s, e = d["latency_start"], d["latency_end"]
        lines.append(f"  {kind:<10} {d['requests']:>6} requests, statuses {d['statuses']}, "
                     f"unexpected {d['unexpected']}")
        if s.get("n") or e.get("n"):
            def pcts(x):
                return f"{x.get('p50_ms')}/{x.get('p90_ms')}/{x.get('p99_ms')} ms (n={x.get('n')})"
            lines.append(f"  {'':<10} latency p50/p90/p99 start {pcts(s)}, end {pcts(e)}")
        for ex in d.get("examples", []):
            lines.append(f"  {'':<10} unexpected: {ex}")
    lines += [f"  5xx {rep.get('http_5xx')}, tracebacks in the server log {rep['server_tracebacks']}, "
              f"request log lines {rep['server_request_lines']}, healthy at the end {rep.get('healthy_at_end')}",
              f"  server metrics {rep.get('metrics')}",
              f"  SIGTERM -> exit {rep['server_exit']} in {rep['stop_seconds']} s",
              "  OK" if rep["ok"] else "  FAILED"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="arguments after -- go to `expert-pack serve`")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the load runs (default 60)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--pack", help="serve this pack folder (default: a tiny synthetic model, packed in a temp dir)")
    src.add_argument("--model", help="serve this GGUF instead")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--max-requests", type=int, default=200_000, help="requests in all, at most (default 200000)")
    ap.add_argument("--ctx", type=int, default=512, help="the server's -c (default 512)")
    ap.add_argument("--threads", type=int, default=2, help="the server's -t (default 2)")
    ap.add_argument("--port", type=int, help="the server's port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--seed", type=int, default=1, help="the clients' random seed (default 1)")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS/fd samples (default 5)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds the server may take to load")
    ap.add_argument("--json", help="write the report here as JSON")
    ap.add_argument("--log", help="keep the server's log here (default: a temp file, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (model, pack, log)")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1 or args.max_requests < 1:
        ap.error("--seconds, --clients and --max-requests must be positive")
    try:
        rep = run(args, extra)
    except RuntimeError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    print(render(rep))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
