#!/usr/bin/env bash
# Install each peer server into its own virtual environment under .work/peers/ (git-ignored), so
# none of them leaks into visionserve's dependencies. Idempotent: a venv whose marker file exists
# is left alone. Usage: loadtest/peers/setup_venvs.sh [naive] [litserve] [pytriton]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${PEERS_WORK:-$ROOT/.work/peers}"
PY="${PEERS_PYTHON:-$(command -v python3.11 || command -v python3)}"
mkdir -p "$WORK"

# What every peer needs to do the same work per frame as visionserve: JPEG decode + resize
# (OpenCV), normalise (numpy), the ONNX model (onnxruntime CPU).
COMMON=(onnxruntime "opencv-python-headless" numpy)

declare -A PKGS=(
  [naive]="fastapi uvicorn[standard]"
  # LitServe's batching (max_batch_size, batch_timeout) is in the server itself.
  [litserve]="litserve==0.2.19 uvicorn[standard]"
  # pytriton 0.7.0 bundles tritonserver 2.51; it needs numpy < 2, and so an OpenCV built for it.
  [pytriton]="nvidia-pytriton==0.7.0 numpy<2 opencv-python-headless<4.11"
)

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(naive litserve pytriton)
for peer in "${peers[@]}"; do
  venv="$WORK/$peer"
  if [ -f "$venv/.installed" ]; then
    echo "peer $peer: $venv already installed"
    continue
  fi
  echo "peer $peer: creating $venv with $PY"
  "$PY" -m venv "$venv"
  extra=()
  if [ "$peer" = pytriton ]; then
    extra=(onnxruntime)
  else
    extra=("${COMMON[@]}")
  fi
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q ${PKGS[$peer]} "${extra[@]}"
  "$venv/bin/pip" freeze > "$venv/freeze.txt"
  touch "$venv/.installed"
  echo "peer $peer: ready"
done
