#!/usr/bin/env bash
# The GPU script: one staged script for every GPU job (docs/ARCHITECTURE.md, "Decisions").
#
# Here (a machine with a package registry):
#   scripts/gpu.sh bundle                 pruned, patched upstream tree + Python 3.12 wheels -> .bundle/
# On the GPU machine (no registry; Python 3.12; run from the repository root, .bundle carried along):
#   scripts/gpu.sh build OUT              offline CUDA build (sm_90a) + install into $EP_SITE
#   scripts/gpu.sh test OUT               the test suite, GPU tests included
#   scripts/gpu.sh bench OUT NAME [ARGS]  a benchmark: python scripts/bench_NAME.py --out OUT ARGS
#   scripts/gpu.sh all OUT                build, then test
#   scripts/gpu.sh pipeline OUT QUESTION [ARGS]  build; the tests (EP_TEST_ARGS: which) while the benchmark model is
#                                         generated and packed; archs; then `expert-pack bench run QUESTION ARGS
#                                         --out OUT/systems` (docs/BENCHMARKS.md) -- meant for `start`
#   scripts/gpu.sh storage-pipeline OUT [ARGS]  build; the tests while the benchmark model is made in /dev/shm; then
#                                         scripts/bench_storage.py ARGS (decode vs storage bandwidth) -- for `start`
#   scripts/gpu.sh collect OUT            everything the detached stages wrote -> OUT/results.tgz (one file back)
#   scripts/gpu.sh archs OUT              release archs (EP_RELEASE_ARCHS, default "89;90a;120"): compile one CUDA
#                                         object for all of them and list its cubins with cuobjdump (not run)
#   scripts/gpu.sh start STAGE OUT        run STAGE detached (setsid); it outlives the command
#   scripts/gpu.sh wait OUT [SECONDS]     wait for detached stages, then copy their logs into OUT
# Every stage appends "stage<TAB>seconds<TAB>exit" to OUT/stages.tsv and logs to OUT/<stage>.log.
# Environment: EP_CUDA (ON; OFF rehearses the offline build on a CPU machine), EP_CUDA_ARCHS (default 90a; a release adds e.g. "89;90a;120"), EP_SITE (default /tmp/ep-site),
# EP_STATE (default /tmp/ep-gpu, where detached stages keep their logs), EP_JOBS (default: nproc).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BUNDLE="$ROOT/.bundle"
EP_SITE=${EP_SITE:-/tmp/ep-site}
EP_STATE=${EP_STATE:-/tmp/ep-gpu}
EP_CUDA_ARCHS=${EP_CUDA_ARCHS:-90a}
EP_JOBS=${EP_JOBS:-$(nproc)}
PY=${PYTHON:-python3}

# Wheels the GPU image lacks (KINDS.md lists what it has), for CPython 3.12 / manylinux x86_64.
BUNDLE_WHEELS=(
  "diskcache==5.6.3" "waitress==3.0.2" "flask==3.1.3" "itsdangerous==2.2.0" "blinker==1.9.0"
  "cffi==2.0.0" "pycparser==2.23"
)

log() { echo "[gpu.sh $(date +%H:%M:%S)] $*" >&2; }

timed() {  # timed OUT NAME CMD...: run, log, and record the wall time
  local out=$1 name=$2; shift 2
  mkdir -p "$out"
  local t0=$(date +%s%N)
  log "stage $name: start"
  "$@" > >(tee "$out/$name.log") 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local dt="$((ms / 1000)).$(( (ms % 1000) / 100 ))"
  printf "%s\t%s\t%d\n" "$name" "$dt" "$rc" >> "$out/stages.tsv"
  log "stage $name: exit $rc after ${dt}s"
  return $rc
}

env_site() {
  export PYTHONPATH="$EP_SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$EP_SITE/bin:$PATH"
  export PYTHONUNBUFFERED=1
}

