#!/usr/bin/env bash
# The H200 machine's microbenchmarks and GPU tests, after the device pack is installed
# into /tmp/site (shared/GPU.md). Run from the repo root; results go to $1 (a folder).
#   bash benchmarks/h200/micro.sh "$OUT"
# Each part is bounded by `timeout` and runs even if an earlier one failed; the exit
# status is the number of failed parts.
out=${1:?result folder}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
failed=0
part() {  # part NAME SECONDS CMD...: run CMD under a bound, log to $out/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%T))"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"; tail -n 15 "$out/$name.log"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
part compat 120 python3 -c "
import vllm, afd_ray.compat as c
import afd_ray.serve.ingress, afd_ray.attention.server, afd_ray.attention.engine
import afd_ray.attention.models.llama, afd_ray.attention.models.qwen3_moe, afd_ray.attention.models.deepseek
print('vllm', vllm.__version__, 'errors', c.VLLM_REQUEST_ERRORS, c.ErrorResponse, c.create_error_response, c.clean_loc_for_param)"
part cuda_ipc 100 python3 -m afd_ray.bench.decode_nvlink --one-gpu --tokens 1 16 128 \
  --writes copy --iters 20 --timeout-s 90 --flag-timeout-ms 20000 --out "$out/cuda_ipc.json"
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
  part cuda_ipc_pair_mps 150 python3 -m afd_ray.bench.cuda_ipc --out "$out/cuda_ipc_pair_mps.json"
  part cuda_ipc_mps 150 python3 -m afd_ray.bench.decode_nvlink --one-gpu --tokens 1 16 128 \
    --iters 20 --timeout-s 120 --flag-timeout-ms 20000 --out "$out/cuda_ipc_mps.json"
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  echo "no nvidia-cuda-mps-control on this machine: MPS not measured"
fi
part moe_layer 200 python3 -m afd_ray.bench.moe_layer --sweep --out "$out/moe_layer.json"
part gpu_tests 300 python3 -m pytest tests/gpu --confcutdir=tests/gpu -rs -q -s -p no:cacheprovider
exit $failed
