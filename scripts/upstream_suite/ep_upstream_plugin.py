"""pytest plugin for llama.cpp's server test suite (tools/server/tests), loaded with `-p ep_upstream_plugin` by
scripts/upstream_server_suite.py: every model the suite would download runs as one local synthetic model instead.

The vendored files stay as they are; this patches their helper module `utils` once it is imported (its conftest does
that before any test):

* ServerProcess.start: a server whose model comes from Hugging Face (--hf-repo/--hf-file) or a URL (--model-url),
  or from a local file that does not exist, gets --model $EP_UPSTREAM_MODEL instead, or $EP_UPSTREAM_EMBEDDING_MODEL
  for the embedding presets (bert-bge-small: the same model with mean pooling in its metadata, as an embedding
  model has). Router servers (no model at all) stay as they are.
* ServerPreset.load_all: nothing to download, so it starts no servers.
* download_file: refuses (the suite's LoRA adapters, draft models and images are out of scope, known.toml).
"""
from __future__ import annotations

import os


def _patch(utils) -> None:
    model = os.environ["EP_UPSTREAM_MODEL"]
    embedding_model = os.environ.get("EP_UPSTREAM_EMBEDDING_MODEL", model)
    if getattr(utils.ServerProcess, "_ep_patched", False):
        return
    start = utils.ServerProcess.start

    def start_local(self, *args, **kwargs):
        remote = bool(self.model_hf_repo or self.model_hf_file or self.model_url)
        missing = bool(self.model_file) and not os.path.exists(self.model_file)
        if remote or missing:
            name = f"{self.model_hf_repo} {self.model_hf_file} {self.model_url} {self.model_file}"
            self.model_hf_repo = self.model_hf_file = self.model_url = None
            self.model_file = embedding_model if "bert-bge-small" in name else model
            print(f"ep_upstream_plugin: model {name} -> {self.model_file}")
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
