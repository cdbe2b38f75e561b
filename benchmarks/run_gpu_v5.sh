#!/bin/bash
# v5 device call on 4 GPUs: GPU tests (all 4 GPUs), split vs fused (relaxed atomics) backward
# at 32K causal; if fused wins, the single-GPU table and the 2/4-GPU zigzag ring again with it;
# then 1M tokens causal fwd+bwd on 4 GPUs. Usage (repo root): OUT=dir bash benchmarks/run_gpu_v5.sh
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
PRIOR=benchmarks/results/h200x4_2026-11-21_v4_single.json,benchmarks/results/h200x4_2026-11-21_v4_ideal.json
timeout ${TESTS_S:-120} python3 -m pytest tests/test_pallas_gpu.py -q -x -p no:cacheprovider > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
CUDA_VISIBLE_DEVICES=0 timeout ${TUNE_S:-120} python3 benchmarks/bench_ring.py --parts tune --tune-fwd 0 \
  --tune-bwd s64.64.4.2,f64.64.4.2,f64.128.8.2,f128.128.8.2 --tag tune --out $R > $R/tune.log 2>&1
echo "tune rc=$?" >> $R/tune.log
CFG=$R/config_tune.json; [ -f $CFG ] || echo '{}' > $CFG
if grep -q '"bwd_fused": true' $CFG; then
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_ring.py --parts single --with-xla 0 --config @$CFG \
    --tag single --out $R > $R/single.log 2>&1; echo "single rc=$?" >> $R/single.log
  timeout 120 python3 benchmarks/bench_ring.py --parts ring --gpus 2,4 --layouts zigzag --with-xla 0 --config @$CFG \
    --prior $PRIOR --tag ring --out $R > $R/ring.log 2>&1; echo "ring rc=$?" >> $R/ring.log
fi
timeout ${MILLION_S:-150} python3 benchmarks/bench_ring.py --parts million --config @$CFG --tag million --out $R \
  > $R/million.log 2>&1; echo "million rc=$?" >> $R/million.log
tar czf $OUT/all.tgz -C /tmp res
cp $R/tests.log $R/rows_*.jsonl $OUT/ 2>/dev/null
tail -3 $R/tests.log; grep -h "^part=\|tuned\|rc=" $R/tune.log $R/single.log $R/ring.log $R/million.log 2>/dev/null
