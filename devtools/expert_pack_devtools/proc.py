"""Child Python processes that import the installed packages wherever they run.

Python puts a child's working directory (`-c`, `-m`) first on sys.path; in the repository's checkout the source folder
ggml_expert_pack/ found there is not the installed package (the wheel adds packer/, server/ and pybind/ into it,
pyproject.toml), so `python -m ggml_expert_pack.cli` would fail there. These children drop that entry first, as
Python 3.11's `-P` does."""
from __future__ import annotations

import sys

_SAFE_PATH = "import sys\nif sys.path[:1] == ['']: del sys.path[0]\n"


def python_c(code: str) -> list[str]:
    """argv of `python -c CODE` with this interpreter, the working directory off sys.path."""
    return [sys.executable, "-c", _SAFE_PATH + code]


def expert_pack_argv() -> list[str]:
    """argv prefix that runs the installed `expert-pack` command (append its arguments)."""
    return python_c("from ggml_expert_pack.cli import main\nsys.exit(main())")


def shown(argv: list[str]) -> str:
    """A command line as a person would type it: expert_pack_argv()'s prefix shown as `expert-pack`."""
    import shlex
    pre = expert_pack_argv()
    if argv[:len(pre)] == pre:
        argv = ["expert-pack", *argv[len(pre):]]
    return shlex.join(argv)
