#!/bin/bash
# Device check of the core on real GPUs: the demo, the XLA ring and API tests, the layers' example.
# Usage (repo root, on the GPU machine): OUT=dir bash benchmarks/run_gpu_core.sh
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee $OUT/env.log
timeout 150 python3 -m ringjax.demo 2>&1 | tee $OUT/demo.log
timeout 100 python3 -m ringjax.demo --seq 32768 --heads 32 --kv-heads 8 --head-dim 128 --window 4096 \
  --layout contiguous 2>&1 | tee -a $OUT/demo.log
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_api.py tests/test_layouts_merge.py \
  "tests/test_ring.py::test_layouts" tests/test_features_beyond.py -k "not 8" > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
tail -4 $OUT/tests.log
timeout 90 python3 examples/train_lm.py --steps 30 2>&1 | tail -5 | tee $OUT/train.log
