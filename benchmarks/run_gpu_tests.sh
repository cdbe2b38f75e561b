#!/usr/bin/env bash
# The whole test suite on the GPU machine (device tool): `bash benchmarks/run_gpu_tests.sh`.
# Results under $OUT: gpu.txt (device, driver, jax), pytest.log (the run), junit.xml, demo.log.
# WORKERS=N spreads the tests over N pytest-xdist processes sharing the GPU(s); memory is
# then allocated on demand so that the processes fit side by side.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/ringjax-gpu}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u;
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/gpu.txt"
args=(-q -p no:cacheprovider -rsfE --tb=short --durations=15 --junitxml="$OUT/junit.xml")
if [ -n "${WORKERS:-}" ]; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  args+=(-n "$WORKERS" --dist loadgroup)  # loadgroup: the CPU bench suites run once, in one worker
fi
# SIGINT at the time limit: pytest stops and still prints its summary of failures; the log names every test
# as it ends (-v), so a run cut short still says what failed (the console shows only failures and the summary)
timeout -s INT -k 60 "${TEST_TIMEOUT:-420}" python3 -m pytest -v "${args[@]}" "$@" > "$OUT/pytest.log" 2>&1
grep -E "FAILED|ERROR|passed|failed|error" "$OUT/pytest.log" | grep -v "PytestBenchmarkWarning" | tail -60
timeout 120 python3 -m ringjax.demo 2>&1 | tail -20 | tee "$OUT/demo.log"
