#!/usr/bin/env bash
# The GPU check: one machine with one NVIDIA GPU, under 8 minutes. Results (logs, JSON) go to ${OUT:-gpu-results}/.
#
#   1. the CUDA-IPC bank across processes and the CUDA stage workers (float32 golden ids, bf16): pytest -m gpu
#   2. random-weight checkpoints in the released layouts of Ouro-1.4B and Huginn-0125 (cdb_bench.random_checkpoint)
#   3. offline throughput, full depth vs no-refill vs CDB, bf16 on the GPU, both models (cdb bench offline)
#   4. serving through the deployed process tree, stages on the GPU, Ouro-1.4B-shaped (cdb bench serve)
#   5. whether the stage processes' kernels overlap or serialise on one GPU, without and with NVIDIA MPS
#
# Needs the project's dependencies importable (torch with CUDA from the machine; grpcio, protobuf,
# opentelemetry-*, transformers, safetensors, matplotlib, tqdm, pytest, jsonschema installed or carried as wheels
# and put on PYTHONPATH) and ../shared/golden beside the checkout for step 1's golden test. Each step has its own
# timeout; a failed step is logged and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PY:-python3}
CKPT=${CKPT:-/tmp/cdb-ckpt}
mkdir -p "$OUT" "$CKPT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { local name=$1 limit=$2; shift 2; echo "== $name (<= ${limit}s)"; timeout "$limit" "$@" >"$OUT/$name.log" 2>&1;
         echo "   exit $? ($(tail -n 1 "$OUT/$name.log" | cut -c1-150))"; }

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.csv" 2>&1

step pytest_gpu 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/services/test_shared_bank.py tests/model/test_presets.py
step ckpt_ouro 90 $PY -m cdb_bench.random_checkpoint --model ouro-1.4b --out "$CKPT/ouro-1.4b"
step ckpt_huginn 150 $PY -m cdb_bench.random_checkpoint --model huginn-0125 --out "$CKPT/huginn-0125"
GPU=(--device cuda --dtype bfloat16 --kv-policy last_exited)
step offline_ouro 90 $PY -m cdb bench offline --model "$CKPT/ouro-1.4b" "${GPU[@]}" --requests 128 --max-num-seqs 64 \
  --depth-mean 2.5 --depth-min 1 --prompt-len 16 64 --output-len 32 96 --json
step offline_huginn 120 $PY -m cdb bench offline --model "$CKPT/huginn-0125" "${GPU[@]}" --requests 64 --max-num-seqs 32 \
  --depth-mean 8 --depth-min 4 --prompt-len 16 64 --output-len 16 48 --json
step serve_ouro 150 $PY -m cdb bench serve --model "$CKPT/ouro-1.4b" --device cuda --dtype bfloat16 --dataset sharegpt \
  --scale 0.25 --requests 100 --rates 4,8,16,32 --depth-min 1 --depth-mean 2.5 --max-num-seqs 64 --latency-bound 0.05 \
  --bisect 1 --no-progress --out "$OUT/serve_ouro" --json
step overlap 60 $PY -m cdb_bench.gpu_overlap --json
if command -v nvidia-cuda-mps-control >/dev/null; then
  nvidia-cuda-mps-control -d && step overlap_mps 60 $PY -m cdb_bench.gpu_overlap --json
  echo quit | nvidia-cuda-mps-control
else
  echo "== overlap_mps: nvidia-cuda-mps-control not found" | tee "$OUT/overlap_mps.log"
fi
echo "results in $OUT/"
