"""Offline packer: GGUF -> expert pack (docs/FORMAT.md). `build`, `verify`, `inspect`."""
from .build import BuildError, BuildResult, build
from .format import MANIFEST_FILE, PACK_FILE, TRUNK_FILE
from .source import SourceError, open_source
from .verify import VerifyError, verify

__all__ = ["BuildError", "BuildResult", "MANIFEST_FILE", "PACK_FILE", "SourceError", "TRUNK_FILE", "VerifyError",
           "build", "open_source", "verify"]
