#!/usr/bin/env bash
# Build stock llama.cpp's own tests/test-llama-archs (CPU, static) from the pristine vendored source (the sdist
# pinned in vendor/upstream.lock.json, unpatched: the tool only writes models) into build/archs-tool.
# `test-llama-archs -o DIR` writes a small random model for every architecture llama.cpp can save;
# tests/test_all_archs.py packs and checks every MoE one. ~6 min on 2 cores, once.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cmake >/dev/null || python3 -m pip install -q 'cmake>=3.21'
SRC=build/archs-src
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    SDIST=$(python3 -c "import sys; sys.path.insert(0, 'vendor'); import prepare; print(prepare.fetch_sdist(offline=False))")
    rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
    tar -xzf "$SDIST" -C "$SRC.tmp" --strip-components=1
    mv "$SRC.tmp" "$SRC"
fi
cmake -S "$SRC/vendor/llama.cpp" -B build/archs-tool -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=ON \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/archs-tool --target test-llama-archs -j"$(nproc)" >/dev/null
echo build/archs-tool/bin/test-llama-archs
