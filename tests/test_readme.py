"""The README's set-up and test commands are the ones CI runs."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    return [ln.strip() for b in blocks for ln in b.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_ci_runs_the_readmes_quick_start_commands():
    cmds = quick_start_commands()
    assert cmds, "no commands found in the README's Quick start"
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    missing = [c for c in cmds if c not in ci]
    assert not missing, f".ci/run does not run these README commands as written: {missing}"
    # and in the README's order
    assert [ci.index(c) for c in cmds] == sorted(ci.index(c) for c in cmds)


def test_ci_uses_a_fresh_virtualenv_without_system_packages():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .venv" in ci and "--system-site-packages" not in ci
