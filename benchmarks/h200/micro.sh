#!/usr/bin/env bash
# The H200 machine's microbenchmarks and GPU tests, after the device pack is installed
# into /tmp/site (shared/GPU.md). Run from the repo root; results go to OUT (a folder):
#   bash benchmarks/h200/micro.sh OUT [PART ...]
# PARTs, in the order given (default: all, in this order):
#   compat        vLLM 0.26/0.32 names resolve (afd_ray.compat) and the serving modules import
#   cuda_ipc_no_mps the cuda_ipc pair without MPS (time-sliced: milliseconds)
#   mps           start the NVIDIA MPS daemon; later parts run under it (stopped at exit)
#   cuda_ipc      the serving path's cuda_ipc pair, two processes on one GPU
#   e2e           tests/gpu/test_serve_one_gpu.py -k "$E2E_K" (default graphs; eager is the
#                 other half; at least 3 min per family with graphs; bounded by E2E_S seconds,
#                 default 580): AFD 1A:1F through Serve on one GPU vs plain vLLM
#   gpu_tests     the other tests in tests/gpu
#   moe_layer     one MoE layer vs its weight-read floor, with the Triton tile sweep
# Each part is bounded by `timeout` and runs even if an earlier one failed; the exit
# status is the number of failed parts.
out=${1:?result folder}; shift
parts=${*:-compat cuda_ipc_no_mps mps cuda_ipc e2e gpu_tests moe_layer}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
failed=0
run() {  # run NAME SECONDS CMD...: run CMD under a bound, log to $out/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%T))"
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"; tail -n 12 "$out/$name.log"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}
stop_mps() { [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control; }
trap stop_mps EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in $parts; do
  case $part in
    compat) run compat 120 python3 -c "
import vllm, afd_ray.compat as c
import afd_ray.serve.ingress, afd_ray.attention.server, afd_ray.attention.engine
import afd_ray.attention.models.llama, afd_ray.attention.models.qwen3_moe, afd_ray.attention.models.deepseek
print('vllm', vllm.__version__, 'errors', c.VLLM_REQUEST_ERRORS, c.ErrorResponse, c.create_error_response, c.clean_loc_for_param)" ;;
    cuda_ipc_no_mps) run cuda_ipc_no_mps 150 python3 -m afd_ray.bench.cuda_ipc --iters 5 --warmup 1 \
        --out "$out/cuda_ipc_no_mps.json" ;;
    mps) export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
         mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
         nvidia-cuda-mps-control -d && echo "MPS daemon started" || { echo "MPS failed"; failed=$((failed + 1)); } ;;
    cuda_ipc) run cuda_ipc 150 python3 -m afd_ray.bench.cuda_ipc --out "$out/cuda_ipc.json" ;;
    e2e) run e2e "${E2E_S:-580}" python3 -m pytest tests/gpu/test_serve_one_gpu.py --confcutdir=tests/gpu -rs -q -s -p no:cacheprovider \
        -k "${E2E_K:-graphs}" ;;
    gpu_tests) run gpu_tests 300 python3 -m pytest tests/gpu --confcutdir=tests/gpu -rs -q -s -p no:cacheprovider \
        --ignore=tests/gpu/test_serve_one_gpu.py ;;
    moe_layer) run moe_layer 200 python3 -m afd_ray.bench.moe_layer --sweep --out "$out/moe_layer.json" ;;
    *) echo "unknown part $part"; failed=$((failed + 1)) ;;
  esac
done
exit $failed
