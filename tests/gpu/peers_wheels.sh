#!/usr/bin/env bash
# Wheels for the GPU peers run (`PEERS=1 bash tests/gpu/run_on_device.sh`), in chunks that the
# device tool can carry. Run from the repository root, here (not on the GPU machine):
#   bash tests/gpu/peers_wheels.sh
# It fetches, for the GPU machine's Python 3.12:
#   .whl/        the server's wheels (the list in run_on_device.sh's header);
#   .whl-peers/  nvidia-pytriton 0.7.0 without its Python 3.13 libpython and the Python-backend
#                stubs of other Pythons (39 MB instead of 55), numpy 1.26.4 (pytriton needs numpy
#                < 2; run_on_device.sh puts it in a venv of its own), and pytriton's needs that the
#                machine's image lacks (pyzmq, sh, gevent, geventhttpclient, greenlet, zope.event,
#                zope.interface, brotli);
# and splits both folders into .ptchunks/c.00, c.01, ... of 36 MiB: the repository itself takes
# about 26 MiB of the 64 MiB a call may carry. Then make one `run` call per chunk, back to back
# (the machine keeps /tmp for 30 s after a call), carrying [".ptchunks/c.NN"]:
#   every chunk but the last:  mkdir -p /tmp/ptw && cp .ptchunks/c.NN /tmp/ptw/
#   the last:  cp .ptchunks/c.NN /tmp/ptw/ && cat /tmp/ptw/c.* | tar -x && \
#              SKIP_TESTS=1 SKIP_BENCH=1 PEERS=1 bash tests/gpu/run_on_device.sh
# ORT=1 bash tests/gpu/peers_wheels.sh also puts onnxruntime-gpu (255 MB, for CUDA 13 like the
# machine's torch) in .whl-ort/, in the same chunks: run_on_device.sh installs it to /tmp/ort, for
# the visionserve-ort target (the same network served on onnxruntime's CUDA provider). That makes
# about ten chunks (the repository, 28 MB, travels with each), so ten calls back to back, none
# more than 30 s after the last (the machine keeps /tmp that long).
set -euo pipefail
for d in /.whl/ /.whl-peers/ /.whl-ort/ /.ptchunks/; do
  grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
fetch() {  # fetch DIR NAME...: Python 3.12 x86-64 wheels, without their dependencies
  local dir=$1 plats=()
  shift
  for n in 1 2014 _2_17 _2_24 _2_26 _2_27 _2_28 _2_31 _2_34 _2_35; do
    plats+=(--platform "manylinux${n}_x86_64")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plats[@]}" -d "$dir" "$@"
}
mkdir -p .whl .whl-peers .ptchunks
fetch .whl fastapi starlette uvicorn pydantic pydantic-core pydantic-settings python-dotenv \
  typing-inspection annotated-types anyio sniffio h11 httptools uvloop prometheus-client \
  nvidia-ml-py opentelemetry-api importlib-metadata zipp typing-extensions httpx httpcore certifi \
  idna grpcio protobuf tritonclient python-rapidjson
tmp=$(mktemp -d)
fetch "$tmp" nvidia-pytriton==0.7.0
python3 - "$tmp"/nvidia_pytriton-*.whl .whl-peers <<'EOF'
import pathlib, sys, zipfile

src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])


def drop(name: str) -> bool:  # the Python 3.13 libpython, and the stubs of Pythons other than 3.12
    return "libpython3-" in name or ("python_backend_stubs/" in name and "/3.12/" not in name)


with zipfile.ZipFile(src) as z, zipfile.ZipFile(out / src.name, "w", zipfile.ZIP_DEFLATED) as w:
    for info in z.infolist():
        if drop(info.filename):
            continue
        data = z.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"\n".join(x for x in data.split(b"\n") if not drop(x.decode(errors="ignore")))
        w.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
EOF
rm -rf "$tmp"
fetch .whl-peers numpy==1.26.4 pyzmq sh geventhttpclient gevent greenlet zope.event zope.interface \
  brotli
dirs=(.whl .whl-peers)
if [[ ${ORT:-} == 1 ]]; then
  rm -rf .whl-ort
  fetch .whl-ort "onnxruntime-gpu==${ORT_VERSION:-1.31.1}"
  dirs+=(.whl-ort)
fi
rm -f .ptchunks/c.*
tar -cf - "${dirs[@]}" | split -b 36M -d - .ptchunks/c.
du -sh "${dirs[@]}"
ls -la .ptchunks
