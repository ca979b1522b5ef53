#!/usr/bin/env bash
# The GPU check: one machine with one NVIDIA GPU, under 9 minutes. Results (logs, JSON) go to ${OUT:-gpu-results}/.
#
#   1. the CUDA-IPC bank across processes and the CUDA stage workers (float32 golden ids, bf16): pytest -m gpu
#   1b. the synthetic GPU-cost profiles (h200:ouro-1.4b, h200:huginn-3.5b) against measured decode loop ops of the
#      released shapes on this device (cdb_bench.device_cost)
#   1c. `cdb serve` of a random-weight Ouro-1.4B with no --device: the GPU picked, the KV cache sized to its memory,
#      one streamed completion over HTTP (scripts/serve_smoke.py); the memory plans of both released shapes
#   2. random-weight checkpoints in the released layouts of Ouro-1.4B and Huginn-0125 (cdb_bench.random_checkpoint)
#   3. offline throughput, full depth vs no-refill vs CDB, bf16 on the GPU, both models (cdb bench offline)
#   4. serving through the deployed process tree, stages on the GPU, Ouro-1.4B-shaped (cdb bench serve)
#   5. whether the stage processes' kernels overlap or serialise on one GPU, without and with NVIDIA MPS
#
# Needs the project's dependencies importable (torch with CUDA from the machine; grpcio, protobuf,
# opentelemetry-*, transformers, safetensors, matplotlib, tqdm, pytest, jsonschema installed or carried as wheels
# and put on PYTHONPATH) and ../shared/golden beside the checkout for step 1's golden test. Each step has its own
# timeout, cut to what is left of BUDGET seconds (default 540) for the whole check; a failed step is logged and the
# next one runs, and a step with under 20 s left is skipped. The steps run most telling first; ONLY="a b" runs the
# steps named a and b alone.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PY:-python3}
CKPT=${CKPT:-/tmp/cdb-ckpt}
mkdir -p "$OUT" "$CKPT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${BUDGET:-540}
step() {
  local name=$1 limit=$2 left=$((BUDGET - SECONDS)); shift 2
  if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then return; fi
  if ((left < 20)); then echo "== $name: skipped, ${left}s of the budget left" | tee "$OUT/$name.log"; return; fi
  ((limit > left)) && limit=$left
  echo "== $name (<= ${limit}s, at ${SECONDS}s)"; timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $? ($(tail -n 1 "$OUT/$name.log" | cut -c1-150))"
  leftovers  # a step cut by its timeout leaves no process holding the GPU for the next
}
leftovers() {
  local pattern='-m cdb(\.zygote| stage| scheduler| frontend)'
  pgrep -f -- "$pattern" >/dev/null || return 0
  echo "   (ending $(pgrep -fc -- "$pattern") leftover cdb processes)"
  pkill -TERM -f -- "$pattern"; sleep 5; pkill -KILL -f -- "$pattern" || true
}

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.csv" 2>&1

step pytest_gpu 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/services/test_shared_bank.py tests/model/test_presets.py
step device_cost 120 $PY -m cdb_bench.device_cost --eager --profile-width 1 --out "$OUT/device_cost.json"
step ckpt_ouro 90 $PY -m cdb_bench.random_checkpoint --model ouro-1.4b --out "$CKPT/ouro-1.4b"
step serve_auto 120 $PY scripts/serve_smoke.py "$CKPT/ouro-1.4b"
step memory_plans 30 $PY scripts/memory_plans.py
GPU=(--device cuda --dtype bfloat16 --kv-policy last_exited)
step offline_ouro 90 $PY -m cdb bench offline --model "$CKPT/ouro-1.4b" "${GPU[@]}" --requests 128 --max-num-seqs 64 \
  --depth-mean 2.5 --depth-min 1 --prompt-len 16 64 --output-len 32 96 --json
step serve_ouro 150 $PY -m cdb bench serve --model "$CKPT/ouro-1.4b" --device cuda --dtype bfloat16 --dataset sharegpt \
  --scale 0.25 --requests 60 --rates 8,32 --depth-min 1 --depth-mean 2.5 --max-num-seqs 64 --latency-bound 0.05 \
  --bisect 1 --no-progress --out "$OUT/serve_ouro" --json
step overlap 60 $PY -m cdb_bench.gpu_overlap --json
step ckpt_huginn 150 $PY -m cdb_bench.random_checkpoint --model huginn-0125 --out "$CKPT/huginn-0125"
step offline_huginn 120 $PY -m cdb bench offline --model "$CKPT/huginn-0125" "${GPU[@]}" --requests 64 --max-num-seqs 32 \
  --depth-mean 8 --depth-min 4 --prompt-len 16 64 --output-len 16 48 --json
if command -v nvidia-cuda-mps-control >/dev/null; then
  nvidia-cuda-mps-control -d && step overlap_mps 60 $PY -m cdb_bench.gpu_overlap --json
  echo quit | nvidia-cuda-mps-control
else
  echo "== overlap_mps: nvidia-cuda-mps-control not found" | tee "$OUT/overlap_mps.log"
fi
echo "results in $OUT/"
