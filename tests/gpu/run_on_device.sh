#!/usr/bin/env bash
# The GPU suite on a CUDA machine, in one call: every test in tests/gpu and the CPU tests of the
# GPU code (marked gpu_path, under tests/), in two parts. About 7 minutes on one H100 (16 cores)
# with the wheels of .whl/, pytest-xdist among them:
#   1. the tests that share the card, in JOBS (6) pytest-xdist workers (--dist loadgroup; the
#      tests marked slow handed out first): about 2 minutes; the frame-integrity cases (30 s of
#      load each) and the batch workers' swap (about a minute) are the longest
#   2. then the ones that need the card to themselves (marked gpu_alone: the guard's acceptance
#      and GPU-sharing runs, its hostile-job and MPS tests), one after another: about 4.5 minutes
#      (on 2026-12-06: 406 s in all, part 1 106 s, part 2 279 s, the bytecode 7 s)
# Before them, the bytecode of torch and the other large packages is compiled once, in parallel,
# into PYC_DIR (/tmp/pyc; 7-20 s), for every process of the run to read (PYTHONPYCACHEPREFIX):
# the image keeps none, and each new Python process would spend ~5 s compiling torch. PYC=0
# leaves that out. Without pytest-xdist (or with JOBS=0) part 1 runs serially, about 10 minutes:
# more than one call allows.
# Results land in $OUT:
#   env.txt       nvidia-smi, versions, onnxruntime providers;  pyc.txt  the bytecode step
#   pytest.txt    part 1's output, a line per test;  junit.xml  the same, machine-readable
#   pytest-alone.txt / junit-alone.xml  part 2's
#   stall.txt / stall-alone.txt  only when a part ran past its limit (PYTEST_T, 300; ALONE_T, what
#                 is left of CALL_T, 580 s from the start): py-spy's stacks of the run where it
#                 stood (slow or stuck: a test under FAULT_T s, 150, has no faulthandler stacks in
#                 the part's output)
#   integrity.jsonl  the frame-integrity test's counts (answers checked, wrong answers)
#   bench.json    benchmark results;  bench.txt  its progress log;  dmon.txt  nvidia-smi dmon -s u
#                 during it (utilisation of the SMs and of the JPEG engines, "jpg")
#   bench-eager.json / bench-eager.txt  with AB=1: the benchmark again with the eager GPU
#                 preparation (VISIONSERVE_GPU_PREP_ONE_CALL=false), for an A/B on one machine
#   server.log    the benchmark servers' logs
#   swap.json / swap.txt / swap.server.log  with SWAP=1: model swaps under load
#                 (python -m visionserve_tools.benchswap, up to SWAP_T s (240)); with SWAP=ab
#                 twice, swap-inprocess.* with the program read in the serving process
#                 (VISIONSERVE_ISOLATED_LOADS=false), then swap.* as shipped
#   peers.json / peers.txt / peerslog/  with PEERS=1: visionserve beside Triton (pytriton) and a naive
#                 FastAPI + torch server, same model, JPEGs and generator (loadtest/peers/run_peers_gpu.py,
#                 up to PEERS_T s (540)); pytriton's wheels (and numpy 1.26, which it needs) in
#                 .whl-peers/ go into a venv at /tmp/ptv that sees this Python's packages.
#                 tests/gpu/peers_wheels.sh fetches them and says how to carry them. The target
#                 visionserve-ort (the same network on onnxruntime's CUDA provider) needs
#                 onnxruntime-gpu (ORT=1 there puts it in the chunks, installed to /tmp/ort);
#                 without it that target is an error and the others run
#   pipe.json / pipe.txt  with PIPE=1: the pipeline's own ceiling, the runner's two threads without
#                 the serving process, in 1 and in PIPE_P ("2") processes at once, one stream
#                 and two (python -m visionserve_tools.benchpipe, PIPE_S s a case (4), up to
#                 PIPE_T s (200))
#   cameras.json / cameras.txt / cameras/  with CAM_ARGS set (e.g. CAM_ARGS="--count 500
#                 --rate 50"): trigger to verdict at plc-sim with recorded frames from the source
#                 interface (python -m visionserve_tools.benchcam --replay; pymodbus's wheel in
#                 .whl/), up to CAM_T s (240)
#   det.json / det.txt  with DET_ARGS set (e.g. DET_ARGS="--as-shipped --runs 3"): the detector's
#                 benchmark (python -m visionserve_tools.benchdet), up to DET_T s (540)
#   loop.json / loop.txt  with LOOP_ARGS set (e.g. LOOP_ARGS=""): the closed loop beside a load at
#                 half of saturation (python -m visionserve_tools.benchloop), up to LOOP_T s (300)
#   guard.json / guard.txt  with GUARD_ARGS set (e.g. GUARD_ARGS="--latency-budget-ms 20"): the
#                 guard's acceptance run (python -m visionserve_tools.benchguard), up to GUARD_T s (300)
# TESTS="paths...": only those, in one part (a shorter call; serially, unless JOBS is given).
# SKIP_TESTS=1 leaves the tests out, SKIP_ALONE=1 part 2. The benchmark (up to BENCH_T s, 270)
# runs with BENCH=1, or alone with SKIP_TESTS=1 (SKIP_BENCH=1 leaves it out then): one call may
# run 10 minutes at most, and the suite takes most of that. A COMPARE of several settings in a
# call of its own: SKIP_TESTS=1 SKIP_BENCH=1 COMPARE=....
# Run from the repository root:  bash tests/gpu/run_on_device.sh
# Wheels for packages the machine lacks may be carried in .whl/ (installed to /tmp/site), e.g.
#   ../shared/device/wheels.sh fastapi starlette uvicorn pydantic pydantic-core pydantic-settings \
#     python-dotenv typing-inspection annotated-types anyio sniffio h11 httptools uvloop \
#     prometheus-client nvidia-ml-py opentelemetry-api importlib-metadata zipp typing-extensions \
#     httpx httpcore certifi idna pytest-asyncio pytest-timeout grpcio grpcio-health-checking \
#     protobuf tritonclient python-rapidjson pycocotools py-spy pytest-xdist execnet
#     (22 MB; carry ".whl")
# COMPARE="SPEC SPEC ...": after the benchmark, server settings side by side in the same call
#   (benchgpu --quick --compare, one server per SPEC; e.g. COMPARE="VISIONSERVE_SWITCH_INTERVAL_MS=0.5
#   VISIONSERVE_SWITCH_INTERVAL_MS=5 VISIONSERVE_SWITCH_INTERVAL_MS=0.5 VISIONSERVE_SWITCH_INTERVAL_MS=5",
#   interleaved so the machine's drift shows): compare.json / compare.txt, up to COMPARE_T s (400;
#   about 40 s per SPEC, plus the bare model); COMPARE_THREADS="12 24": a saturation load per count
#   of senders per client process (8 processes: 96 and 192 clients; about 20 s more per SPEC)
# THREADS_S=15: the benchmark (not its AB=1 repeat) also samples the serving process's threads
# with py-spy through 15 s of saturation at 640x480 and at 1080p (benchgpu --threads-s; about
# 40 s more; visionserve_tools.threadstates; threads-*.raw in $OUT, the summary in bench.json)
#   and a COMPARE samples each setting's threads at 640x480 for as long (threads_640x480 in
#   compare.json; compare/threads-compare-N.raw)
# onnxruntime-gpu installed at /tmp/ort (shared/device/ort-gpu-chunks.sh) is used if present.
set -u
T0=$(date +%s)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/env.txt" 2>&1 || echo "wheel install failed" >>"$OUT/env.txt"
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# onnxruntime-gpu: carried as .whl-ort/ in the peers' chunks (tests/gpu/peers_wheels.sh, ORT=1)
if ls .whl-ort/*.whl >/dev/null 2>&1 && [ ! -d /tmp/ort ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ort \
    .whl-ort/*.whl >>"$OUT/env.txt" 2>&1 || { echo "onnxruntime-gpu install failed" >>"$OUT/env.txt"; rm -rf /tmp/ort; }
fi
[ -d /tmp/ort ] && export PYTHONPATH=/tmp/ort:$PYTHONPATH
[ -x /tmp/site/bin/py-spy ] && export PY_SPY=/tmp/site/bin/py-spy
export PYTHONUNBUFFERED=1
# the bytecode cache of the run (the header says why): the standard library (less the
# site-packages under it and its tests), the large packages, the repository; what is left out
# is written there on its first import
if [ "${PYC:-1}" != 0 ]; then
  export PYTHONPYCACHEPREFIX=${PYC_DIR:-/tmp/pyc}
  unset PYTHONDONTWRITEBYTECODE
  {
    stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    timeout 120 python3 -m compileall -q -j 0 -x '/(site-packages|dist-packages|test|tests|idlelib|tkinter)/' \
      "$stdlib"
    # shellcheck disable=SC2046
    timeout 180 python3 -m compileall -q -j 0 $(python3 -c '
import importlib.util
for name in ("torch torchvision triton sympy mpmath networkx numpy cv2 PIL onnx onnxruntime "
             "jinja2 markupsafe fsspec filelock packaging fastapi starlette pydantic pydantic_core "
             "pydantic_settings annotated_types typing_inspection dotenv uvicorn click httpx "
             "httpcore h11 anyio sniffio idna certifi grpc grpc_health google.protobuf "
             "tritonclient prometheus_client opentelemetry pynvml yaml rich pygments "
             "typing_extensions pytest _pytest xdist execnet pluggy").split():
    try:
        spec = importlib.util.find_spec(name)
    except Exception:  # absent or broken: its processes compile it as before
        continue
    if spec is not None and spec.submodule_search_locations:
        print(*spec.submodule_search_locations, sep="\n")
    elif spec is not None and (spec.origin or "").endswith(".py"):
        print(spec.origin)
') visionserve visionserve_tools tests loadtest
    echo "bytecode in $PYTHONPYCACHEPREFIX after $(( $(date +%s) - T0 )) s"
  } >"$OUT/pyc.txt" 2>&1
fi
{
  nvidia-smi
  python3 -c 'import sys, torch, torchvision; print(sys.version); print("torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.cuda.is_available())'
  python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.__file__, o.get_available_providers())' 2>&1
  python3 -c 'import fastapi, uvicorn, pydantic, pynvml; print("server deps ok")' 2>&1
  python3 -m visionserve env 2>&1
  python3 -m visionserve doctor --device cuda:0 2>&1; echo "doctor exit $?"
} >>"$OUT/env.txt" 2>&1

# limited LIMIT_S STACKS_FILE CMD...: CMD, stopped after LIMIT_S seconds (exit 124, as timeout's).
# A run stopped at the limit writes no junit.xml: before stopping it, py-spy (when carried)
# dumps the Python and native stacks of every thread of CMD and of its child processes (the
# xdist workers) to STACKS_FILE, so it says where it stood (a test stuck, or one still running at
# the limit). Then CMD and every process under it are stopped, so none is left on the GPU.
limited() {
  local limit=$1 stacks=$2 pid deadline p tree
  shift 2
  rm -f "$stacks"
  "$@" &
  pid=$!
  deadline=$(( $(date +%s) + limit ))
  while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    {
      echo "still running after ${limit} s: stacks of $pid and its children"
      for p in $pid $(pgrep -P "$pid"); do
        if [ -n "${PY_SPY:-}" ]; then
          timeout 60 "$PY_SPY" dump --native --pid "$p" 2>&1 || echo "py-spy could not read $p"
        else
          echo "pid $p: no py-spy (carry .whl)"
        fi
      done
    } >"$stacks" 2>&1
    tree="$pid $(descendants "$pid")"
    # shellcheck disable=SC2086
    kill -TERM $tree 2>/dev/null
    sleep 5
    # shellcheck disable=SC2086
    kill -KILL $tree 2>/dev/null
    wait "$pid" 2>/dev/null
    return 124
  fi
  wait "$pid"
}

descendants() {  # the pids under $1, at any depth
  local c
  for c in $(pgrep -P "$1"); do
    echo "$c"
    descendants "$c"
  done
}

# pytest_part NAME LIMIT_S ARGS...: pytest ARGS, its output in pytest$NAME.txt and junit$NAME.xml
# (stall$NAME.txt past the limit: limited, above). One line per test (-v); a test still running
# after FAULT_T s (150) has every thread's Python stack written there (faulthandler, from a thread
# of its own: it is written even when the interpreter is held)
pytest_part() {
  local name=$1 limit=$2
  shift 2
  INTEGRITY_OUT="$OUT" limited "$limit" "$OUT/stall$name.txt" python3 -m pytest -p no:cacheprovider -v \
    -rs -o addopts="" -o faulthandler_timeout="${FAULT_T:-150}" --junitxml="$OUT/junit$name.xml" "$@" \
    >"$OUT/pytest$name.txt" 2>&1
  echo "pytest exit $?" >>"$OUT/pytest$name.txt"
  tail -n 25 "$OUT/pytest$name.txt"
  [ -s "$OUT/stall$name.txt" ] && head -c 6000 "$OUT/stall$name.txt"
}

left() {  # seconds left of CALL_T (580) from the start, less $1 for what comes after
  echo $(( T0 + ${CALL_T:-580} - $(date +%s) - $1 ))
}

min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

# -n N --dist loadgroup where pytest-xdist is there and N > 0; nothing (serially) otherwise
xdist_args() {
  if [ "$1" -gt 0 ] && python3 -c 'import xdist' 2>/dev/null; then
    echo "-n $1 --dist loadgroup"
  fi
}

if [ -z "${SKIP_TESTS:-}" ]; then
  if [ -n "${TESTS:-}" ]; then
    # shellcheck disable=SC2046,SC2086
    pytest_part "" "$(min "${PYTEST_T:-540}" "$(left 10)")" $(xdist_args "${JOBS:-0}") $TESTS
  else
    # part 1: tests/gpu and the files of gpu_path tests, less the gpu_alone ones, in workers
    gpu_path_files=$(grep -rlE --include='test_*.py' 'mark\.gpu_path' tests | grep -v '^tests/gpu/')
    # shellcheck disable=SC2046,SC2086
    pytest_part "" "$(min "${PYTEST_T:-300}" "$(left 20)")" $(xdist_args "${JOBS:-6}") \
      -m "(gpu or gpu_path) and not gpu_alone" tests/gpu $gpu_path_files
    # part 2: the tests that need the card to themselves, one after another
    if [ -z "${SKIP_ALONE:-}" ] && [ "${ALONE_T:-$(left 10)}" -gt 30 ]; then
      pytest_part -alone "${ALONE_T:-$(left 10)}" -m gpu_alone tests/gpu
    elif [ -z "${SKIP_ALONE:-}" ]; then
      echo "no time left for the tests marked gpu_alone" | tee "$OUT/pytest-alone.txt"
    fi
  fi
fi

# the benchmark: with BENCH=1, or when the tests are left out (a call of its own)
if [ -n "${BENCH:-}" ] || { [ -n "${SKIP_TESTS:-}" ] && [ -z "${SKIP_BENCH:-}" ]; }; then
  # engine use each second under the benchmark's load: sm, mem, enc, dec, and jpg (the hardware
  # JPEG engines nvJPEG's hardware backend drives; docs/gpu.md, "which decoder that is")
  nvidia-smi dmon -s u -d 1 >"$OUT/dmon.txt" 2>&1 &
  dmon=$!
  timeout ${BENCH_T:-270} python3 -m visionserve_tools.benchgpu --out "$OUT/bench.json" --log-dir "$OUT" \
    ${BENCH_ARGS:-} ${THREADS_S:+--threads-s $THREADS_S} >"$OUT/bench.txt" 2>&1
  echo "benchgpu exit $?" >>"$OUT/bench.txt"
  kill $dmon 2>/dev/null
  tail -n 60 "$OUT/bench.txt"
fi

if [ -n "${DET_ARGS+x}" ]; then  # the detector's benchmark (benchdet)
  # shellcheck disable=SC2086
  timeout ${DET_T:-540} python3 -m visionserve_tools.benchdet --out "$OUT/det.json" $DET_ARGS \
    >"$OUT/det.txt" 2>&1
  echo "benchdet exit $?" >>"$OUT/det.txt"
  tail -n 40 "$OUT/det.txt"
fi

if [ -n "${LOOP_ARGS+x}" ]; then  # the closed loop beside a load (benchloop)
  # shellcheck disable=SC2086
  timeout ${LOOP_T:-300} python3 -m visionserve_tools.benchloop --device cuda --out "$OUT/loop.json" \
    --log-dir "$OUT" $LOOP_ARGS >"$OUT/loop.txt" 2>&1
  echo "benchloop exit $?" >>"$OUT/loop.txt"
  tail -n 20 "$OUT/loop.txt"
fi

if [ -n "${CAM_ARGS+x}" ]; then  # trigger to verdict with cameras (benchcam, recorded frames)
  # shellcheck disable=SC2086
  timeout ${CAM_T:-240} python3 -m visionserve_tools.benchcam --replay --device cuda \
    --json "$OUT/cameras.json" --work "$OUT/cameras" $CAM_ARGS >"$OUT/cameras.txt" 2>&1
  echo "benchcam exit $?" >>"$OUT/cameras.txt"
  tail -n 20 "$OUT/cameras.txt"
fi

if [ -n "${PIPE:-}" ]; then  # the pipeline without the serving process (benchpipe)
  # shellcheck disable=SC2086
  timeout ${PIPE_T:-200} python3 -m visionserve_tools.benchpipe --out "$OUT/pipe.json" \
    --seconds ${PIPE_S:-4} --processes ${PIPE_P:-2} >"$OUT/pipe.txt" 2>&1
  echo "benchpipe exit $?" >>"$OUT/pipe.txt"
  grep -E "benchpipe [0-9:]+\]|exit" "$OUT/pipe.txt" | cut -c1-300
fi

if [ -n "${COMPARE:-}" ]; then  # server settings side by side (benchgpu --compare)
  compare_args=()
  for spec in $COMPARE; do compare_args+=(--compare "$spec"); done
  timeout ${COMPARE_T:-400} python3 -m visionserve_tools.benchgpu --quick --out "$OUT/compare.json" \
    --log-dir "$OUT/compare" "${compare_args[@]}" ${THREADS_S:+--threads-s $THREADS_S} \
    ${COMPARE_THREADS:+--compare-threads $COMPARE_THREADS} \
    >"$OUT/compare.txt" 2>&1
  echo "benchgpu --compare exit $?" >>"$OUT/compare.txt"
  grep -E "compare [0-9]+: " "$OUT/compare.txt" | cut -c1-600
  tail -n 1 "$OUT/compare.txt"
fi

if [ -n "${AB:-}" ]; then  # the same benchmark with the eager preparation (--no-gpu-prep-one-call)
  VISIONSERVE_GPU_PREP_ONE_CALL=false timeout ${BENCH_T:-270} python3 -m visionserve_tools.benchgpu \
    --out "$OUT/bench-eager.json" --log-dir "$OUT/eager" ${BENCH_ARGS:-} >"$OUT/bench-eager.txt" 2>&1
  echo "benchgpu (eager preparation) exit $?" >>"$OUT/bench-eager.txt"
  tail -n 30 "$OUT/bench-eager.txt"
fi

if [ "${SWAP:-}" = ab ]; then  # the same, first with the program read in the serving process
  VISIONSERVE_ISOLATED_LOADS=false timeout ${SWAP_T:-240} python3 -m visionserve_tools.benchswap \
    --out "$OUT/swap-inprocess.json" ${SWAP_ARGS:-} >"$OUT/swap-inprocess.txt" 2>&1
  echo "benchswap (in-process reads) exit $?" >>"$OUT/swap-inprocess.txt"
  tail -n 20 "$OUT/swap-inprocess.txt"
fi

if [ -n "${SWAP:-}" ]; then  # model swaps under load (issue 21), about 2.5 minutes
  timeout ${SWAP_T:-240} python3 -m visionserve_tools.benchswap --out "$OUT/swap.json" \
    ${SWAP_ARGS:-} >"$OUT/swap.txt" 2>&1
  echo "benchswap exit $?" >>"$OUT/swap.txt"
  tail -n 20 "$OUT/swap.txt"
fi

if [ -n "${PEERS:-}" ]; then  # GPU peers side by side (issue 19), about 5 minutes
  {
    python3 -m venv --without-pip --clear /tmp/ptv
    ptsite=$(/tmp/ptv/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$ptsite" \
      .whl-peers/*.whl
    # after the venv's own numpy 1.26: the server wheels, then this Python's packages (torch)
    { [ -d /tmp/site ] && echo /tmp/site
      python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; } >"$ptsite/zz_base.pth"
    /tmp/ptv/bin/python3 -c 'import numpy, torch, pytriton, sysconfig, glob
print("peer venv: numpy", numpy.__version__, "torch", torch.__version__,
      "libpython", glob.glob(sysconfig.get_config_var("LIBDIR") + "/libpython3*"))'
  } >"$OUT/peers.txt" 2>&1
  timeout ${PEERS_T:-540} python3 loadtest/peers/run_peers_gpu.py --out "$OUT/peers.json" \
    --log-dir "$OUT/peerslog" --triton-python /tmp/ptv/bin/python3 ${PEERS_ARGS:-} >>"$OUT/peers.txt" 2>&1
  echo "run_peers_gpu exit $?" >>"$OUT/peers.txt"
  tail -n 40 "$OUT/peers.txt"
fi

if [ -n "${GUARD_ARGS+x}" ]; then
  timeout ${GUARD_T:-300} python3 -m visionserve_tools.benchguard --device cuda --out "$OUT/guard.json" \
    --log-dir /tmp/benchguard-logs $GUARD_ARGS >"$OUT/guard.txt" 2>&1
  echo "benchguard exit $?" >>"$OUT/guard.txt"
  tail -n 40 "$OUT/guard.txt"
fi
