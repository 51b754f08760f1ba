"""A short soak of `expert-pack serve` (scripts/soak.py): normal, streaming, disconnecting, malformed and slow clients
for 20 s on the tiny model; it must finish with no 5xx, no unexpected reply, no traceback in the server's log, the
server healthy at the end and stopping cleanly on SIGTERM."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_short_soak(packs, tmp_path):
    pack = packs("qwen3moe")[1]
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "20", "--clients", "4",
                        "--pack", str(pack), "--json", str(out), "--log", str(tmp_path / "server.log")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["http_5xx"] == 0 and rep["unexpected"] == 0, rep
    assert rep["healthy_at_end"] and rep["server_exit"] == 0 and rep["server_tracebacks"] == 0
    assert set(rep["by_kind"]) == {"normal", "stream", "disconnect", "malformed", "slow"}, rep["by_kind"]
    assert all(d["requests"] > 0 for d in rep["by_kind"].values())
    for s in (rep["start"], rep["end"]):
        assert s["rss_mib"] > 0 and s["fds"] > 0
    # every answered request was logged by the server (abandoned ones too, once the server noticed)
    assert rep["server_request_lines"] > 0
