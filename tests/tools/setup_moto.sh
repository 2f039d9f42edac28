#!/usr/bin/env bash
# Set up moto's S3-compatible server (`moto_server`) in its OWN virtual environment, for the
# image-capture tests of the S3 target (tests/integration/test_records_serving.py).
#
#   tests/tools/setup_moto.sh [VENV]      (default VENV: .work/moto-venv)
#
# Why its own venv: moto needs boto3/botocore, and botocore requires python-dateutil < 3, while
# requirements/constraints.txt pins python-dateutil 4 (asyncua, matplotlib). The server only
# needs to listen on loopback; the project talks to it through its own S3 client (minio).
# Idempotent: a second run only checks.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.work/moto-venv}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
MOTO_VERSION="5.2.5"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ ! -x "$VENV/bin/moto_server" ]; then
    "$VENV/bin/python" -m pip install --quiet "moto[server]==$MOTO_VERSION"
fi
"$VENV/bin/moto_server" --help >/dev/null
echo "moto_server: $VENV/bin/moto_server"
