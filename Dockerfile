#
# visionserve image for edge industrial PCs (docker compose) and Kubernetes (NVIDIA device plugin).
#
#   docker build -t visionserve:0.1.0 .                 # GPU image (default target "gpu"): 6.6 GB
#   docker build -t visionserve:0.1.0-cpu --target cpu . # GPU-less IPCs: no torch, no CUDA: 0.6 GB
#   deploy/build-image.sh [--target cpu|gpu|all]        # the same, also without a registry (below)
#
# Builds need PyPI: they happen at the vendor, with internet. The plant's IPC never builds; it gets
# the image by `docker save` / `docker load` (deploy/README.md).
#
# Versions: every pip install below takes requirements/constraints.txt (-c), the versions the test
# suite last passed with, so the image holds what was tested, not what PyPI has newest that day.
#
# Where CUDA comes from: NOT from an nvidia/cuda base image. torch's PyPI wheels for x86-64 Linux
# depend on the nvidia-* / cuda-toolkit wheels (cudart, cuBLAS, cuDNN, cuFFT, nvJPEG comes inside
# torchvision), and onnxruntime-gpu is built for the same CUDA major (13), so it loads those very
# libraries (torch is imported first, or onnxruntime.preload_dlls()). A cuda-runtime/cudnn base
# image would carry a second copy of the same ~3 GB. So: a slim Python base plus the wheels; the only
# thing needed from the host is the NVIDIA driver (>= 580 for CUDA 13), mounted into the container
# by the NVIDIA Container Toolkit (compose `driver: nvidia`, Kubernetes device plugin).
#
# The CPU image is the core install (pyproject.toml): onnxruntime on the CPU, without torch and its
# CUDA wheels (extra "gpu"). It serves ONNX models; `runtime.backend = "torch"` needs the GPU image.
#
# Where no registry or plain PyPI is reachable, deploy/build-image.sh builds this same file: it
# passes a base made from Debian packages as PYTHON_IMAGE (bookworm: Python 3.11, also tested), and
# the build host's pip settings (CA bundle, index) as BuildKit secrets "pip.conf" and "pip-ca".
# Secrets are mounted for one RUN only: they are in no layer and in no `docker history`. Without
# them (any normal machine) pip uses PyPI and its own CA store.

ARG PYTHON_IMAGE=python:3.12.12-slim-trixie

# ---------------------------------------------------------------------------------------------
# builder: a venv in /opt/venv with the project; the final stage copies only the venv.
FROM ${PYTHON_IMAGE} AS builder-base
# PIP_CONFIG_FILE: the "pip.conf" secret where the build was given one (a missing file is ignored).
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1 \
    PIP_CONFIG_FILE=/run/secrets/pip.conf
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/constraints.txt requirements/constraints.txt

FROM builder-base AS builder-gpu
# torch first, in its own layer: ~4 GB of wheels that change far less often than our code.
# PyPI's default torch wheel for x86-64 Linux is the CUDA (cu13x) build.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca \
    pip install -c requirements/constraints.txt torch torchvision

# The project on top, with the gpu extra; torch is already satisfied at the constrained version.
# Only the runtime package: the tooling (visionserve_tools: bench, training scripts) stays out of
# the image, and so does setup.py's copy of the default model (the models come in below).
FROM builder-gpu AS project-gpu
COPY pyproject.toml README.md ./
COPY visionserve ./visionserve
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca \
    pip install -c requirements/constraints.txt ".[gpu]" \
    && python -c "import visionserve.cli, torch, onnxruntime"

# The core only: no torch, no nvidia-* wheels.
# onnxruntime-gpu (the core's onnxruntime on x86-64 Linux) carries its CUDA and TensorRT execution
# providers as separate libraries: 272 MiB (the CPU image is 604 MB without them). They load only
# when a session asks for them, and without CUDA's libraries (torch's wheels) they cannot load here
# anyway: so they go (tests/docker serves the shipped model from the built image).
FROM builder-base AS project-cpu
COPY pyproject.toml README.md ./
COPY visionserve ./visionserve
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca \
    pip install -c requirements/constraints.txt . \
    && rm -f /opt/venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime_providers_cuda.so \
        /opt/venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime_providers_tensorrt.so \
    && python -c "import visionserve.cli, onnxruntime" \
    && ! python -c "import torch" 2>/dev/null

