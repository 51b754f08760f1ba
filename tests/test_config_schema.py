"""The C library describes its configuration keys (expert_pack_config_schema: name, type, default, range, values,
help); the other surfaces are checked against that one description, not against each other: the Python binding's key
list, `expert-pack serve`'s flags (their choices, the ranges and defaults their help states), and the configuration
table of docs/ARCHITECTURE.md (its default column). A drift in any of them fails here."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATH_KEYS = {"pack_path", "manifest_path"}


@pytest.fixture(scope="module")
def schema() -> dict[str, dict]:
    from ggml_expert_pack.pybind.provider import config_schema
    return {k["name"]: k for k in config_schema()}


def test_schema_is_complete_and_consistent(schema):
    from ggml_expert_pack.pybind.provider import normalize_config
    assert len(schema) >= 15
    for name, k in schema.items():
        assert k["type"] in {"path", "string", "size", "size_or_auto", "int", "bool", "enum"}, k
        assert k["help"], name
        if k["type"] == "int":
            assert k["min"] <= k["default"] <= k["max"], k
        if k["type"] == "enum":
            assert k["default"] in k["values"], k
    # the defaults are what the library applies: a configuration of only the paths validates, and every default
    # given explicitly validates too
    base = {"pack_path": "p", "manifest_path": "m"}
    for name, k in schema.items():
        if name not in PATH_KEYS and not (name == "prefetch" and k["default"]):
            normalize_config({**base, name: k["default"]})


def test_schema_ranges_are_enforced(schema):
    from ggml_expert_pack.pybind.provider import normalize_config
    base = {"pack_path": "p", "manifest_path": "m"}
    for name, k in schema.items():
        if k["type"] == "int":
            normalize_config({**base, name: k["min"]})
            normalize_config({**base, name: k["max"]})
            for bad in (k["min"] - 1, k["max"] + 1):
                with pytest.raises(ValueError, match=name):
                    normalize_config({**base, name: bad})
        if k["type"] == "enum":
            for v in k["values"]:
                normalize_config({**base, name: v})
            with pytest.raises(ValueError, match=name):
                normalize_config({**base, name: "no-such-mode"})


def test_python_binding_lists_the_schema(schema):
    from ggml_expert_pack.pybind.provider import CONFIG_KEYS
    assert set(CONFIG_KEYS) == set(schema)


def _serve_actions() -> dict[str, argparse.Action]:
    from ggml_expert_pack.server.main import add_serve
    ap = argparse.ArgumentParser()
    add_serve(ap.add_subparsers())
    serve = ap._subparsers._group_actions[0].choices["serve"]
    return {o: a for a in serve._actions for o in a.option_strings}


def _shown(v) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def test_serve_flags_follow_the_schema(schema):
    from ggml_expert_pack.server.main import KEY_FLAGS
    actions = _serve_actions()
    for name, k in schema.items():
        if name in PATH_KEYS:
            continue
        a = actions[KEY_FLAGS[name]]
        assert a.default is None, f"{KEY_FLAGS[name]} has a default of its own ({a.default!r}): the library's applies"
        text = a.help or ""
        if k["type"] == "bool":
            assert tuple(a.choices) == ("on", "off"), KEY_FLAGS[name]
        if k["type"] == "enum":
            assert set(a.choices) == set(k["values"]), KEY_FLAGS[name]
        m = re.search(r"\((\d+)\.\.(\d+)", text)
        if k["type"] == "int" and m:
            assert (int(m[1]), int(m[2])) == (k["min"], k["max"]), f"{KEY_FLAGS[name]} states {m[0]}"
        if k["type"] == "enum":  # "... spill (default: ...), victim ..."
            m = re.search(r"(\w+) \(default", text)
        else:
            m = re.search(r"default:? (\d+|on|off)\b", text)
        if m:
            assert m[1] == _shown(k["default"]), f"{KEY_FLAGS[name]} says default {m[1]}, the library's is {k['default']}"


def test_docs_table_defaults_follow_the_schema(schema):
    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    seen = set()
    for row in arch.splitlines():
        if not row.startswith("| `"):
            continue
        cells = [c.strip() for c in row.strip("|").split("|")]
        keys = re.findall(r"`([a-z_0-9]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")]
        for i, key in enumerate(keys):
            if key not in schema or key in PATH_KEYS:
                continue
            seen.add(key)
            shown = defaults[min(i, len(defaults) - 1)]
            first = re.split(r"\s|=", shown.replace("`", ""), maxsplit=1)[0]
            want = schema[key]["default"]
            want_text = json.dumps(want) if isinstance(want, str) else _shown(want).replace("on", "true").replace("off", "false")
            assert first == want_text, f"docs/ARCHITECTURE.md: {key} default {shown!r}, the library's is {want!r}"
    assert seen == set(schema) - PATH_KEYS
