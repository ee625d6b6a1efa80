#!/usr/bin/env bash
# mori-cco on one NVIDIA GPU, two ranks sharing it under MPS: build, the GPU tests, then
# `mori bench cco` (all-reduce 4 KiB-1 MiB in CUDA graphs against the device barrier of the same
# run, then the whole suite 4 KiB-1 GiB against NCCL and torch symmetric memory where they run).
#
#   bash packages/mori-cco/tools/gpu_check.sh tests      # build + GPU tests        (about 5 min)
#   bash packages/mori-cco/tools/gpu_check.sh bench      # build + both benchmarks  (about 6 min)
#   bash packages/mori-cco/tools/gpu_check.sh            # all of it
#
# Results (printed output and JSON records) go to $OUT (default ./bench-results). Each step has a
# time limit and the script carries on after a failed step; the exit status is 1 if any failed.
# MPS: a control daemon is started with private pipe/log directories (and stopped on exit) unless
# one is running already; nothing else on the GPU is changed.
set -u -o pipefail
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_MODULE_LOADING=EAGER
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
failed=0
step() {  # step NAME SECONDS CMD...: run, tee its output to $OUT/NAME.txt, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || failed=1
}

stage=${1:-all}
case $stage in all | tests | bench) ;; *) echo "usage: $0 [all|tests|bench]" >&2; exit 2 ;; esac

step install 240 python -m pip install --no-build-isolation --no-deps --force-reinstall --quiet \
    packages/mori-core tests/mori-testing backends/nvlink packages/mori-cco
nvidia-smi -L | tee "$OUT/gpu.txt"

if ! pgrep -x nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mori-cco-mps/pipe}
    export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mori-cco-mps/log}
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
    echo "MPS control daemon started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
else
    echo "MPS control daemon already running"
fi

if [ "$stage" != bench ]; then
    step tests 330 env MORI_TEST_GPUS=1 python -m pytest -m cuda -v -x -p no:cacheprovider \
        packages/mori-cco/tests/test_gpu.py
fi
if [ "$stage" != tests ]; then
    step bench-small 150 mori bench cco --device cuda --ranks 2 --gpus 1 --collectives allreduce \
        --sizes 4K,16K,64K,256K,1M --iters 30 --reps 50 --json "$OUT/cco-cuda-h200-mps-allreduce.json"
    step bench-full 330 mori bench cco --device cuda --ranks 2 --gpus 1 --json "$OUT/cco-cuda-h200-mps.json"
fi
exit $failed
