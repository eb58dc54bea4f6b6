#!/usr/bin/env bash
# The product benchmark on one H200, after the device pack is installed into /tmp/site
# (shared/GPU.md): plain vLLM vs AFD 1A:1F on the same GPU (0.5-GPU bundles, cuda_ipc
# under NVIDIA MPS), through the real Serve app, with random weights of a real model's
# shape (`afd_ray.models.shapes`, `load_format: dummy`). Run from the repo root:
#   COMMIT=<git commit of this checkout> bash benchmarks/h200/product.sh OUT [PART ...]
# COMMIT is required: the device's copy has no .git; every result file and OUT/product.json
# record it, and the summary refuses results of another commit.
# PARTs (default: equal dsv2):
#   equal-run  tests/gpu/test_serve_one_gpu.py whole: tiny Llama, Qwen3-MoE (float32) and
#          DeepSeek-V3 (MLA, bf16) in eager, piecewise and full-decode graphs, and
#          2A:1F-dbo: the equality of this run (EQUAL_RUN_S, default 570; 10 cases of
#          80-130 s each, the FP8 case more than 150 s: on an H100 a run bounded at 150 s
#          was still starting its AFD app after plain vLLM FP8 had served; split them over
#          calls with EQUAL_K, a pytest -k filter, and TAG, which names each call's log
#          equal-run-TAG.log)
#   equal  tests/gpu/test_serve_one_gpu.py -k "llama and graphs": tiny Llama float32
#          through Serve on one GPU, AFD with piecewise CUDA graphs, token-equal to
#          plain vLLM in PIECEWISE (the correctness check before timing; equal-full
#          checks the default mode)
#   dsv2   DeepSeek-V2-Lite shape, bf16, batch 16/64/256, 4096-token prompts,
#          MAX_TOKENS output tokens (MLA KV: 31 KiB/token, 256 x 4352 tokens in 40 GiB);
#          the Qwen3 part's batches are 16/64/128 (BATCHES overrides both)
#   qwen3  Qwen3-30B-A3B shape, the same with 1280-token prompts (its GQA KV cache,
#          96 KiB/token, leaves no room for 256 x 4K beside its 58 GB of experts)
#   dsv2-fp8  as dsv2 with `model.quantization: fp8` on both sides (vLLM's dynamic FP8;
#          the FFN rank's routed experts in FP8), batch 64/256: the summary's `fp8` key
#   KV_GIB, ATTENTION_MEMORY, PLAIN_MEMORY override a part's KV cache (GiB) and GPU memory
#          fractions, set for a 141 GB H200; on an 80 GB H100 the DeepSeek-V2-Lite shape
#          fits batch 16/64 with KV_GIB=12 ATTENTION_MEMORY=0.45 PLAIN_MEMORY=0.75
#   fanin  DeepSeek-V2-Lite shape, as dsv2 but plain vs 2A:1F vs 2A:1F-dbo (two attention
#          ranks and one FFN rank on one GPU, 1/3-GPU bundles; -dbo: the FFN rank serves
#          the two attention ranks in two ubatches per layer, `ffn.ubatches` 2), batch
#          (total streams) 64/128 (FANIN_BATCHES), 18 GiB KV per engine, a 3 ms batching
#          window; TOPOLOGIES overrides the layouts
#   mla    tests/gpu/test_serve_one_gpu.py -k deepseek: tiny DeepSeek-V3 (MLA, bf16)
#          through Serve on one GPU vs plain vLLM, graphs and eager
#   equal-full  tests/gpu/test_serve_one_gpu.py -k "full and not dbo": every tiny family
#          with whole-step decode graphs (`attention.cudagraph_mode: full_decode`) vs
#          plain vLLM in FULL_AND_PIECEWISE (EQUAL_FULL_S, default 480)
# TOPOLOGIES picks the layouts of dsv2/qwen3 (default "plain 1A1F"); `1A1F` runs the
# default `attention.cudagraph_mode` (full_decode: whole decode steps in one graph),
# `1A1F-piecewise` piecewise attention graphs.
# Both sides run CUDA graphs (`--no-enforce-eager`): plain vLLM its default mode
# (FULL_AND_PIECEWISE), the AFD attention engine the graphs of `attention.cudagraph_mode`
# (`afd_ray.attention.engine.afd_compilation_config`; default full_decode, whose decode
# steps are FULL graphs too; `-piecewise` layouts: piecewise);
# EAGER=1 runs both eager.
# STREAM_INTERVAL (default 16) is both sides' `attention.stream_interval`, output tokens
# per streamed chunk: with one token per chunk both sides' tok/s stayed at about
# 1600-2300 from batch 16 to 256 (runs of 2026-12-01..03), the rate at which the Serve
# hops relay chunks, not the model's; STREAM_INTERVAL=1 measures that regime.
# Time limits per part: EQUAL_S, DSV2_S, QWEN3_S, FANIN_S seconds (defaults 200, 570, 570, 570).
# Counting (issue 32): every bench deploys each layout REPEATS times (default 3) in ABBA
# order (plain, 1A1F, 1A1F, plain, plain, 1A1F), and each measured round lasts at least
# MIN_ROUND_S (default 10) seconds: every stream sends REQUESTS (default 1) requests of
# MAX_TOKENS (default 256) tokens and keeps sending until then (a round of 16 x 256
# tokens lasted 1.5-2 s on the H200, and plain vLLM's tok/s moved 25-35% between runs of
# 2026-12-03). A deployment takes 100-150 s, so one device call (10 min) holds about 4:
# REDEPLOY=0 keeps a deployment at each ABBA turn (4 deployments for 3 repeats instead of
# 6), and BATCHES (one batch per call), REPEATS and TAG split a shape over calls: TAG names
# each call's files (product-dsv2-TAG.json), and the summary pools the repeats of every
# product-<shape>*.json in OUT, each file's pairs within it.
# Last, `python -m afd_ray.bench.summary` writes OUT/product.json (the issue-32 keys:
# same-batch ratios with repeats and spread, step split, equality of this run's logs,
# commit) from what the parts wrote; run `micro.sh OUT cuda_ipc moe_layer` into the same
# OUT before for its roundtrip and MoE-layer keys; PLAN_CHECK, PLAN_PREDICTIONS and
# FFN_VS_VLLM name JSON files whose keys of those names are copied in.
# Each prompt is distinct per stream; the unmeasured warm-up round sends the same
# prompts, so the measured round's prefill is a prefix-cache hit and its TPOT is decode
# over the full context. Exit status: the number of failed parts.
out=${1:?result folder}; shift
parts=${*:-equal dsv2}
commit=${COMMIT:?set COMMIT to the git commit of this checkout (the device copy has no .git)}
tag=${TAG:+-$TAG}
eager=$([ "${EAGER:-0}" = 1 ] && echo --enforce-eager || echo --no-enforce-eager)
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
failed=0
run() {  # run NAME SECONDS CMD...: run CMD under a bound, log to $out/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%T))"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -E "afd_ray.bench|SERVE_ONE_GPU|passed|failed|Error|error" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc ($(date -u +%T))"
  [ $rc -eq 0 ] || { failed=$((failed + 1)); tail -n 30 "$out/$name.log"; }
}
bench() {  # bench NAME SECONDS SHAPE PROMPT_TOKENS KV_GIB ATTENTION_MEMORY PLAIN_MEMORY (GPU fractions) [FLAGS...]
  local name=$1$tag limit=$2 shape=$3 prompt=$4 kv=$5 memory=$6 plain=$7; shift 7
  run "$name" "$limit" python3 -m afd_ray.bench --platform cuda --dtype bfloat16 --families "$shape" $eager \
    --topologies ${TOPOLOGIES:-plain 1A1F} --prompt-tokens "$prompt" \
    --max-tokens ${MAX_TOKENS:-256} --stream-interval ${STREAM_INTERVAL:-16} "$@" \
    --requests-per-stream ${REQUESTS:-1} --min-round-s ${MIN_ROUND_S:-10} --repeats ${REPEATS:-3} \
    $([ "${REDEPLOY:-1}" = 0 ] && echo --no-redeploy || echo --redeploy) --commit "$commit" \
    --max-model-len $((prompt + 256)) --kv-cache-gib "$kv" \
    --gpu-memory-utilization "$memory" --plain-gpu-memory-utilization "$plain" --checkpoints /tmp/afd-shapes \
    --request-timeout-s 400 --out "$out/$name.json"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d
pgrep -f nvidia-cuda-mps-control >/dev/null && echo "MPS daemon up" || echo "MPS daemon NOT up (cuda_ipc round trips are time-sliced: milliseconds)"
for part in $parts; do
  case $part in
    equal-run) run equal-run$tag "${EQUAL_RUN_S:-570}" python3 -m pytest tests/gpu/test_serve_one_gpu.py \
        --confcutdir=tests/gpu -rs -q -s -p no:cacheprovider ${EQUAL_K:+-k "$EQUAL_K"} ;;
    equal) run equal "${EQUAL_S:-200}" python3 -m pytest tests/gpu/test_serve_one_gpu.py --confcutdir=tests/gpu -rs -q -s \
        -p no:cacheprovider -k "llama and graphs" ;;
    dsv2) bench product-dsv2 "${DSV2_S:-570}" deepseek-v2-lite 4096 ${KV_GIB:-40} ${ATTENTION_MEMORY:-0.45} \
        ${PLAIN_MEMORY:-0.6} --concurrency ${BATCHES:-16 64 256} ;;
    dsv2-fp8) bench product-dsv2-fp8 "${DSV2_S:-570}" deepseek-v2-lite 4096 ${KV_GIB:-40} ${ATTENTION_MEMORY:-0.45} \
        ${PLAIN_MEMORY:-0.6} --quantization fp8 --concurrency ${BATCHES:-64 256} ;;
    qwen3) bench product-qwen3 "${QWEN3_S:-570}" qwen3-30b-a3b 1280 ${KV_GIB:-38} ${ATTENTION_MEMORY:-0.35} \
        ${PLAIN_MEMORY:-0.8} --concurrency ${BATCHES:-16 64 128} ;;
    fanin) TOPOLOGIES=${TOPOLOGIES:-plain 2A1F 2A1F-dbo} bench product-fanin "${FANIN_S:-570}" deepseek-v2-lite 4096 \
        18 0.25 0.6 --gpu-fraction 0.33 --batch-window-us 3000 --concurrency ${FANIN_BATCHES:-64 128} ;;
    equal-full) run equal-full "${EQUAL_FULL_S:-480}" python3 -m pytest tests/gpu/test_serve_one_gpu.py --confcutdir=tests/gpu \
        -rs -q -s -p no:cacheprovider -k "full and not dbo" ;;
    mla) run mla 400 python3 -m pytest tests/gpu/test_serve_one_gpu.py --confcutdir=tests/gpu -rs -q -s \
        -p no:cacheprovider -k deepseek ;;
    *) echo "unknown part $part"; failed=$((failed + 1)) ;;
  esac
