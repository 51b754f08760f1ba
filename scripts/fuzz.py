#!/usr/bin/env python3
"""Fuzz the packer, the pack reader and the loader with mutated inputs, on a small synthetic MoE model.

    python scripts/fuzz.py --count 2000                          # every class, 2000 mutations each
    python scripts/fuzz.py --count 300 --class manifest --seed 7
    python scripts/fuzz.py --class trunk --seed 7 --only 123     # one mutation again (a failure's repro line)

Classes (--class, repeatable):
  manifest            manifest.json: a field deleted, retyped, out of range, swapped, duplicated or huge; the
                      whole file garbage, [], a bare string, truncated, nested too deep, a huge padding key
  manifest-resealed   the same, with the manifest digest recomputed and written into the pack header, so that the
                      mutation reaches the checks behind the digest
  trunk               the pack's trunk.gguf: GGUF header, KV fields and tensor infos; bytes flipped, truncation
  trunk-resealed      the same, with the new trunk recorded in the manifest (size, checksums) and the manifest
                      resealed: a consistent pack whose trunk is wrong; one that verify accepts may generate
                      other tokens, one that verify refuses must be refused at load or generate the original's
  source              the source GGUF's header, KV fields and tensor infos, through `expert-pack build`
  pack                experts.pack data faults: flipped bits (header, reserved bytes, blocks, padding),
                      zeroed pages, swapped blocks, truncation, extension
  http                malformed requests to `expert-pack serve` on 127.0.0.1 (not in the test suite)

Every mutation goes through `expert-pack verify`, `expert-pack inspect` (in this process, with a deadline) and
load-and-generate (llama_cpp.Llama on the trunk with the pack, a few tokens at temperature 0) in a worker
subprocess that serves many mutations in turn; a worker that dies is replaced, so a crash costs one mutation,
not the run. Outcomes per stage:

  refused     a clean refusal: one line on stderr and a non-zero exit (CLI), an exception with a message (load)
  identical   accepted, with output identical to the unmutated original's
  crash       the worker died of a signal (or exited without a result)
  hang        no result before the deadline
  traceback   a traceback, more than one line, or an error that is not a refusal (an unexpected exception)
  changed     accepted with different output (verify passing a modified pack counts here too)

For `source`, the reference is stock llama.cpp on the mutated source: a build may refuse it, or its pack must
generate what stock generates; a pack that runs where stock llama.cpp fails counts as changed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from expert_pack_devtools.proc import expert_pack_argv

OUTCOMES = ("refused", "identical", "crash", "hang", "traceback", "changed")
BAD = ("crash", "hang", "traceback", "changed")
CLASSES = ("manifest", "manifest-resealed", "trunk", "trunk-resealed", "source", "pack", "http")
SUITE_CLASSES = CLASSES[:-1]  # http is tests/test_server.py's

# a small qwen3moe: 2 MoE layers of 8 experts, top-2; Q8_0 experts (the 64-wide rows fit its 32-element blocks)
FUZZ_MODEL = dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_expert=8,
                  n_expert_used=2, n_ff_exp=64, expert_type="q8_0", seed=11, name="fuzz")
PROMPT = "The capital of France is"
N_TOKENS = 4
CLI_DEADLINE_S = 60.0
MARK = "@@fuzz "
VOCAB_SIZE = 2048       # tokens of the fuzz model's vocabulary (small_vocab)
HUGE_PADDING = 8 << 20  # the huge padding key's size: bounded, larger than any parser's small-buffer path


# ---------------------------------------------------------------------------------------------------------
# results

@dataclass
class Stage:
    name: str
    outcome: str
    detail: str = ""


@dataclass
class Result:
    cls: str
    index: int
    desc: str
    stages: list[Stage] = field(default_factory=list)
    kept: str | None = None
    seed: int = 0

    @property
    def outcome(self) -> str:
        for o in BAD:
            if any(s.outcome == o for s in self.stages):
                return o
        return "refused" if any(s.outcome == "refused" for s in self.stages) else "identical"

    @property
    def bad(self) -> list[Stage]:
        return [s for s in self.stages if s.outcome in BAD]

    def repro(self) -> str:
        cmd = f"python scripts/fuzz.py --class {self.cls} --seed {self.seed} --only {self.index} --keep"
        if self.kept and self.cls != "http":
            d = self.kept + ("/pack" if self.cls == "source" else "")
            cmd += (f"   # or: python -c \"from llama_cpp import Llama; Llama(model_path='{d}/trunk.gguf', "
                    f"expert_pack='{d}', verbose=False)('{PROMPT}', max_tokens={N_TOKENS})\"")
        return cmd

    def line(self) -> str:
        st = "; ".join(f"{s.name}: {s.outcome}" + (f" ({_clip(s.detail, 240)})" if s.detail else "")
                       for s in self.bad)
        return f"{self.cls} #{self.index} | {self.desc} | {st} | {self.repro()}"


def _clip(s: str, n: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[:n - 3] + "..."


def table(results: list[Result]) -> str:
    """Per class and stage: mutations and outcome counts (a mutation counts once per stage it reached)."""
    head = "| class | stage | mutations | clean refusals | accepted-identical | crashes | hangs | tracebacks | changed outputs |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    by_cls: dict[str, list[Result]] = {}
    for r in results:
        by_cls.setdefault(r.cls, []).append(r)
    for cls, rs in by_cls.items():
        stages = []
        for r in rs:
            for s in r.stages:
                if s.name not in stages:
                    stages.append(s.name)
        for st in stages + ["any"]:
            if st == "any":
                outs = [r.outcome for r in rs]
            else:
                outs = [s.outcome for r in rs for s in r.stages if s.name == st]
            c = {o: outs.count(o) for o in OUTCOMES}
            lines.append(f"| {cls} | {st} | {len(outs)} | {c['refused']} | {c['identical']} | {c['crash']} | "
                         f"{c['hang']} | {c['traceback']} | {c['changed']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# the worker: load-and-generate, many jobs per process

def _generate(job: dict) -> list[int]:
    from llama_cpp import Llama
    # verbose: llama.cpp's log goes to the worker's stderr file, where the parent finds a crash's reason
    kw = dict(model_path=job["model"], n_ctx=64, n_batch=64, n_threads=1, seed=0, verbose=True)
    if job.get("pack"):
        kw["expert_pack"] = job["pack"]
    llm = Llama(**kw)
    try:
        toks = llm.tokenize(PROMPT.encode())
        out: list[int] = []
        for t in llm.generate(toks, top_k=1, temp=0.0, reset=True):
            out.append(int(t))
            if len(out) >= N_TOKENS:
                break
        return out
    finally:
        llm.close()


def worker_main() -> int:
    import llama_cpp  # noqa: F401  (imported before READY: the first job's deadline does not pay for it)
    out = sys.stdout
    print(MARK + "READY", file=out, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(MARK + "START " + job["id"], file=out, flush=True)
        if job.get("crash_for_test"):  # the suite checks that a dying worker is reported, and replaced
            os.abort()
        try:
            res = {"ok": True, "tokens": _generate(job)}
        except Exception as e:  # noqa: BLE001 (a refusal is any exception; its message is judged by the parent)
            res = {"ok": False, "type": type(e).__name__, "error": str(e)}
        print(MARK + "RESULT " + job["id"] + " " + json.dumps(res), file=out, flush=True)
    return 0


class Worker:
    """A worker subprocess; `run(job)` returns (outcome-ish status, payload). A worker that dies or hangs is
    replaced at the next job."""

    def __init__(self, workdir: Path, timeout_s: float):
        self.workdir, self.timeout_s = workdir, timeout_s
        self.proc: subprocess.Popen | None = None
        self.buf = b""
        self.n_started = 0
        self.err_path: Path | None = None

    def _start(self) -> None:
        self.n_started += 1
        self.err_path = self.workdir / f"worker-{self.n_started}.stderr"
        self.err = open(self.err_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     start_new_session=True, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        self.buf = b""
        line = self._readline(time.monotonic() + 120)
        if line is None or not line.startswith(MARK + "READY"):
            tail = self._stderr_tail()
            self._kill()
            raise RuntimeError(f"the fuzz worker did not start: {tail}")

    def _readline(self, deadline: float) -> str | None:
        """The next line of the worker's stdout; '' at EOF, None at the deadline."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def _stderr_tail(self, since: int = 0) -> str:
        """What the current job logged that says why it failed: assertion and error lines first."""
        try:
            with open(self.err_path, "rb") as f:
                f.seek(max(since, f.seek(0, 2) - (64 << 10)))
                text = f.read().decode(errors="replace")
        except (OSError, TypeError):
            return ""
        lines = [l.strip() for l in text.splitlines() if l.strip()]
        key = [l for l in lines if re.search(r"GGML_ASSERT|GGML_ABORT|[Aa]ssertion|terminate called|error|failed|"
                                             r"Segmentation fault|unsupported", l) and not l.startswith("Model metadata")]
        return " / ".join((key or lines)[-3:])

    def _kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            self.proc = None
        if getattr(self, "err", None):
            self.err.close()
            self.err = None

    def run(self, job: dict) -> tuple[str, dict]:
        """('ok', result) | ('crash', {'detail'}) | ('hang', {'detail'})"""
        if self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        deadline = time.monotonic() + self.timeout_s
        try:
            since = self.err_path.stat().st_size
        except OSError:
            since = 0
        while True:
            line = self._readline(deadline)
            if line is None:
                self._kill()
                return "hang", {"detail": f"no result in {self.timeout_s:.0f} s"}
            if line == "":
                rc = self.proc.wait()
                tail = self._stderr_tail(since)
                self._kill()
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc} without a result"
                return "crash", {"detail": how + (f"; stderr: {tail}" if tail else ""), "rc": rc}
            if line.startswith(MARK + "RESULT " + job["id"] + " "):
                res = json.loads(line.split(" ", 3)[3])
                if not res["ok"]:
                    res["log"] = self._stderr_tail(since)
                return "ok", res

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()


