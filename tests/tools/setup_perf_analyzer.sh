#!/usr/bin/env bash
# Set up Triton's perf_analyzer in its OWN virtual environment, so the project's tritonclient is
# not pinned to the (older) release that still ships the binary.
#
#   tests/tools/setup_perf_analyzer.sh [VENV]      (default VENV: .work/perf-venv)
#
# Facts this script works around:
#   * the PyPI package `perf-analyzer` is an empty placeholder; the binary ships in
#     tritonclient[all]==2.51.0 as bin/perf_analyzer;
#   * it links libb64.so.0d (Debian/Ubuntu package libb64-0d) and libcudart.so.12 (PyPI
#     nvidia-cuda-runtime-cu12), even when no GPU is used.
# Afterwards run it through tests/tools/perf_analyzer (a wrapper that sets LD_LIBRARY_PATH).
# Idempotent: a second run only checks.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.work/perf-venv}"
# the project venv's interpreter (any Python 3 with venv works; perf_analyzer is a C++ binary)
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TRITONCLIENT_VERSION="2.51.0"

if ! ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "installing libb64-0d (apt)"
        apt-get install -y --no-install-recommends libb64-0d >/dev/null 2>&1 \
            || { apt-get update >/dev/null && apt-get install -y --no-install-recommends libb64-0d >/dev/null; }
    else
        echo "perf_analyzer needs libb64.so.0d: run 'sudo apt-get install -y libb64-0d'" >&2
        exit 1
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ ! -x "$VENV/bin/perf_analyzer" ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "tritonclient[all]==$TRITONCLIENT_VERSION" \
        "nvidia-cuda-runtime-cu12"
fi

if ! PERF_VENV="$VENV" "$ROOT/tests/tools/perf_analyzer" --version >/dev/null 2>&1; then
    echo "perf_analyzer is installed but does not start; missing libraries:" >&2
    ldd "$VENV/bin/perf_analyzer" | grep 'not found' >&2 || true
    exit 1
fi
echo "perf_analyzer ready: $VENV/bin/perf_analyzer (run it via tests/tools/perf_analyzer)"
