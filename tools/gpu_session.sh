#!/usr/bin/env bash
# One lease of a GPU machine, used well: install this tree there (no internet: the wheels it lacks
# travel in .whl/), then run the stages named on the command line, each logging to $OUT.
#
#   bash tools/gpu_session.sh setup tests      # every test marked cuda/gpu, ranks sharing the GPU under MPS
#                                              # (the proxy's GPU test among them; tools/proxy_gpu_check.sh runs it alone)
#   (carry .whl/ and, for the proxy over ucx, .whl-ucx/ with libucx-cu12 for the machine's python)
#   bash tools/gpu_session.sh setup bench      # the GPU benchmarks the issues ask for, JSON into $OUT
#
# Stages: setup (install), tests, bench. Ranks that share one GPU run under MPS (started and stopped
# here); ranks x SMs per rank stay at most 132 so no two launches wait on each other forever.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
rc=0

mps_on() { mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; nvidia-cuda-mps-control -d 2>/dev/null || true; }
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null || true; }
step() { echo "== $*" | tee -a "$OUT/steps.log"; }

setup() {
  step "setup: $(nvidia-smi -L | head -1); $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
  python3 -m pip list 2>/dev/null | grep -iE "^(pytest|hypothesis|numpy|msgpack|perfetto|protobuf|grpcio|redis|prometheus)" | tr -s ' ' | tr '\n' ';' | tee -a "$OUT/steps.log"; echo
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
  python3 -m pip install -q --no-deps --no-build-isolation packages/mori-core tests/mori-testing backends/nvlink \
    packages/mori-io packages/mori-viz packages/mori-ep packages/mori-umbp 2>&1 | tail -3 || return 1
  for extra in packages/mori-cco; do
    [ -d "$extra" ] && python3 -m pip install -q --no-deps --no-build-isolation "$extra" 2>&1 | tail -1
  done
  # ucx (the proxy's network transport) when its wheel was carried in .whl-ucx/ (pip download libucx-cu12)
  if compgen -G ".whl-ucx/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl-ucx/*.whl &&
      python3 -m pip install -q --no-deps --no-build-isolation backends/ucx 2>&1 | tail -1
  fi
  mori backends 2>&1 | tee "$OUT/backends.txt" | head -30
}

tests() {
  mps_on
  step "tests: pytest -m 'cuda or gpu'"
  local dirs=(packages/mori-core/tests backends/nvlink/tests packages/mori-io/tests packages/mori-ep/tests
              packages/mori-viz/tests packages/mori-umbp/tests/test_hbm.py backends/ucx/tests)
  [ -d packages/mori-cco/tests ] && dirs+=(packages/mori-cco/tests)
  local per_test=()
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 300)
  # one pytest per file, MPS restarted after a file that failed: a kernel that hangs leaves MPS
  # unusable (error 807 in every later test), so a hang costs its own file only
  local files
  files=$(python3 -m pytest -p no:cacheprovider -m "cuda or gpu" -q --collect-only --continue-on-collection-errors \
    "${dirs[@]}" 2>/dev/null | grep "::" | sed 's/::.*//' | sort -u)
  local f n=0
  for f in $files; do
    n=$((n + 1))
    timeout 420 python3 -m pytest -p no:cacheprovider -m "cuda or gpu" -q -rs "${per_test[@]}" "$f" \
      --junitxml "$OUT/gpu-tests-$n.xml" > "$OUT/gpu-tests-$n.log" 2>&1
    local frc=$?
    echo "$f: rc=$frc $(tail -1 "$OUT/gpu-tests-$n.log")" | tee -a "$OUT/gpu-tests.log"
    if [ $frc -ne 0 ]; then rc=1; mps_off; sleep 1; mps_on; fi
  done
  mps_off
}

bench() {
  mps_on
  step "bench: DeepEP layer vs MORI API, get_dispatch_layout (2 ranks x 66 SMs)"
  timeout 200 python3 tools/ep_deepep_gpu_check.py --ranks 2 --sms 66 --tokens 4096 --out "$OUT/ep-deepep-h200.json" \
    2>&1 | tail -25
  step "bench: EP dispatch/combine with tracing on vs off (2 ranks x 64 SMs)"
  timeout 200 mori bench ep --device cuda --ranks 2 --tokens 4096,128 --dtype bf16 --sms 64 --no-baseline --plot none \
    --trace "$OUT/ep-trace" --json "$OUT/ep-trace.json" 2>&1 | tail -25
  if [ -d packages/mori-cco ]; then
    step "bench: CCO all-reduce 4K-1M in CUDA graphs vs the device barrier (2 ranks sharing the GPU)"
    timeout 150 mori bench cco --device cuda --ranks 2 --gpus 1 --collectives allreduce \
      --sizes 4K,16K,64K,256K,1M --iters 30 --reps 50 --json "$OUT/cco-cuda-h200-mps-allreduce.json" 2>&1 | tail -25
  fi
  mps_off
}

for stage in "$@"; do
  case "$stage" in
    setup) setup || { echo "setup failed"; exit 1; } ;;
    tests) tests ;;
    bench) bench ;;
    *) echo "unknown stage $stage (setup, tests, bench)"; exit 2 ;;
  esac
done
exit $rc
