#!/bin/bash
# v4 device call on 4 GPUs, in one command: while GPU 0 tunes the kernels and times the
# single-GPU table (bench part tune,single), GPUs 1-3 run the GPU tests and then GPU 1 times
# the cuDNN references the ring needs (part ideal); then the zigzag ring on 2 and 4 GPUs with
# the tuned config. Usage (repo root): OUT=dir bash benchmarks/run_gpu_v4.sh
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $R/smi.txt
python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())" >> $R/smi.txt 2>&1
(
  CUDA_VISIBLE_DEVICES=1,2,3 timeout ${TESTS_S:-180} python3 -m pytest tests/test_pallas_gpu.py -q -x -p no:cacheprovider \
    > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/tests.log
  CUDA_VISIBLE_DEVICES=1 timeout ${IDEAL_S:-120} python3 benchmarks/bench_ring.py --parts ideal \
    --ideal-totals 16384,65536,131072 --tag ideal --out $R > $R/ideal.log 2>&1; echo "ideal rc=$?" >> $R/ideal.log
) &
CUDA_VISIBLE_DEVICES=0 timeout ${SINGLE_S:-330} python3 benchmarks/bench_ring.py --parts tune,single --with-xla 0 \
  --tag single --out $R > $R/single.log 2>&1; echo "single rc=$?" >> $R/single.log
wait
CFG=$R/config_single.json; [ -f $CFG ] || CFG=""
timeout ${RING_S:-180} python3 benchmarks/bench_ring.py --parts ring --gpus 2,4 --layouts zigzag --with-xla 0 \
  ${CFG:+--config @$CFG} --prior $R/rows_single.jsonl,$R/rows_ideal.jsonl --tag ring --out $R > $R/ring.log 2>&1
echo "ring rc=$?" >> $R/ring.log
tar czf $OUT/all.tgz -C /tmp res
cp $R/rows_single.jsonl $R/rows_ring.jsonl $R/rows_ideal.jsonl $R/tests.log $OUT/ 2>/dev/null
tail -4 $R/tests.log; cat $R/smi.txt; grep -h "^part=\|tuned\|rc=" $R/single.log $R/ideal.log $R/ring.log