done
# The results file, from this run's OUT only: equality records of its test logs, its
# benches (every call's), and micro.sh's cuda_ipc.json / moe_layer.json when it ran into
# the same OUT first (moe_fp8.json: `moe_layer --quantization fp8`, the `fp8` key).
shopt -s nullglob
summary=(--commit "$commit" --serve-logs "$out"/*.log)
benches=("$out"/product-dsv2*.json "$out"/product-qwen3*.json)
fanins=("$out"/product-fanin*.json)
[ ${#benches[@]} -gt 0 ] && summary+=(--bench "${benches[@]}")
[ ${#fanins[@]} -gt 0 ] && summary+=(--fan-in "${fanins[@]}")
[ -f "$out/cuda_ipc.json" ] && summary+=(--roundtrip "$out/cuda_ipc.json")
[ -f "$out/moe_layer.json" ] && summary+=(--moe-layer "$out/moe_layer.json")
[ -f "$out/moe_fp8.json" ] && summary+=(--fp8-moe-layer "$out/moe_fp8.json")
[ -n "${PLAN_CHECK:-}" ] && summary+=(--plan-check "$PLAN_CHECK")
[ -n "${PLAN_PREDICTIONS:-}" ] && summary+=(--plan-predictions "$PLAN_PREDICTIONS")
[ -n "${FFN_VS_VLLM:-}" ] && summary+=(--ffn-vs-vllm "$FFN_VS_VLLM")
python3 -m afd_ray.bench.summary "${summary[@]}" --out "$out/product.json" || failed=$((failed + 1))
exit $failed
