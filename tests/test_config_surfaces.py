"""Every provider configuration key is on every surface: the C library (src/config.cpp, through expert_pack_config_schema), the Python binding
(pybind CONFIG_KEYS), `expert-pack serve`'s flags, the fork's --expert-* flags (vendor/patches), the configuration
table of docs/ARCHITECTURE.md and the README. A key added to one and forgotten in another fails here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# set from the pack folder (--expert-pack / pack_dir), not by a flag of their own
PATH_KEYS = {"pack_path", "manifest_path"}


def c_keys() -> set[str]:
    """The keys as the C library describes them (expert_pack_config_schema: the one source)."""
    from ggml_expert_pack.pybind.provider import config_schema
    keys = {k["name"] for k in config_schema()}
    assert len(keys) >= 10, keys
    return keys


def test_python_binding_knows_every_key():
    from ggml_expert_pack.pybind.provider import CONFIG_KEYS
    assert set(CONFIG_KEYS) == c_keys()


def test_serve_has_a_flag_for_every_key():
    import argparse

    from ggml_expert_pack.server.main import KEY_FLAGS, add_serve
    ap = argparse.ArgumentParser()
    add_serve(ap.add_subparsers())
    serve = ap._subparsers._group_actions[0].choices["serve"]
    options = {o for a in serve._actions for o in a.option_strings}
    for key in c_keys():
        assert key in KEY_FLAGS, f"serve has no flag for {key}"
        assert KEY_FLAGS[key] in options, f"{KEY_FLAGS[key]} ({key}) is not a serve flag"
        if key not in PATH_KEYS:  # the fork's spelling too, so one command line serves with either server
            fork = "--expert-" + KEY_FLAGS[key][2:]
            assert fork in options, f"serve does not accept the fork's spelling {fork}"


def test_the_forks_tools_have_a_flag_for_every_key():
    from ggml_expert_pack.server.main import KEY_FLAGS
    patch = (ROOT / "vendor" / "patches" / "0006-expert-pack-common-flags.patch").read_text()
    for key in c_keys() - PATH_KEYS:
        fork = "--expert-" + KEY_FLAGS[key][2:]
        assert f'{{"{fork}"}}' in patch, f"the fork's common flags lack {fork} ({key})"
        assert f'"{fork}"' in patch.split("llama-bench.cpp", 1)[1], f"llama-bench lacks {fork} ({key})"
        assert f'j["{key}"]' in patch, f"common_expert_pack_params::to_json does not set {key}"


def test_docs_name_every_key():
    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    table = {k for row in arch.splitlines() if row.startswith("| `")
             for k in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])}
    readme = (ROOT / "README.md").read_text()
    for key in c_keys():
        assert key in table, f"docs/ARCHITECTURE.md's configuration table lacks {key}"
        assert key in PATH_KEYS or f"`{key}`" in readme, f"README does not name {key}"
