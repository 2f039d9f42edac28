#!/usr/bin/env bash
# Issue 22 on the GPU machine in one call (about 3.5-4 minutes, at most ~285 s): the guard's
# GPU-sharing run (python -m visionserve_tools.benchshare: training alone, baseline load at half
# of saturation, training with the process-level policy, with cooperative yielding, with the hook
# in its "bound" mode, the hostile job if time is left) and whether CUDA MPS can run there.
# Results in $OUT:
#   share.json   the run: per phase p50/p99 (client and server side), errors, send lag, CPU and
#                run-queue wait of server/clients/job, SM use, steps/s, what the guard recorded
#   share.txt    its progress log and summary
#   mps.txt      nvidia-cuda-mps-control: there? does a daemon start? does a client connect?
#   env.txt      nvidia-smi, versions
# Run from the repository root:  bash tests/gpu/guard_share_on_device.sh
# DEVICE=cpu runs every piece on the CPU (short phases): the dry run of this script.
# Wheels for packages the machine lacks may be carried in .whl/ (installed to /tmp/site).
set -u
OUT=${OUT:-$PWD/gpu-out}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if [ "$DEVICE" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/env.txt" 2>&1 || echo "wheel install failed" >>"$OUT/env.txt"
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total --format=csv 2>&1
  nproc
  df -h /dev/shm
  $PY -c 'import sys, torch, torchvision; print(sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.cuda.is_available())' 2>&1
  $PY -c 'import fastapi, uvicorn, pydantic, pynvml; print("server deps ok")' 2>&1
} >>"$OUT/env.txt" 2>&1

ARGS="--device $DEVICE"
[ "$DEVICE" = cpu ] && ARGS="$ARGS --quick --rate 6 --processes 2"
timeout -s TERM -k 10 ${SHARE_T:-250} $PY -m visionserve_tools.benchshare $ARGS \
  --out "$OUT/share.json" --log-dir /tmp/benchshare-logs ${SHARE_ARGS:-} >"$OUT/share.txt" 2>&1
echo "benchshare exit $? after $(( $(date +%s) - T0 )) s" >>"$OUT/share.txt"

# CUDA MPS: only a check, in a private pipe directory (no other process uses this daemon), quit
# at the end. A client with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 shows whether the cap is taken.
{
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control)"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/vs-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/vs-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    timeout 10 nvidia-cuda-mps-control -d; echo "daemon start: exit $?"
    sleep 1
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 40 $PY -c '
import time, torch
t = time.time(); x = torch.ones(1 << 20, device="cuda"); torch.cuda.synchronize()
p = torch.cuda.get_device_properties(0)
print("mps client: ok", float(x.sum()), "in", round(time.time() - t, 2), "s; SMs visible", p.multi_processor_count)' 2>&1
    echo "client: exit $?"
    echo get_server_list | timeout 5 nvidia-cuda-mps-control; echo "server list: exit $?"
    echo quit | timeout 10 nvidia-cuda-mps-control; echo "quit: exit $?"
    tail -n 20 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
    tail -n 20 "$CUDA_MPS_LOG_DIRECTORY/server.log" 2>/dev/null
  else
    echo "nvidia-cuda-mps-control: not found on PATH"
    ls /usr/bin/nvidia-* /usr/local/nvidia/bin 2>&1 | head -20
  fi
} >"$OUT/mps.txt" 2>&1

tail -n 75 "$OUT/share.txt"
echo "--- mps"
head -n 12 "$OUT/mps.txt"
echo "total $(( $(date +%s) - T0 )) s"
