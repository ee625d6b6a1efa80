#!/usr/bin/env bash
# GPU check of the SHMEM proxy (device API to PEs that loads and stores cannot reach), for a lent
# GPU machine after `bash tools/gpu_session.sh setup` (with ucx installed: backends/ucx and its wheel).
#
#   bash tools/proxy_gpu_check.sh          # logs and JUnit XML into $OUT (default /tmp/gpu-out)
#
# 1. the proxy's CPU tests on that machine (interpreter; same as CI), a baseline that the install works;
# 2. the GPU test: two PEs sharing the GPU under MPS, MORI_DISABLE_P2P=1 so every peer goes through
#    the proxy (ring in pinned host memory mapped into the GPU, heap moved by ucx's CUDA support),
#    compiled Triton kernels: put-with-signal + device wait, atomics. Skips, saying why, without
#    ucx CUDA support; `mori backends` in $OUT says what ucx found.
# 3. every kernel of the proxy tests compiled for sm_90 (and the other targets) by compile_kernels.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
rc=0
step() { echo "== $*" | tee -a "$OUT/proxy-steps.log"; }

step "proxy: CPU tests (interpreter)"
timeout 400 python3 -m pytest -p no:cacheprovider -q -rs packages/mori-core/tests/test_proxy.py -m "not cuda" \
  --junitxml "$OUT/proxy-cpu.xml" 2>&1 | tee "$OUT/proxy-cpu.log" | tail -15
rc=$((rc | ${PIPESTATUS[0]}))

step "proxy: GPU test (2 PEs on one GPU, every peer through the proxy)"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; nvidia-cuda-mps-control -d 2>/dev/null || true
mori backends 2>&1 | tee "$OUT/proxy-backends.txt" | grep -iE "ucx|tcp" | head -5
timeout 300 python3 -m pytest -p no:cacheprovider -q -rs packages/mori-core/tests/test_proxy.py -m cuda \
  --junitxml "$OUT/proxy-gpu.xml" 2>&1 | tee "$OUT/proxy-gpu.log" | tail -30
rc=$((rc | ${PIPESTATUS[0]}))
echo quit | nvidia-cuda-mps-control 2>/dev/null || true

step "proxy: kernels compile for every target"
timeout 600 python3 tools/compile_kernels.py --targets cuda:90,cuda:100,hip:gfx942,hip:gfx950 -j 8 2>&1 \
  | tee "$OUT/proxy-compile.log" | grep -E "_proxy_kernels|FAIL|failed" | head -30
rc=$((rc | ${PIPESTATUS[0]}))
exit $rc
