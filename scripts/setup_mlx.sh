#!/usr/bin/env bash
# Idempotent setup of MLX (CPU build) and mlx-lm in their own venv, for `--format mlx` tests and
# `eval --backend mlx`: $QK_CACHE/venvs/mlx-$MLX_VERSION. mlx-lm pins its own transformers, so
# it lives beside quantkit's venv, as vLLM does; quantkit runs it through a worker subprocess.
# CPU classes: the mlx-cpu 0.32.4 wheel's libmlx.so holds no AVX / AVX2 / AVX-512 instruction
# (objdump: no ymm / zmm register, no vfmadd), i.e. baseline x86-64, so it needs no AVX2 either;
# run on an AVX-512 CPU here, not on an AVX2-only one.
# Re-running is cheap: a finished install leaves a stamp and is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
QK_CACHE="${QUANTKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/quantkit}"
PY="${PYTHON:-python3}"
MLX_VERSION=0.32.4
MLX_LM_VERSION=0.32.2
MLX_VENV="$QK_CACHE/venvs/mlx-$MLX_VERSION"
mkdir -p "$QK_CACHE/venvs"
log() { printf '\033[1m[setup-mlx +%ss]\033[0m %s\n' "$SECONDS" "$*" >&2; }
SETUP_LOG="$QK_CACHE/setup-mlx.log"
: > "$SETUP_LOG"
# quiet: output goes to the log, whose tail is shown when a step fails
q() { "$@" >>"$SETUP_LOG" 2>&1 || { tail -n 40 "$SETUP_LOG" >&2; log "FAILED: $* (log: $SETUP_LOG)"; exit 1; }; }

STAMP="$MLX_VENV/.quantkit-ok-$MLX_LM_VERSION"
if [ ! -f "$STAMP" ]; then
  log "installing mlx[cpu] $MLX_VERSION and mlx-lm $MLX_LM_VERSION into $MLX_VENV (once)"
  rm -rf "$MLX_VENV"
  "$PY" -m venv "$MLX_VENV"
  q "$MLX_VENV/bin/python" -m pip install -q --upgrade pip
  q "$MLX_VENV/bin/pip" install -q "mlx[cpu]==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION"
  # the smoke test: MLX's CPU backend imports and multiplies on this CPU
  q "$MLX_VENV/bin/python" -c "import mlx.core as mx; a = mx.ones((4, 4)); mx.eval(a @ a); print('mlx ok', mx.__version__)"
  touch "$STAMP"
fi
log "ready: mlx at $MLX_VENV"