# ---------------------------------------------------------------------------------------------
# runtime: the same slim base, no compilers, no pip cache, no source tree.
FROM ${PYTHON_IMAGE} AS runtime-base
# tini as PID 1: python would get SIGTERM as PID 1 only once the server has installed its handler
# (the kernel drops unhandled signals to PID 1), so a stop during the torch import / warm-up would
# wait out the whole grace period; and the guard's training jobs spawn children (dataloader
# workers) that become orphans of PID 1 and must be reaped. tini forwards SIGTERM to the server
# and reaps; it returns the server's exit code.
RUN apt-get update \
    && apt-get install -y --no-install-recommends "tini=0.19.*" \
    && rm -rf /var/lib/apt/lists/*
# Fixed UID/GID 10001: the Kubernetes securityContext and host volume ownership name it.
RUN groupadd --system --gid 10001 visionserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/visionserve --create-home \
        --shell /usr/sbin/nologin visionserve \
    && mkdir -p /var/lib/visionserve/guard \
    && chown -R 10001:10001 /var/lib/visionserve
# CUDA_DEVICE_ORDER=PCI_BUS_ID: indices match nvidia-smi's, not "fastest first".
# Caches go under /tmp so the root filesystem can be mounted read-only (Kubernetes).
# The guard's job database: the folder made above (compose mounts a volume there), for the CLI
# (`docker exec ... visionserve guard list`) and `serve --guard` alike, not under $HOME.
# HOLD_ON_ERROR: a start-up that fails (a missing or unreadable mounted model repository, a model
# that does not load) logs its reason once and the container stays up, unhealthy, instead of
# exiting into `restart: unless-stopped` and crash-looping.
# HOST=0.0.0.0: protected routes (state changes, guard jobs, records; docs/security.md) need the
# admin token, which comes from a secret mounted as a file, never from this file:
#   docker run -v /etc/visionserve/admin-token:/run/secrets/admin-token:ro \
#     -e VISIONSERVE_ADMIN_TOKEN_FILE=/run/secrets/admin-token ...
# (the Compose and Kubernetes files do that). Without one the server makes one in its home, or, on
# a read-only root, closes those routes; inference needs no token either way.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID \
    CUDA_CACHE_PATH=/tmp/.nv/ComputeCache \
    XDG_CACHE_HOME=/tmp/.cache \
    VISIONSERVE_HOST=0.0.0.0 \
    VISIONSERVE_HTTP_PORT=8000 \
    VISIONSERVE_GRPC_PORT=8001 \
    VISIONSERVE_MODELS=/opt/visionserve/models \
    VISIONSERVE_GUARD_DB=/var/lib/visionserve/guard/guard.db \
    VISIONSERVE_HOLD_ON_ERROR=true
WORKDIR /opt/visionserve
# The shipped models, owned by root and read-only to the server: it never writes to them.
COPY models/ /opt/visionserve/models/
EXPOSE 8000 8001
# No curl in the image: python's urllib; a 503 (not ready) raises, so the check exits non-zero.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/ready' % os.environ.get('VISIONSERVE_HTTP_PORT', '8000'), timeout=2)"]
USER 10001:10001
# Settings come from VISIONSERVE_* (compose environment, Kubernetes ConfigMap); CMD stays short so
# `docker run IMAGE guard run --db ... --device ...` reuses the same entrypoint.
ENTRYPOINT ["tini", "--", "visionserve"]
CMD ["serve"]

FROM runtime-base AS cpu
LABEL org.opencontainers.image.title="visionserve (CPU)" \
      org.opencontainers.image.description="visionserve inference server, CPU only (onnxruntime, no torch)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV VISIONSERVE_DEVICE=cpu
COPY --from=project-cpu /opt/venv /opt/venv

# Last stage = default target: `docker build .` gives the GPU image.
FROM runtime-base AS gpu
LABEL org.opencontainers.image.title="visionserve" \
      org.opencontainers.image.description="visionserve inference server, CUDA 13 via torch's nvidia-* wheels" \
      org.opencontainers.image.licenses="Apache-2.0"
# auto: the one GPU the container runtime exposes; compose (device_ids) and k8s (device plugin) pin
# it. No NVIDIA_VISIBLE_DEVICES=all here, unlike the nvidia/cuda images: where nvidia is the
# default runtime that would hand every GPU to a container that asked for none.
# utility = NVML (nvidia-ml-py telemetry, the guard's free-memory checks).
ENV VISIONSERVE_DEVICE=auto \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=project-gpu /opt/venv /opt/venv