def load_stage(worker: Worker, job: dict, want: list[int] | None, name: str = "load") -> tuple[Stage, dict | None]:
    """Run a load-and-generate job; `want`: the reference tokens (None: only record what happens)."""
    status, res = worker.run(job)
    if status != "ok":
        return Stage(name, status, res["detail"]), None
    if not res["ok"]:
        msg = res["error"].strip()
        if not msg:
            return Stage(name, "traceback", f"{res['type']} without a message"), res
        why = f" [log: {res['log']}]" if res.get("log") and res["log"] not in msg else ""
        return Stage(name, "refused", f"{res['type']}: {msg}{why}"), res
    if want is None or res["tokens"] == want:
        return Stage(name, "identical"), res
    return Stage(name, "changed", f"tokens {res['tokens']}, expected {want}"), res


# ---------------------------------------------------------------------------------------------------------
# the CLI stages, in this process with a deadline

class _Deadline(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    def fire(signum, frame):
        raise _Deadline()
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(argv: list[str]) -> tuple[str, int | None, str, str]:
    """('ok'|'hang'|'traceback', rc, stdout, stderr) of `expert-pack ARGV` run in this process."""
    from ggml_expert_pack.cli import main
    out, err = io.StringIO(), io.StringIO()
    try:
        with _deadline(CLI_DEADLINE_S), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 2
    except _Deadline:
        return "hang", None, out.getvalue(), f"no exit in {CLI_DEADLINE_S:.0f} s"
    except BaseException:  # noqa: BLE001 (whatever escapes main is a traceback the user would see)
        return "traceback", None, out.getvalue(), err.getvalue() + traceback.format_exc()
    return "ok", rc, out.getvalue(), err.getvalue()


def cli_stage(name: str, argv: list[str], want_out: str | None, norm: dict[str, str],
              must_refuse: bool = False) -> Stage:
    """One CLI command judged: a refusal is exactly one line on stderr and a non-zero exit; acceptance must print
    `want_out` (after replacing each key of `norm` by its value)."""
    status, rc, out, err = run_cli(argv)
    if status != "ok":
        return Stage(name, status, err)
    lines = [l for l in err.splitlines() if l.strip()]
    if rc != 0:
        if "Traceback (most recent call last)" in err or len(lines) != 1:
            return Stage(name, "traceback", f"exit {rc}, stderr: " + " / ".join(lines[-4:]))
        if "--debug shows where" in lines[0]:  # an exception that is not a refusal: a bug shown in one line
            return Stage(name, "traceback", lines[0])
        return Stage(name, "refused", lines[0])
    for k, v in norm.items():
        out = out.replace(k, v)
    if must_refuse:
        return Stage(name, "changed", "accepted a modified pack: " + _clip(out, 200))
    if want_out is not None and out != want_out:
        diff = next((f"{a!r} != {b!r}" for a, b in zip(out.splitlines(), want_out.splitlines()) if a != b),
                    "output differs")
        return Stage(name, "changed", diff)
    return Stage(name, "identical")


# ---------------------------------------------------------------------------------------------------------
# the base: model, pack, reference outputs

@dataclass
class Base:
    workdir: Path
    source: Path
    pack: Path
    manifest: dict
    manifest_text: bytes
    verify_out: str
    inspect_out: str
    tokens: list[int]
    load_s: float
    arch: str


def small_vocab(dst: Path, n: int = VOCAB_SIZE) -> Path:
    """A vocab GGUF with the first `n` tokens of the packaged qwen2 BPE vocabulary (the byte alphabet and the
    first merges), the merges among them, and one end-of-text token: loading it takes milliseconds instead of the
    ~2 s of 151,936 tokens, which would dominate every load-and-generate."""
    from expert_pack_devtools.synth.generate import default_vocab
    doc = parse_gguf(default_vocab())
    kv = {k.key.decode(): k for k in doc.kvs}

    def strings(payload: bytes) -> list[bytes]:
        et, cnt = struct.unpack_from("<IQ", payload)
        out, p = [], 12
        for _ in range(cnt):
            (m,) = struct.unpack_from("<Q", payload, p)
            out.append(payload[p + 8:p + 8 + m])
            p += 8 + m
        return out

    def arr_str(items: list[bytes]) -> bytes:
        return struct.pack("<IQ", T_STRING, len(items)) + b"".join(struct.pack("<Q", len(x)) + x for x in items)
    tokens = strings(kv["tokenizer.ggml.tokens"].payload)[:n]
    eot = n - 1
    tokens[eot] = b"<|endoftext|>"
    types = list(struct.unpack_from(f"<{n}i", kv["tokenizer.ggml.token_type"].payload, 12))
    types[eot] = 3  # control
    have = set(tokens)
    merges = [m for m in strings(kv["tokenizer.ggml.merges"].payload)
              if len(m.split(b" ")) == 2 and all(x in have for x in m.split(b" ")) and m.replace(b" ", b"") in have]
    out = [GKV(b"general.architecture", T_STRING, _enc(T_STRING, "qwen2"))]
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        out.append(kv[key])
    out += [GKV(b"tokenizer.ggml.tokens", T_ARRAY, arr_str(tokens)),
            GKV(b"tokenizer.ggml.token_type", T_ARRAY, struct.pack("<IQ", 5, n) + struct.pack(f"<{n}i", *types)),
            GKV(b"tokenizer.ggml.merges", T_ARRAY, arr_str(merges))]
    out += [GKV(k.encode(), 4, struct.pack("<I", eot)) for k in
            ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.bos_token_id")]
    d = GGUFDoc(dst, 3, out, [], 32, 0, 0)
    dst.write_bytes(d.header())
    return dst


def prepare(workdir: str | Path, source: str | Path | None = None, worker: Worker | None = None,
            log=print) -> Base:
    """Generate (or take) the fuzz model, pack it, and record the reference outputs of verify, inspect and
    load-and-generate (which must equal stock llama.cpp's on the source)."""
    from ggml_expert_pack.packer import build
    from expert_pack_devtools.synth import SynthConfig, generate
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if source is None:
        source = workdir / "fuzz.gguf"
        if not source.exists():
            vocab = small_vocab(workdir / "vocab.gguf")
            generate(SynthConfig.from_dict({**FUZZ_MODEL, "vocab": str(vocab)}), source, progress=False)
    source = Path(source)
    pack = workdir / "base.pack"
    if not (pack / "manifest.json").exists():
        build(source, pack, force=True, progress=False)
    own = worker is None
    worker = worker or Worker(workdir, 300)
    try:
        t0 = time.monotonic()
        st, res = load_stage(worker, {"id": "base", "model": str(pack / "trunk.gguf"), "pack": str(pack)}, None)
        load_s = time.monotonic() - t0
        st2, ref = load_stage(worker, {"id": "stock", "model": str(source)}, None)
    finally:
        if own:
            worker.close()
    if st.outcome != "identical" or st2.outcome != "identical":
        raise RuntimeError(f"the unmutated pack does not run: {st.detail or st2.detail}")
    if res["tokens"] != ref["tokens"]:
        raise RuntimeError(f"the unmutated pack generates {res['tokens']}, stock llama.cpp {ref['tokens']}")
    outs = {}
    for cmd in ("verify", "inspect"):
        status, rc, out, err = run_cli([cmd, str(pack)] + (["--quiet"] if cmd == "verify" else []))
        if status != "ok" or rc != 0:
            raise RuntimeError(f"expert-pack {cmd} fails on the unmutated pack: {err.strip()}")
        outs[cmd] = out.replace(str(pack), "PACK")
    text = (pack / "manifest.json").read_bytes()
    log(f"base: {source} -> {pack}; tokens {res['tokens']}; load and generate {load_s:.2f} s")
    return Base(workdir, source, pack, json.loads(text), text, outs["verify"], outs["inspect"], res["tokens"],
                load_s, json.loads(text)["source"]["arch"])


def _link_pack(base: Base, dst: Path, skip: tuple[str, ...]) -> None:
    """A pack directory sharing the base's files (hard links; they are only read) except those in `skip`."""
    dst.mkdir(parents=True)
    for f in ("experts.pack", "manifest.json", "trunk.gguf"):
        if f in skip:
            continue
        try:
            os.link(base.pack / f, dst / f)
        except OSError:
            shutil.copyfile(base.pack / f, dst / f)


def _copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as a, open(dst, "wb") as b:
        n = os.fstat(a.fileno()).st_size
        off = 0
        while off < n:
            k = os.copy_file_range(a.fileno(), b.fileno(), n - off, off, off)
            if k <= 0:
                break
            off += k


# ---------------------------------------------------------------------------------------------------------
# manifest mutations

def _paths(obj, prefix=()) -> list[tuple]:
    """Every node of a JSON value as a path of keys / indexes (long lists sampled: ends and a few inside)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        idx = range(len(obj)) if len(obj) <= 6 else sorted({0, 1, len(obj) // 2, len(obj) - 2, len(obj) - 1})
        for i in idx:
            out += _paths(obj[i], prefix + (i,))
    return out


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _set(obj, path, value):
    if not path:
        return value
    _get(obj, path[:-1])[path[-1]] = value
    return obj


INT_EDGES = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**56, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
             10**30, -2**31, -2**63]
RETYPES = [None, True, False, 0, -1, 1.5, "", "x", [], {}, "0" * 32, [1, 2, 3], {"a": 1}, 1e308]


def mutate_manifest(rng: random.Random, base: Base, structured_only: bool = False) -> tuple[str, bytes]:
    """(description, new manifest bytes)"""
    m = json.loads(base.manifest_text)
    if not structured_only and rng.random() < 0.18:
        return _whole_file(rng, base.manifest_text)
    paths = [p for p in _paths(m) if p]
    op = rng.choice(["delete", "retype", "range", "range", "swap", "duplicate", "huge", "add"])
    path = rng.choice(paths)
    name = "/".join(map(str, path))
    parent = _get(m, path[:-1])
    cur = _get(m, path)
    if op == "delete":
        del parent[path[-1]]
        return f"delete {name}", _dump(m, rng)
    if op == "retype":
        v = rng.choice([x for x in RETYPES if type(x) is not type(cur)] or RETYPES)
        _set(m, path, v)
        return f"retype {name} = {_clip(json.dumps(v), 40)}", _dump(m, rng)
    if op == "range":
        if isinstance(cur, bool) or not isinstance(cur, (int, str)):
            v = rng.choice(INT_EDGES)
        elif isinstance(cur, int):
            v = rng.choice(INT_EDGES + [cur - 1, cur + 1, cur * 2, cur + 4096, cur - 4096, cur + 256, -cur])
        else:
            v = rng.choice(["", cur[:-1], cur + "0", cur.upper(), "g" * len(cur), cur[::-1], "../" + cur,
                            "/etc/passwd", cur + "\u00e9", "\x00"])
        _set(m, path, v)
        return f"set {name} = {_clip(json.dumps(v), 40)}", _dump(m, rng)
    if op == "swap":
        if isinstance(parent, list) and len(parent) >= 2:
            i, j = rng.sample(range(len(parent)), 2)
            parent[i], parent[j] = parent[j], parent[i]
            return f"swap {'/'.join(map(str, path[:-1]))}[{i}] and [{j}]", _dump(m, rng)
        if isinstance(parent, dict) and len(parent) >= 2:
            a, b = rng.sample(sorted(parent), 2)
            parent[a], parent[b] = parent[b], parent[a]
            return f"swap values of {'/'.join(map(str, path[:-1] + (a,)))} and {b}", _dump(m, rng)
        op = "duplicate"
    if op == "duplicate":
        if isinstance(parent, list):
            parent.insert(path[-1], json.loads(json.dumps(cur)))
            return f"duplicate {name}", _dump(m, rng)
        if isinstance(cur, list) and cur:
            cur.append(json.loads(json.dumps(cur[-1])))
            return f"append a copy of the last item of {name}", _dump(m, rng)
        op = "huge"
    if op == "huge":
        v = rng.choice([10**100, 2**200, "z" * 100_000, list(range(100_000)), 1e300, -10**100])
        _set(m, path, v)
        return f"huge {name} = {_clip(json.dumps(v), 30)}", _dump(m, rng)
    target = rng.choice([p for p in [()] + paths if isinstance(_get(m, p), dict)])
    _get(m, target)[rng.choice(["extra", "padding", "z", ""])] = rng.choice([1, "x", None, [], {}])
    return f"add a key to {'/'.join(map(str, target)) or 'the top level'}", _dump(m, rng)


def _dump(m, rng: random.Random) -> bytes:
    indent = rng.choice([None, 1, 2])
    return (json.dumps(m, indent=indent, sort_keys=rng.random() < 0.5) + "\n").encode()


def _whole_file(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    op = rng.randrange(12)
    if op == 0:
        n = rng.randrange(0, 4096)
        return f"random garbage ({n} bytes)", bytes(rng.randrange(256) for _ in range(n))
    if op == 1:
        return "an empty array", b"[]"
    if op == 2:
        return "a bare string", b'"expert-pack"'
    if op == 3:
        return rng.choice([("a number", b"0"), ("null", b"null"), ("an empty object", b"{}"), ("empty", b""),
                           ("true", b"true")])
    if op == 4:
        cut = rng.randrange(1, len(text))
        return f"truncated at byte {cut}", text[:cut]
    if op == 5:
        depth = rng.choice([1000, 100_000])
        return f"nested {depth} deep", b"[" * depth + b"]" * depth
    if op == 6:
        i = rng.randrange(len(text))
        return f"byte {i} replaced by 0xff (not UTF-8)", text[:i] + b"\xff" + text[i + 1:]
    if op == 7:
        m = json.loads(text)
        return (f"a huge padding key ({HUGE_PADDING >> 20} MiB)",
                json.dumps({"padding": "p" * HUGE_PADDING, **m}).encode())
    if op == 8:
        return "a UTF-8 BOM first", b"\xef\xbb\xbf" + text
    if op == 9:
        i = rng.randrange(len(text))
        return f"byte {i} flipped", text[:i] + bytes([text[i] ^ (1 << rng.randrange(8))]) + text[i + 1:]
    if op == 10:
        return "NaN for n_experts", re.sub(rb'"n_experts": *\d+', b'"n_experts": NaN', text)
    return "a duplicated key (n_experts twice)", re.sub(rb'"n_experts": *(\d+)', rb'"n_experts": 1, "n_experts": \1',
                                                        text)


def _reseal(base: Base, data: bytes, dst: Path) -> str:
    """Recompute the manifest digest of a mutated manifest and write it, with the geometry the mutated
    manifest claims, into a copy of the pack header; returns a note for the description."""
    from ggml_expert_pack.packer.format import PackHeader, manifest_digest
    try:
        m = json.loads(data)
        if not isinstance(m, dict):
            raise ValueError
        m["manifest_digest"] = manifest_digest(m)
    except (ValueError, TypeError, RecursionError):
        os.link(base.pack / "experts.pack", dst / "experts.pack")
        return "not resealable"
    (dst / "manifest.json").write_text(json.dumps(m, indent=1))
    _copy(base.pack / "experts.pack", dst / "experts.pack")
    with open(dst / "experts.pack", "r+b") as f:
        h = PackHeader.unpack(f.read(4096))

        def u(v, bits, default):
            return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << bits) else default
        pk = m.get("pack") if isinstance(m.get("pack"), dict) else {}
        h.manifest_digest = bytes.fromhex(m["manifest_digest"])
        h.n_experts = u(m.get("n_experts"), 32, h.n_experts)
        h.n_layers = u(len(m["layers"]) if isinstance(m.get("layers"), list) else None, 32, h.n_layers)
        h.data_size = u(pk.get("data_size"), 64, h.data_size)
        h.expert_stride = u(pk.get("expert_stride"), 64, h.expert_stride)
        if isinstance(pk.get("uniform_stride"), bool):
            h.flags = 1 if pk["uniform_stride"] else 0
        try:
            pid = bytes.fromhex(m["pack_id"]) if isinstance(m.get("pack_id"), str) else h.pack_id
            h.pack_id = pid if len(pid) == 16 else h.pack_id
        except ValueError:
            pass
        f.seek(0)
        f.write(h.pack())
    return "resealed"


# ---------------------------------------------------------------------------------------------------------
# GGUF mutations (trunk and source)

@dataclass
class GKV:
    key: bytes
    vtype: int
    payload: bytes      # the encoded value (arrays: element type, count, items)


@dataclass
class GTensor:
    name: bytes
    dims: list[int]
    ttype: int
    offset: int


@dataclass
class GGUFDoc:
    path: Path
    version: int
    kvs: list[GKV]
    tensors: list[GTensor]
    alignment: int
    data_offset: int
    size: int

    def header(self, magic=b"GGUF", version=None, n_tensors=None, n_kv=None) -> bytes:
        parts = [magic, struct.pack("<IQQ", self.version if version is None else version,
                                    len(self.tensors) if n_tensors is None else n_tensors,
                                    len(self.kvs) if n_kv is None else n_kv)]
        for kv in self.kvs:
            parts += [struct.pack("<Q", len(kv.key)), kv.key, struct.pack("<I", kv.vtype), kv.payload]
        for t in self.tensors:
            parts += [struct.pack("<Q", len(t.name)), t.name, struct.pack("<I", len(t.dims)),
                      struct.pack(f"<{len(t.dims)}Q", *t.dims), struct.pack("<IQ", t.ttype, t.offset)]
        head = b"".join(parts)
        return head + b"\0" * (-len(head) % self.alignment)


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
T_STRING, T_ARRAY = 8, 9


def parse_gguf(path: Path) -> GGUFDoc:
    raw = path.read_bytes()
    pos = 4
    version, n_t, n_kv = struct.unpack_from("<IQQ", raw, pos)
    pos += 20

    def value_end(vtype: int, p: int) -> int:
        if vtype == T_STRING:
            (n,) = struct.unpack_from("<Q", raw, p)
            return p + 8 + n
        if vtype == T_ARRAY:
            et, cnt = struct.unpack_from("<IQ", raw, p)
            p += 12
            if et == T_STRING:
                for _ in range(cnt):
                    (n,) = struct.unpack_from("<Q", raw, p)
                    p += 8 + n
                return p
            return p + struct.calcsize(_SCALAR[et]) * cnt
        return p + struct.calcsize(_SCALAR[vtype])
    kvs = []
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", raw, pos)
        key = raw[pos + 8:pos + 8 + n]
        pos += 8 + n
        (vt,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        end = value_end(vt, pos)
        kvs.append(GKV(key, vt, raw[pos:end]))
        pos = end
    tensors = []
    for _ in range(n_t):
        (n,) = struct.unpack_from("<Q", raw, pos)
        name = raw[pos + 8:pos + 8 + n]
        pos += 8 + n
        (nd,) = struct.unpack_from("<I", raw, pos)
        dims = list(struct.unpack_from(f"<{nd}Q", raw, pos + 4))
        pos += 4 + 8 * nd
        tt, off = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        tensors.append(GTensor(name, dims, tt, off))
    al = next((struct.unpack("<I", kv.payload)[0] for kv in kvs if kv.key == b"general.alignment"), 32)
    return GGUFDoc(path, version, kvs, tensors, al, pos + (-pos % al), len(raw))


def _enc(vtype: int, v) -> bytes:
    if vtype == T_STRING:
        b = v if isinstance(v, bytes) else str(v).encode()
        return struct.pack("<Q", len(b)) + b
    return struct.pack(_SCALAR[vtype], v)


def _dec(kv: GKV):
    if kv.vtype == T_STRING:
        return kv.payload[8:]
    if kv.vtype in _SCALAR:
        return struct.unpack(_SCALAR[kv.vtype], kv.payload)[0]
    return None


_INT_RANGE = {0: (0, 255), 1: (-128, 127), 2: (0, 65535), 3: (-32768, 32767), 4: (0, 2**32 - 1),
              5: (-2**31, 2**31 - 1), 10: (0, 2**64 - 1), 11: (-2**63, 2**63 - 1)}
GGML_TYPES = [0, 1, 8, 12, 14, 30, 39, 26, 10, 20, 24, 2, 4, 40, 99, 2**31]  # F32 F16 Q8_0 Q4_K Q6_K BF16 MXFP4 I32 Q2_K IQ4_NL I8 Q4_0, removed, past the end


def mutate_gguf(rng: random.Random, doc: GGUFDoc, arch: str, role: str) -> tuple[str, dict]:
    """(description, recipe) where recipe = {"header": bytes} (data section copied from the original, starting
    at the new header's end) or {"raw": [(op, args)]} on the original bytes, or {"relaid": (...)}."""
    r = rng.random()
    if r < 0.08:
        return _gguf_header_field(rng, doc)
    if r < 0.16:
        return _gguf_raw(rng, doc)
    if r < 0.40:
        return _gguf_tensor(rng, doc, role)
    return _gguf_kv(rng, doc, arch)


def _gguf_header_field(rng, doc):
    f = rng.choice(["magic", "version", "n_tensors", "n_kv"])
    if f == "magic":
        v = rng.choice([b"GGUG", b"\0\0\0\0", b"FUGG", b"gguf"])
        return f"magic = {v!r}", {"header": doc.header(magic=v)}
    if f == "version":
        v = rng.choice([0, 1, 2, 4, 2**31, 2**32 - 1])
        return f"version = {v}", {"header": doc.header(version=v)}
    n = len(doc.tensors) if f == "n_tensors" else len(doc.kvs)
    v = rng.choice([0, n - 1, n + 1, 2**32, 2**63, 2**64 - 1])
    return f"{f} = {v}", {"header": doc.header(**{f: v})}


def _gguf_raw(rng, doc):
    op = rng.choice(["flip", "flip", "cut_header", "cut_data", "append"])
    if op == "flip":
        i = rng.randrange(doc.data_offset)
        bit = rng.randrange(8)
        return f"header byte {i} bit {bit} flipped", {"raw": ("flip", i, bit)}
    if op == "cut_header":
        n = rng.randrange(doc.data_offset)
        return f"truncated to {n} bytes (inside the header)", {"raw": ("cut", n)}
    if op == "cut_data":
        n = rng.choice([doc.size - 1, doc.size - 32, rng.randrange(doc.data_offset, doc.size)])
        return f"truncated to {n} of {doc.size} bytes", {"raw": ("cut", n)}
    n = rng.choice([1, 32, 4096])
    return f"{n} bytes appended", {"raw": ("append", n)}


def _gguf_tensor(rng, doc: GGUFDoc, role: str):
    d = GGUFDoc(doc.path, doc.version, list(doc.kvs), [GTensor(t.name, list(t.dims), t.ttype, t.offset)
                                                       for t in doc.tensors], doc.alignment, doc.data_offset, doc.size)
    # norms and other small tensors are the interesting ones for types: weight them up
    small = [i for i, t in enumerate(d.tensors) if len(t.dims) == 1]
    i = rng.choice(small) if small and rng.random() < 0.4 else rng.randrange(len(d.tensors))
    t = d.tensors[i]
    name = t.name.decode(errors="replace")
    op = rng.choice(["type", "type", "dims", "offset", "name", "delete", "duplicate"] +
                    (["relaid", "relaid", "relaid"] if role == "source" else []))
    if op == "type":
        t.ttype = rng.choice([x for x in GGML_TYPES if x != t.ttype])
        return f"tensor {name} type = {t.ttype}", {"header": d.header()}
    if op == "relaid":
        new = rng.choice([x for x in (0, 1, 8, 12, 30, 39, 26, 24, 2) if x != t.ttype])
        return f"tensor {name} retyped {t.ttype} -> {new}, data relaid", {"relaid": (i, new)}
    if op == "dims":
        k = rng.randrange(4)
        if k == 0 and len(t.dims) < 4:
            t.dims.append(1)
        elif k == 1 and len(t.dims) > 1:
            t.dims.pop()
        elif k == 2:
            t.dims = t.dims + [1] * (5 - len(t.dims))
        else:
            j = rng.randrange(len(t.dims)) if t.dims else 0
            if t.dims:
                t.dims[j] = rng.choice([0, 1, t.dims[j] - 1, t.dims[j] + 1, t.dims[j] * 2, 2**62, 2**63, 2**64 - 1])
        return f"tensor {name} dims = {t.dims}", {"header": d.header()}
    if op == "offset":
        t.offset = rng.choice([t.offset + 1, t.offset + 32, max(0, t.offset - 32), 2**40, 2**64 - 1])
        return f"tensor {name} offset = {t.offset}", {"header": d.header()}
    if op == "name":
        other = rng.choice(d.tensors).name
        t.name = rng.choice([b"", b"x" * 64, other, b"blk.0.ffn_up_exps.weight", b"blk.99.attn_norm.weight",
                             b"foo.weight", t.name + b"\xff"])
        return f"tensor {name} renamed {t.name[:70]!r}", {"header": d.header()}
    if op == "delete":
        del d.tensors[i]
        return f"tensor info {name} deleted", {"header": d.header()}
    d.tensors.insert(i, GTensor(t.name, list(t.dims), t.ttype, t.offset))
    return f"tensor info {name} duplicated", {"header": d.header()}


def _gguf_kv(rng, doc: GGUFDoc, arch: str):
    d = GGUFDoc(doc.path, doc.version, [GKV(k.key, k.vtype, k.payload) for k in doc.kvs], list(doc.tensors),
                doc.alignment, doc.data_offset, doc.size)
    hot = [i for i, kv in enumerate(d.kvs) if kv.key.startswith(arch.encode() + b".") or kv.key in
           (b"general.alignment", b"general.architecture", b"expert_pack.pack_id")]
    i = rng.choice(hot) if hot and rng.random() < 0.75 else rng.randrange(len(d.kvs))
    kv = d.kvs[i]
    key = kv.key.decode(errors="replace")
    op = rng.choice(["value", "value", "value", "type", "delete", "duplicate", "rename"])
    if op == "value":
        v = _dec(kv)
        if kv.vtype in _INT_RANGE:
            lo, hi = _INT_RANGE[kv.vtype]
            cands = [x for x in (0, 1, v - 1, v + 1, v * 2, v * 1000, hi, lo, hi // 2 + 1) if lo <= x <= hi]
            nv = rng.choice(cands)
            kv.payload = _enc(kv.vtype, nv)
        elif kv.vtype in (6, 12):
            nv = rng.choice([0.0, -0.0, -1.0, math.inf, -math.inf, math.nan, 1e38, 1e-38, -v, v * 10, v / 10])
            kv.payload = _enc(kv.vtype, nv)
        elif kv.vtype == 7:
            nv = rng.choice([0, 1, 2, 255])
            kv.payload = bytes([nv])
        elif kv.vtype == T_STRING:
            nv = rng.choice([b"", b"x" * 300, b"llama", b"qwen3", v + b"x", v[:-1], b"\xff\xfe", v.upper()])
            kv.payload = _enc(T_STRING, nv)
        else:  # array
            et, cnt = struct.unpack_from("<IQ", kv.payload)
            items = kv.payload[12:]
            k = rng.randrange(4)
            if k == 0:
                nc = rng.choice([0, max(0, cnt - 1), cnt + 1, 2**32, 2**62])
                kv.payload = struct.pack("<IQ", et, nc) + items
                nv = f"count {nc}"
            elif k == 1:
                ne = rng.choice([x for x in (0, 4, 5, 6, 8, 9, 10, 13) if x != et])
                kv.payload = struct.pack("<IQ", ne, cnt) + items
                nv = f"element type {ne}"
            elif k == 2 and et in _SCALAR and cnt:
                sz = struct.calcsize(_SCALAR[et])
                j = rng.randrange(cnt)
                x = struct.unpack_from(_SCALAR[et], items, j * sz)[0]
                y = rng.choice([0, 1, -1, 2**31, math.inf, math.nan]) if et in (6, 12) else \
                    rng.choice([0, _INT_RANGE.get(et, (0, 1))[1], x + 1])
                try:
                    b = struct.pack(_SCALAR[et], y)
                except (struct.error, OverflowError):
                    b = struct.pack(_SCALAR[et], 0)
                kv.payload = struct.pack("<IQ", et, cnt) + items[:j * sz] + b + items[(j + 1) * sz:]
                nv = f"item {j} = {y}"
            else:
                cut = rng.randrange(len(items) + 1)
                kv.payload = struct.pack("<IQ", et, cnt) + items[:cut]
                nv = f"items cut to {cut} bytes"
        return f"kv {key} = {_clip(repr(nv), 40)}", {"header": d.header()}
    if op == "type":
        v = _dec(kv)
        nt = rng.choice([x for x in (4, 5, 10, 6, 8, 7, 9, 13) if x != kv.vtype])
        if nt == 13 or kv.vtype not in _SCALAR or rng.random() < 0.3:
            kv.vtype = nt  # the bytes stay: a type confusion
            return f"kv {key} type field = {nt} (payload unchanged)", {"header": d.header()}
        try:
            nv = v if nt != 6 else float(v)
            kv.payload = _enc(nt, nv if nt != T_STRING else str(v)) if nt != 9 else struct.pack("<IQ", 4, 1) + \
                struct.pack("<I", int(v) & 0xFFFFFFFF)
            kv.vtype = nt
        except (struct.error, TypeError, ValueError, OverflowError):
            kv.vtype = nt
        return f"kv {key} retyped to {nt}", {"header": d.header()}
    if op == "delete":
        del d.kvs[i]
        return f"kv {key} deleted", {"header": d.header()}
    if op == "duplicate":
        d.kvs.insert(rng.randrange(len(d.kvs) + 1), GKV(kv.key, kv.vtype, kv.payload))
        return f"kv {key} duplicated", {"header": d.header()}
    kv.key = rng.choice([b"", b"k" * 70000, d.kvs[rng.randrange(len(d.kvs))].key, kv.key + b".x", b"\xff" * 4])
    return f"kv {key} renamed {kv.key[:40]!r}", {"header": d.header()}


def write_gguf(doc: GGUFDoc, recipe: dict, dst: Path) -> None:
    src = doc.path
    if "raw" in recipe:
        op = recipe["raw"]
        _copy(src, dst)
        if op[0] == "flip":
            with open(dst, "r+b") as f:
                f.seek(op[1])
                b = f.read(1)
                f.seek(op[1])
                f.write(bytes([b[0] ^ (1 << op[2])]))
        elif op[0] == "cut":
            os.truncate(dst, op[1])
        else:
            with open(dst, "ab") as f:
                f.write(b"\x5a" * op[1])
        return
    if "relaid" in recipe:
        i, new = recipe["relaid"]
        _write_relaid(doc, i, new, dst)
        return
    head = recipe["header"]
    with open(src, "rb") as a, open(dst, "wb") as b:
        b.write(head)
        n = doc.size - doc.data_offset
        off, out = doc.data_offset, len(head)
        while n > 0:
            k = os.copy_file_range(a.fileno(), b.fileno(), n, off, out)
            if k <= 0:
                break
            off, out, n = off + k, out + k, n - k


def _write_relaid(doc: GGUFDoc, i: int, new_type: int, dst: Path) -> None:
    """Tensor i retyped, its data cut or zero-padded to the new size, every offset recomputed: a well-formed GGUF
    (what a converter with a wrong type table would write)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    raw = doc.path.read_bytes()
    tensors = [GTensor(t.name, list(t.dims), t.ttype, t.offset) for t in doc.tensors]
    datas = []
    for j, t in enumerate(doc.tensors):
        bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(t.ttype)]
        nb = math.prod(t.dims) // bs * ts
        datas.append(raw[doc.data_offset + t.offset: doc.data_offset + t.offset + nb])
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(new_type)]
    t = tensors[i]
    t.ttype = new_type
    n_el = math.prod(t.dims)
    nb = -(-n_el // bs) * ts  # a row the block does not divide: sized as whole blocks
    datas[i] = (datas[i] + b"\0" * nb)[:nb]
    off = 0
    for t, data in zip(tensors, datas):
        t.offset = off
        off += len(data) + (-len(data) % doc.alignment)
    d = GGUFDoc(doc.path, doc.version, doc.kvs, tensors, doc.alignment, doc.data_offset, doc.size)
    with open(dst, "wb") as f:
        f.write(d.header())
        for data in datas:
            f.write(data + b"\0" * (-len(data) % doc.alignment))


# ---------------------------------------------------------------------------------------------------------
# pack data faults

def mutate_pack(rng: random.Random, base: Base) -> tuple[str, tuple]:
    from ggml_expert_pack.packer.format import layers_from_manifest
    layers = layers_from_manifest(base.manifest)
    size = base.manifest["pack"]["size"]
    l = rng.choice(layers)
    e = rng.randrange(base.manifest["n_experts"])
    blk = l.expert_offset(e)
    op = rng.choice(["header", "reserved", "block", "block", "block", "padding", "gap", "zero", "swap", "cut",
                     "append"])
    if op == "header":
        i = rng.randrange(124)
        return f"header byte {i} flipped", ("flip", i, rng.randrange(8))
    if op == "reserved":
        i = rng.randrange(124, 4096)
        return f"reserved header byte {i} set", ("flip", i, rng.randrange(8))
    if op == "block" or (op == "padding" and l.block_bytes == l.expert_stride):
        i = blk + rng.randrange(l.block_bytes)
        return f"layer {l.layer} expert {e} block byte {i - blk} flipped", ("flip", i, rng.randrange(8))
    if op == "padding":
        i = blk + rng.randrange(l.block_bytes, l.expert_stride)
        return f"layer {l.layer} expert {e} padding byte {i - blk} set", ("flip", i, rng.randrange(8))
    if op == "gap":
        gaps = [(a.offset + a.bytes, b.offset) for a, b in zip(l.roles, l.roles[1:]) if b.offset > a.offset + a.bytes]
        if gaps:
            a, b = rng.choice(gaps)
            i = blk + rng.randrange(a, b)
            return f"layer {l.layer} expert {e} gap byte {i - blk} set", ("flip", i, rng.randrange(8))
        i = blk + rng.randrange(l.block_bytes)
        return f"layer {l.layer} expert {e} block byte {i - blk} flipped", ("flip", i, rng.randrange(8))
    if op == "zero":
        page = rng.randrange(l.expert_stride // 4096)
        return f"layer {l.layer} expert {e} page {page} zeroed", ("zero", blk + page * 4096, 4096)
    if op == "swap":
        e2 = (e + 1 + rng.randrange(base.manifest["n_experts"] - 1)) % base.manifest["n_experts"]
        return f"layer {l.layer} experts {e} and {e2} swapped", ("swap", blk, l.expert_offset(e2), l.expert_stride)
    if op == "cut":
        n = rng.choice([0, 100, 4095, 4096, size - 4096, size - 1, rng.randrange(size)])
        return f"truncated to {n} of {size} bytes", ("cut", n)
    n = rng.choice([1, 4096])
    return f"{n} bytes appended", ("append", n)


def write_pack_fault(base: Base, op: tuple, dst: Path) -> bool:
    """Apply a data fault to a copy of experts.pack; False when the bytes did not change (a no-op)."""
    p = dst / "experts.pack"
    _copy(base.pack / "experts.pack", p)
    with open(p, "r+b") as f:
        if op[0] == "flip":
            f.seek(op[1])
            b = f.read(1)
            f.seek(op[1])
            f.write(bytes([b[0] ^ (1 << op[2])]))
        elif op[0] == "zero":
            f.seek(op[1])
            old = f.read(op[2])
            f.seek(op[1])
            f.write(b"\0" * op[2])
            return any(old)
        elif op[0] == "swap":
            f.seek(op[1])
            a = f.read(op[3])
            f.seek(op[2])
            b = f.read(op[3])
            f.seek(op[1])
            f.write(b)
            f.seek(op[2])
            f.write(a)
            return a != b
        elif op[0] == "cut":
            f.truncate(op[1])
        else:
            f.seek(0, 2)
            f.write(b"\0" * op[1])
    return True


# ---------------------------------------------------------------------------------------------------------
# running a class

class Campaign:
    """Runs mutations of each class against one base, with one worker; keeps the directories of failures."""

    def __init__(self, base: Base, worker: Worker, seed: int, keep: bool = False, crash_log: str | None = None,
                 log=print):
        self.base, self.worker, self.seed, self.keep, self.crash_log, self.log = base, worker, seed, keep, \
            crash_log, log
        self.norm = {}
        self.docs: dict[str, GGUFDoc] = {}

    def _doc(self, which: str) -> GGUFDoc:
        if which not in self.docs:
            self.docs[which] = parse_gguf(self.base.pack / "trunk.gguf" if which == "trunk" else self.base.source)
        return self.docs[which]

    def run(self, cls: str, count: int, only: int | None = None, budget_s: float | None = None) -> list[Result]:
        results = []
        t0 = time.monotonic()
        for i in ([only] if only is not None else range(count)):
            if budget_s is not None and time.monotonic() - t0 > budget_s:
                self.log(f"{cls}: time budget reached after {len(results)} mutations")
                break
            r = self.one(cls, i)
            results.append(r)
            if r.bad:
                self.log("FAIL " + r.line())
                if self.crash_log:
                    with open(self.crash_log, "a") as f:
                        f.write(r.line() + "\n")
            elif only is not None:
                self.log(f"{cls} #{i} | {r.desc} | " + "; ".join(f"{s.name}: {s.outcome} ({_clip(s.detail, 160)})"
                                                                  for s in r.stages))
        return results

    def one(self, cls: str, i: int) -> Result:
        rng = random.Random(f"{self.seed}:{cls}:{i}")
        d = self.base.workdir / "m" / f"{cls}-{i}"
        if d.exists():
            shutil.rmtree(d)
        r = Result(cls, i, "", seed=self.seed)
        try:
            getattr(self, "_" + cls.replace("-", "_"))(rng, d, r)
        finally:
            if r.bad or self.keep:
                keep = self.base.workdir / "kept" / d.name
                if keep.exists():
                    shutil.rmtree(keep)
                keep.parent.mkdir(parents=True, exist_ok=True)
                if d.exists():
                    shutil.move(str(d), keep)
                r.kept = str(keep)
            elif d.exists():
                shutil.rmtree(d)
        return r

    def _stages(self, d: Path, r: Result, must_refuse: bool, want_tokens: list[int] | None = None,
                any_listing: bool = False) -> None:
        """verify, inspect and load of pack `d`. `any_listing`: the manifest was resealed, so verify and inspect
        may accept it with what it now says (its data and trunk are the original's: loading must still generate
        the original's tokens)."""
        norm = {str(d): "PACK"}
        r.stages.append(cli_stage("verify", ["verify", str(d), "--quiet"], None if any_listing else self.base.verify_out,
                                  norm, must_refuse))
        r.stages.append(cli_stage("inspect", ["inspect", str(d)], None if any_listing else self.base.inspect_out, norm))
        st, _ = load_stage(self.worker, {"id": f"{r.cls}-{r.index}", "model": str(d / "trunk.gguf"),
                                         "pack": str(d)}, want_tokens or self.base.tokens)
        r.stages.append(st)

    def _manifest(self, rng, d, r, resealed=False):
        desc, data = mutate_manifest(rng, self.base, structured_only=resealed)
        _link_pack(self.base, d, ("manifest.json", "experts.pack") if resealed else ("manifest.json",))
        (d / "manifest.json").write_bytes(data)
        if resealed:
            desc = f"{desc} ({_reseal(self.base, data, d)})"
        r.desc = desc
        try:
            same = json.loads(data) == self.base.manifest
        except (ValueError, RecursionError):
            same = False
        self._stages(d, r, must_refuse=not resealed and not same, any_listing=resealed)

    def _manifest_resealed(self, rng, d, r):
        self._manifest(rng, d, r, resealed=True)

    def _trunk(self, rng, d, r):
        doc = self._doc("trunk")
        desc, recipe = mutate_gguf(rng, doc, self.base.arch, "trunk")
        r.desc = desc
        _link_pack(self.base, d, ("trunk.gguf",))
        write_gguf(doc, recipe, d / "trunk.gguf")
        same = (d / "trunk.gguf").read_bytes() == (self.base.pack / "trunk.gguf").read_bytes() \
            if (d / "trunk.gguf").stat().st_size == doc.size else False
        self._stages(d, r, must_refuse=not same)

    def _trunk_resealed(self, rng, d, r):
        """A mutated trunk recorded in the manifest as a build would record it (size, checksums, digest, pack
        header): the loader meets the mutation itself. A pack that verify accepts may generate other tokens (its
        trunk is a different, valid model); one verify refuses must be refused at load or generate the original's."""
        from ggml_expert_pack.pybind import xxh3_128
        doc = self._doc("trunk")
        desc, recipe = mutate_gguf(rng, doc, self.base.arch, "trunk")
        r.desc = desc + " (resealed)"
        _link_pack(self.base, d, ("trunk.gguf", "manifest.json", "experts.pack"))
        write_gguf(doc, recipe, d / "trunk.gguf")
        data = (d / "trunk.gguf").read_bytes()
        head = len(recipe["header"]) if "header" in recipe else self.base.manifest["trunk"]["header_size"]
        m = json.loads(self.base.manifest_text)
        m["trunk"].update(size=len(data), checksum=xxh3_128(data).hex(), header_size=min(head, len(data)),
                          header_checksum=xxh3_128(data[:head]).hex())
        _reseal(self.base, json.dumps(m).encode(), d)
        norm = {str(d): "PACK"}
        v = cli_stage("verify", ["verify", str(d), "--quiet"], None, norm)
        r.stages += [v, cli_stage("inspect", ["inspect", str(d)], None, norm)]
        st, _ = load_stage(self.worker, {"id": f"{r.cls}-{r.index}", "model": str(d / "trunk.gguf"), "pack": str(d)},
                           None if v.outcome == "identical" else self.base.tokens)
        if st.outcome == "changed":
            st.detail += f" although verify refuses the pack ({_clip(v.detail, 120)})"
        r.stages.append(st)

    def _pack(self, rng, d, r):
        desc, op = mutate_pack(rng, self.base)
        r.desc = desc
        _link_pack(self.base, d, ("experts.pack",))
        changed = write_pack_fault(self.base, op, d)
        self._stages(d, r, must_refuse=changed)

    def _source(self, rng, d, r):
        doc = self._doc("source")
        desc, recipe = mutate_gguf(rng, doc, self.base.arch, "source")
        r.desc = desc
        d.mkdir(parents=True)
        src = d / "source.gguf"
        write_gguf(doc, recipe, src)
        pack = d / "pack"
        status, rc, out, err = run_cli(["build", str(src), "-o", str(pack), "--quiet"])
        lines = [l for l in err.splitlines() if l.strip()]
        if status != "ok":
            r.stages.append(Stage("build", status, err))
            return
        if rc != 0:
            bad = "Traceback (most recent call last)" in err or len(lines) != 1 or "--debug shows where" in lines[0]
            r.stages.append(Stage("build", "traceback" if bad else "refused", " / ".join(lines[-3:])))
            if rc != 0 and pack.exists() and any(pack.iterdir()):
                r.stages.append(Stage("build", "changed", f"a refused build left {sorted(p.name for p in pack.iterdir())}"))
            return
        r.stages.append(Stage("build", "identical"))
        ref, res = load_stage(self.worker, {"id": f"{r.cls}-{r.index}-stock", "model": str(src)}, None, "stock")
        for cmd in ("verify", "inspect"):
            status, rc, out, err = run_cli([cmd, str(pack)] + (["--quiet"] if cmd == "verify" else []))
            if status != "ok" or rc != 0:
                r.stages.append(Stage(cmd, "traceback" if status != "ok" else "changed",
                                      f"fails on a pack build wrote: {_clip(err, 200)}"))
            else:
                r.stages.append(Stage(cmd, "identical"))
        st, got = load_stage(self.worker, {"id": f"{r.cls}-{r.index}", "model": str(pack / "trunk.gguf"),
                                           "pack": str(pack)}, res["tokens"] if res and res.get("ok") else None)
        if st.outcome == "identical" and ref.outcome != "identical":
            st = Stage("load", "changed", f"build accepted a source stock llama.cpp fails on ({ref.outcome}: "
                                          f"{_clip(ref.detail, 160)}), and the pack runs")
        r.stages.append(st)

    def _http(self, rng, d, r):
        self.http.one(rng, r)


# ---------------------------------------------------------------------------------------------------------
# http (scripts only)

class HttpFuzz:
    """`expert-pack serve` on 127.0.0.1 with malformed requests; the server is restarted if it dies."""
    PATHS = ["/v1/chat/completions", "/v1/completions", "/completion", "/tokenize", "/detokenize", "/v1/models",
             "/health", "/props", "/metrics", "/", "/nope", "/v1/chat/completions/../../x"]

    def __init__(self, base: Base, log=print):
        self.base, self.log = base, log
        self.proc = None
        self.canary = None
        self.n = 0

    def start(self) -> None:
        from expert_pack_devtools.bench_client import free_port, wait_healthy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.err = open(self.base.workdir / "serve.stderr", "ab")
        self.proc = subprocess.Popen([*expert_pack_argv(), "serve", "-m",
                                      str(self.base.pack / "trunk.gguf"), "--expert-pack", str(self.base.pack),
                                      "-c", "256", "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=self.err, start_new_session=True)
        if not wait_healthy(self.url, self.proc, 120):
            raise RuntimeError("expert-pack serve did not start (see serve.stderr)")
        if self.canary is None:
            self.canary = self._canary()

    def _canary(self):
        st, body = self._send("POST", "/completion", json.dumps({"prompt": PROMPT, "n_predict": N_TOKENS,
                                                                 "temperature": 0}).encode())
        return json.loads(body).get("content") if st == 200 else None

    def _send(self, method, path, body, headers=None, timeout=30.0):
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            resp = c.getresponse()
            return resp.status, resp.read(1 << 20)
        finally:
            c.close()

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None

    def one(self, rng: random.Random, r: Result) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        method, path, body, desc = self._request(rng)
        r.desc = desc
        import http.client
        try:
            st, data = self._send(method, path, body)
        except (TimeoutError, OSError, http.client.HTTPException) as e:
            dead = self.proc.poll() is not None
            r.stages.append(Stage("http", "crash" if dead else "hang", f"{type(e).__name__}: {e}"))
            if dead:
                self.proc = None
            return
        if st >= 500 and st != 503:
            r.stages.append(Stage("http", "traceback", f"HTTP {st}: {_clip(data.decode(errors='replace'), 200)}"))
        elif b"Traceback (most recent call last)" in data:
            r.stages.append(Stage("http", "traceback", "a traceback in the body"))
        elif st >= 400:
            r.stages.append(Stage("http", "refused", f"HTTP {st}"))
        else:
            r.stages.append(Stage("http", "identical", f"HTTP {st}"))
        if self.proc.poll() is not None:
            r.stages.append(Stage("http", "crash", f"the server exited ({self.proc.returncode})"))
            self.proc = None
            return
        self.n += 1
        if self.n % 25 == 0 and self.canary is not None and self._canary() != self.canary:
            r.stages.append(Stage("http", "changed", "a valid request now generates different text"))

    def _request(self, rng: random.Random):
        path = rng.choice(self.PATHS)
        method = rng.choice(["POST", "POST", "POST", "GET", "PUT", "DELETE", "OPTIONS"])
        valid = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                 "/v1/completions": {"prompt": PROMPT, "max_tokens": 2}, "/completion": {"prompt": PROMPT,
                                                                                         "n_predict": 2},
                 "/tokenize": {"content": PROMPT}, "/detokenize": {"tokens": [1, 2, 3]}}.get(path, {"x": 1})
        body = json.loads(json.dumps(valid))
        k = rng.randrange(6)
        if k == 0:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 512)))
            return method, path, raw, f"{method} {path} with random bytes"
        if k == 1:
            text = json.dumps(body).encode()
            return method, path, text[:rng.randrange(len(text))], f"{method} {path} with truncated JSON"
        key = rng.choice(sorted(body) + ["stream", "temperature", "stop", "n_predict", "max_tokens", "messages",
                                         "tokens", "prompt", "model", "logprobs", "seed"])
        v = rng.choice([None, -1, 0, 2**31, 10**20, 1.5, math.nan, "x", "", [], {}, [None], [-1], [2**40], True,
                        "\udcff", "p" * 100_000, [{"role": 5}], [{"content": None}]])
        if key in ("max_tokens", "n_predict") and isinstance(v, int) and not isinstance(v, bool) and v > 8:
            v = rng.choice([v, 8])  # large values are refused or bounded by the context: keep the runs short
        body[key] = v
        try:
            data = json.dumps(body, allow_nan=True).encode("utf-8", errors="surrogatepass")
        except (TypeError, ValueError):
            data = b"{}"
        return method, path, data, f"{method} {path} {key}={_clip(repr(v), 40)}"


# ---------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--count", type=int, default=200, help="mutations per class (default 200)")
    ap.add_argument("--class", dest="classes", action="append", choices=CLASSES,
                    help="a class to run (repeatable; default every class)")
    ap.add_argument("--seed", type=int, default=1, help="mutations are a function of (seed, class, index)")
    ap.add_argument("--only", type=int, help="run only mutation INDEX (with one --class): a failure's repro")
    ap.add_argument("--workdir", help="where the model, the pack and kept mutations go (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep every mutation's directory (default: failures only)")
    ap.add_argument("--crash-log", help="append one line per failing mutation to this file")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per load-and-generate job (default: 30x "
                    "the unmutated pack's, at least 30)")
    ap.add_argument("--budget-s", type=float, help="stop each class after this many seconds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main()
    if args.count <= 0:
        ap.error("--count must be positive")
    classes = args.classes or list(CLASSES)
    if args.only is not None and len(classes) != 1:
        ap.error("--only needs exactly one --class")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="expert-pack-fuzz-"))
    worker = Worker(workdir, 300)
    results: list[Result] = []
    try:
        base = prepare(workdir, worker=worker, log=lambda m: print(m, file=sys.stderr))
        worker.timeout_s = args.timeout or max(30.0, 30 * base.load_s)
        camp = Campaign(base, worker, args.seed, keep=args.keep, crash_log=args.crash_log,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
        for cls in classes:
            t0 = time.monotonic()
            if cls == "http":
                camp.http = HttpFuzz(base)
            try:
                rs = camp.run(cls, args.count, args.only, args.budget_s)
            finally:
                if cls == "http":
                    camp.http.stop()
            results += rs
            print(f"{cls}: {len(rs)} mutations in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        worker.close()
    print(table(results))
    bad = [r for r in results if r.bad]
    if bad:
        print(f"\n{len(bad)} failing mutation(s):")
        for r in bad:
            print("  " + r.line())
    print(f"\nworkdir: {workdir}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
