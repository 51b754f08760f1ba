"""What a model path given by a user is, and what to say when it is not a loadable model file.

Every front end (Python's `Llama(model_path=...)`, `expert-pack serve`, the fork's tools) checks the path
with `model_path_error` before llama.cpp opens it, so that a pack folder, a later shard or a trunk without
its pack is one clear sentence instead of "Failed to load model from file".
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_pack_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "manifest.json").is_file()


def model_path_error(path: str | os.PathLike, pack_given: bool, pack_hint: str = "expert_pack=PACK_DIR") -> str | None:
    """None if `path` looks like a model file to load; else the message that says what it is instead.

    `pack_given`: an expert pack is passed with it. `pack_hint`: how this front end passes a pack (a keyword in
    Python, `--expert-pack PACK_DIR` on a command line)."""
    p = Path(path)
    if not p.exists():
        parent = p.parent
        if not parent.is_dir():
            return f"{p}: no such file or directory ({parent} does not exist)"
        return f"{p}: no such file or directory"
    if p.is_dir():
        if is_pack_dir(p):
            return (f"{p} is an expert-pack folder: load {p / 'trunk.gguf'} as the model and pass the folder as "
                    f"the pack ({pack_hint.replace('PACK_DIR', str(p))})")
        return f"{p} is a directory, not a GGUF model file"
    m = _SHARD.match(p.name)
    if m and int(m["no"]) > 1:
        first = p.with_name(f"{m['stem']}-00001-of-{m['count']}.gguf")
        return f"{p} is shard {int(m['no'])} of {int(m['count'])} of a split model: give the first, {first}"
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"{p}: {e.strerror or e}"
    if magic != b"GGUF":
        return f"{p} is not a GGUF model file"
    try:
        from .gguf_file import GGUFFormatError, read_header
        h = read_header(p)
    except (GGUFFormatError, OSError, ValueError):
        return None  # llama.cpp's own loader says what is wrong with it
    split_no = h.get("split.no")
    if isinstance(split_no, int) and split_no > 0:
        count = h.get("split.count")
        return f"{p} is shard {split_no + 1} of {count} of a split model: give the first shard"
    if h.get("expert_pack.pack_id") and not pack_given:
        return (f"{p} is an expert-pack trunk (its routed experts are in the pack): pass the pack folder "
                f"({pack_hint})")
    return None


def check_pack_and_model(model_path: str | os.PathLike, config: dict) -> None:
    """Before llama.cpp opens anything: the pack as `expert-pack verify --quick` checks it (structure, identities,
    the trunk's header, tensor types and hyperparameters), and a model file that is not the pack's trunk (the
    original GGUF) as `expert-pack build` checks a source. What llama.cpp would assert or crash on, or silently
    compute wrongly with, is a ValueError naming the cause. `config`: the provider configuration (normalized)."""
    from .packer.source import SourceError, open_source
    from .packer.verify import VerifyError, verify
    manifest = Path(config.get("manifest_path", ""))
    pack_dir = manifest.parent
    try:
        verify(pack_dir, quick=True, progress=False)
    except VerifyError as e:
        raise ValueError(f"expert pack {pack_dir}: {e}") from None
    model = Path(model_path)
    try:
        is_trunk = model.resolve() == (pack_dir / "trunk.gguf").resolve()
    except OSError:
        is_trunk = False
    if not is_trunk:
        try:
            open_source(model)
        except SourceError as e:
            raise ValueError(f"{model}: {e}") from None
