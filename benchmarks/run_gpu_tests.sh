#!/usr/bin/env bash
# The whole test suite on the GPU machine (device tool): `bash benchmarks/run_gpu_tests.sh`.
# Results under $OUT: gpu.txt (device, driver, jax), pytest.log (the run), demo.log.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/ringjax-gpu}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u;
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider --durations=10 "$@" 2>&1 | tee "$OUT/pytest.log"
timeout 120 python3 -m ringjax.demo 2>&1 | tail -20 | tee "$OUT/demo.log"
