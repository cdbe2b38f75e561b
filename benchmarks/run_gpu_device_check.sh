#!/usr/bin/env bash
# A GPU kind not measured before (e.g. H100): run the GPU kernel tests, tune pallas_mosaic_gpu for
# the benchmark shapes and export the configs, then time one ring step beside cuDNN and Triton.
# Usage (repo root, device tool): OUT=dir bash benchmarks/run_gpu_device_check.sh
# Results: gpu.txt, tests.log, tune.log, configs.json (ship as ringjax/configs/<device kind>.json),
# bench.log and rows_<tag>.jsonl.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/ringjax-gpu}
TAG=${TAG:-check}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; date -u;
  python3 -c "import jax; print('jax', jax.__version__, jax.devices()[0].device_kind)"; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# the GPU kernels and the support matrix (xdist shares the GPU; memory is allocated on demand)
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" -rfE --tb=short \
  tests/test_pallas_mosaic_gpu.py tests/test_pallas_gpu.py tests/test_usage.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"
tail -3 "$OUT/tests.log"
# tune into a fresh cache, export it portable: the bench below then runs the tuned configs
export RINGJAX_CACHE_DIR=$(mktemp -d)
for seq in ${SEQS:-8192 32768}; do
  for causal in --causal ""; do
    timeout 120 python3 -m ringjax tune --batch 1 --seq "$seq" --heads 32 --kv-heads 8 --head-dim 128 \
      --dtype bfloat16 $causal --implementation pallas_mosaic_gpu --no-progress >> "$OUT/tune.log" 2>&1
  done
done
python3 -m ringjax cache export "$OUT/configs.json" --portable >> "$OUT/tune.log" 2>&1
grep -E "best|on |exported|Error" "$OUT/tune.log"
timeout "${BENCH_S:-200}" python3 benchmarks/bench_ring.py --parts mosaic --seqs "${BENCH_SEQS:-8192,32768}" \
  --tag "$TAG" --out "$OUT" --with-triton 1 --reps "${REPS:-5}" > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
grep -E "^\| mosaic|rc=" "$OUT/bench.log"
rm -f "$OUT/config_$TAG.json" "$OUT"/*.png  # keep what comes back under the 8-file limit
