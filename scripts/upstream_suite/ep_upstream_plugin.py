"""pytest plugin for llama.cpp's server test suite (tools/server/tests), loaded with `-p ep_upstream_plugin` by
scripts/upstream_server_suite.py: every model the suite would download runs as one local synthetic model instead.

The vendored files stay as they are; this patches their helper module `utils` once it is imported (its conftest does
that before any test):

* ServerProcess.start: a server whose model comes from Hugging Face (--hf-repo/--hf-file) or a URL (--model-url),
  or from a local file that does not exist, gets --model $EP_UPSTREAM_MODEL instead. Router servers (no model at
  all) stay as they are. The model is a random-weight tiny qwen3moe with the qwen2 vocabulary and a ChatML template.
* ServerPreset.load_all: nothing to download, so it starts no servers.
* download_file: refuses (the suite's LoRA adapters, draft models and images are out of scope, known.toml).
"""
from __future__ import annotations

import os


def _patch(utils) -> None:
    model = os.environ["EP_UPSTREAM_MODEL"]
    if getattr(utils.ServerProcess, "_ep_patched", False):
        return
    start = utils.ServerProcess.start

    def start_local(self, *args, **kwargs):
        remote = bool(self.model_hf_repo or self.model_hf_file or self.model_url)
        missing = bool(self.model_file) and not os.path.exists(self.model_file)
        if remote or missing:
            print(f"ep_upstream_plugin: model {self.model_hf_repo or ''} {self.model_hf_file or ''} "
                  f"{self.model_url or ''} {self.model_file or ''} -> {model}")
            self.model_hf_repo = self.model_hf_file = self.model_url = None
            self.model_file = model
        return start(self, *args, **kwargs)

    def no_download(url: str, output_file_path: str | None = None) -> str:
        raise RuntimeError(f"ep_upstream_plugin: no downloads (asked for {url})")

    utils.ServerProcess.start = start_local
    utils.ServerProcess._ep_patched = True
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    utils.download_file = no_download


def pytest_configure(config):
    import sys
    here = os.getcwd()  # the suite's tests folder (the runner starts pytest there)
    if here not in sys.path:
        sys.path.insert(0, here)
    import utils
    _patch(utils)


def pytest_collection_modifyitems(session, config, items):
    # test modules bind `download_file` with `from utils import *` at import time: patch their copies too
    import utils
    for mod in {it.module for it in items if getattr(it, "module", None) is not None}:
        if getattr(mod, "download_file", None) is not None:
            mod.download_file = utils.download_file
