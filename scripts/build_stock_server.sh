#!/usr/bin/env bash
# Build stock llama.cpp's llama-server (CPU, static) from the pristine vendored source (the sdist pinned in
# vendor/upstream.lock.json, unpatched) into build/stock-server: the baseline that
# devtools/expert_pack_devtools/upstream_suite.py runs llama.cpp's own server test suite against.
# Shares build/archs-src with scripts/build_archs_tool.sh. Once: 55 minutes on the 2-core machine beside other builds.
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
cmake -S "$SRC/vendor/llama.cpp" -B build/stock-server -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/stock-server --target llama-server -j"$(nproc)" >/dev/null
echo build/stock-server/bin/llama-server
