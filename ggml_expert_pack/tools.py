"""The fork's own llama.cpp tools (llama-server, llama-cli, llama-bench), built into the wheel with `--expert-pack`
and the `--expert-*` cache flags (vendor/patches/0006). `expert-pack llama-server ARGS` runs the bundled binary."""
from __future__ import annotations

import os
import sys
from pathlib import Path

TOOLS = ("llama-server", "llama-cli", "llama-bench")
BIN_DIR = Path(__file__).resolve().parent / "bin"


def tool_path(name: str) -> Path:
    """The bundled binary `name`; FileNotFoundError if this install was built without the tools."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; the fork ships {', '.join(TOOLS)}")
    p = BIN_DIR / name
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: this install was built without the fork's tools "
                                "(build with CMAKE_ARGS=-DEXPERT_PACK_BUILD_TOOLS=ON)")
    return p


def exec_tool(name: str, args: list[str]) -> None:
    """Replace this process with the tool (its exit status becomes ours)."""
    p = tool_path(name)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(p), [str(p), *args])
