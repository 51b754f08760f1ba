"""The fork's own llama.cpp tools (llama-server, llama-cli, llama-bench), built into the wheel with `--expert-pack`
and the `--expert-*` cache flags (vendor/patches/0006). `expert-pack llama-server ARGS` runs the bundled binary."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

TOOLS = ("llama-server", "llama-cli", "llama-bench")


def bin_dirs() -> list[Path]:
    """Where the tools may be: this package's bin/, and the installed wheel's (beside its llama_cpp package) when
    this package is imported from a source checkout."""
    dirs = [Path(__file__).resolve().parent / "bin"]
    spec = importlib.util.find_spec("llama_cpp")
    if spec and spec.origin:
        dirs.append(Path(spec.origin).resolve().parent.parent / "ggml_expert_pack" / "bin")
    return dirs


def tool_path(name: str) -> Path:
    """The bundled binary `name`; FileNotFoundError if this install was built without the tools."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; the fork ships {', '.join(TOOLS)}")
    for d in bin_dirs():
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"{name} is not installed (looked in {', '.join(map(str, bin_dirs()))}): this install "
                            "was built without the fork's tools (CMAKE_ARGS=-DEXPERT_PACK_BUILD_TOOLS=OFF)")


def exec_tool(name: str, args: list[str]) -> None:
    """Replace this process with the tool (its exit status becomes ours)."""
    p = tool_path(name)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(p), [str(p), *args])