do_bundle() {
  mkdir -p "$BUNDLE/wheels"
  $PY vendor/prepare.py bundle-tree "$BUNDLE/upstream.tar.gz" || return 1
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$BUNDLE/wheels" "${BUNDLE_WHEELS[@]}" || return 1
  du -sh "$BUNDLE"/* >&2
}

do_build() {
  [ -f "$BUNDLE/upstream.tar.gz" ] || { log "missing $BUNDLE/upstream.tar.gz: run 'scripts/gpu.sh bundle' here and carry .bundle"; return 1; }
  mkdir -p "$EP_SITE"
  if [ -z "${EP_SKIP_WHEELS:-}" ]; then  # set it to rehearse on a machine whose Python is not 3.12
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$EP_SITE" "$BUNDLE"/wheels/*.whl || return 1
  fi
  if [ ! -d vendor/upstream ]; then
    mkdir -p vendor/upstream && tar -xzf "$BUNDLE/upstream.tar.gz" -C vendor/upstream || return 1
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -2 || true
  # offline: no registry, build requirements from the image (scikit-build-core, cmake, ninja)
  CMAKE_ARGS="-DGGML_CUDA=${EP_CUDA:-ON} -DCMAKE_CUDA_ARCHITECTURES=${EP_CUDA_ARCHS} ${EP_CMAKE_ARGS:-}" \
  CMAKE_BUILD_PARALLEL_LEVEL=$EP_JOBS \
    $PY -m pip install --no-index --no-build-isolation --no-deps --upgrade --target "$EP_SITE" \
      -Cbuild-dir=build/cuda-{wheel_tag} . || return 1
  env_site
  $PY -c "from ggml_expert_pack.libggml import gpu_devices; d = gpu_devices(); print('GPU devices:', d); assert d or '${EP_CUDA:-ON}' == 'OFF'"
}

do_archs() {
  # A release build adds the cards users have. Compiling all of ggml-cuda for three archs takes ~3x a build, more
  # GPU time than a benchmark run should spend; one object of ggml-cuda through the same CMake path shows that the option
  # reaches nvcc and yields SASS for each arch.
  local out=$1 archs=${EP_RELEASE_ARCHS:-89;90a;120} dir=build/release-archs
  cmake -S . -B "$dir" -G Ninja -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" -DCMAKE_BUILD_TYPE=Release \
    >"$out/archs-configure.log" 2>&1 || { tail -20 "$out/archs-configure.log"; return 1; }
  local obj=llama.cpp/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/argmax.cu.o
  cmake --build "$dir" --target "$obj" || return 1
  cuobjdump --list-elf "$dir/$obj" | tee "$out/archs-cuobjdump.txt"
  local a rc=0
  for a in ${archs//;/ }; do
    grep -q "sm_${a}" "$out/archs-cuobjdump.txt" && log "sm_${a}: present" || { log "sm_${a}: MISSING"; rc=1; }
  done
  return $rc
}

do_test() {
  env_site
  $PY -m pytest -ra --junitxml="$1/junit.xml" "${@:2}"
}

do_bench() {
  env_site
  $PY "scripts/bench_$2.py" --out "$1" "${@:3}"
}

do_pipeline() {
  local out=$1; shift
  timed "$out" build do_build || return 1
  env_site
  [ -n "${1:-}" ] || { log "pipeline needs a question (expert-pack bench list)"; return 2; }
  ( expert-pack bench run "$@" --out "$out/systems" --prepare-only > "$out/prepare.log" 2>&1; echo "prepare exit $?" >> "$out/prepare.log" ) &
  local prep=$!
  EP_SKIP_ARCHS_TOOL=1 timed "$out" test do_test "$out" -q ${EP_TEST_ARGS:-}
  [ -n "${EP_SKIP_ARCHS:-}" ] || timed "$out" archs do_archs "$out"
  wait $prep
  timed "$out" bench-systems expert-pack bench run "$@" --out "$out/systems"
}

do_storage_pipeline() {
  # build; the tests (EP_TEST_ARGS) while the benchmark model is generated and packed in RAM-backed storage
  # ($EP_SHM, default /dev/shm/ep); then scripts/bench_storage.py ARGS on that pack -- meant for `start`
  local out=$1; shift
  local shm=${EP_SHM:-/dev/shm/ep}
  timed "$out" build do_build || return 1
  env_site
  mkdir -p "$shm"
  # the installed console script ($EP_SITE/bin is on PATH): `python -m` here would import the checkout's source folder
  ( [ -f "$shm/model.gguf" ] || expert-pack synth "$shm/model.gguf" --shape 30b-a3b --quiet
    [ -f "$shm/model.pack/manifest.json" ] || expert-pack build "$shm/model.gguf" -o "$shm/model.pack" --quiet
  ) > "$out/prepare.log" 2>&1 &
  local prep=$!
  EP_SKIP_ARCHS_TOOL=1 timed "$out" test do_test "$out" -q ${EP_TEST_ARGS:-}
  wait $prep || { log "preparing the benchmark model failed (prepare.log)"; return 1; }
  timed "$out" bench-storage $PY scripts/bench_storage.py --model "$shm/model.gguf" --pack "$shm/model.pack" \
    --copy-to "$(dirname "$shm")" --out "$out/storage" "$@"
  # EP_SERVERS_ARGS: also the servers on the same pack (scripts/bench_servers.py)
  [ -z "${EP_SERVERS_ARGS:-}" ] || timed "$out" bench-servers $PY scripts/bench_servers.py --model "$shm/model.gguf" \
    --pack "$shm/model.pack" --out "$out/servers" $EP_SERVERS_ARGS
}

case "${1:-}" in
  bundle) do_bundle ;;
  build)  timed "$2" build do_build ;;
  test)   out=$2; shift 2; timed "$out" test do_test "$out" "$@" ;;
  bench)  out=$2; name=$3; shift 3; timed "$out" "bench-$name" do_bench "$out" "$name" "$@" ;;
  all)    timed "$2" build do_build && timed "$2" test do_test "$2" ;;
  archs)  timed "$2" archs do_archs "$2" ;;
  pipeline) out=$2; shift 2; do_pipeline "$out" "$@" ;;
  storage-pipeline) out=$2; shift 2; do_storage_pipeline "$out" "$@" ;;
  collect) mkdir -p "$2"; tar czf "$2/results.tgz" --exclude='*.gguf' --exclude='*.pack' -C "$EP_STATE" . && ls -la "$2" ;;
  start)
    stage=$2; mkdir -p "$EP_STATE/$stage"; rm -f "$EP_STATE/$stage/done"
    setsid bash -c "'$0' $stage '$EP_STATE/$stage' ${*:4}; echo \$? > '$EP_STATE/$stage/done'" \
      > "$EP_STATE/$stage/detached.log" 2>&1 < /dev/null &
    log "started $stage detached (logs in $EP_STATE/$stage)" ;;
  wait)
    out=$2; limit=${3:-540}; t=0
    while ls "$EP_STATE"/*/ >/dev/null 2>&1 && [ -n "$(for d in "$EP_STATE"/*/; do [ -f "$d/done" ] || echo x; done)" ] && [ "$t" -lt "$limit" ]; do
      sleep 5; t=$((t + 5))
    done
    mkdir -p "$out"
    for d in "$EP_STATE"/*/; do
      s=$(basename "$d"); cp -r "$d" "$out/$s" 2>/dev/null
      [ -f "$d/done" ] && log "$s: finished, exit $(cat "$d/done")" || log "$s: still running"
    done ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
