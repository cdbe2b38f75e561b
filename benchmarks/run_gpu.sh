#!/bin/bash
# One device call: GPU tests, the side-by-side benchmark, ppermute under several settings.
# Usage (repo root, 4 GPUs): OUT=dir bash benchmarks/run_gpu.sh
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $R/smi.txt
nvidia-smi topo -m >> $R/smi.txt 2>&1
timeout 200 python3 -m pytest tests/test_pallas_gpu.py -q 2>&1 | tail -15 > $R/tests.log; tail -3 $R/tests.log
CFG=${CFG:-}
timeout ${MAIN_S:-330} python3 benchmarks/bench_ring.py --parts ${PARTS:-single,ring,million} ${CFG:+--config "$CFG"} \
  --tag main --out $R > $R/main.log 2>&1; echo "main rc=$?"
pp() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout 60 python3 benchmarks/bench_ring.py --parts ppermute --tag pp_$tag --out $R 2>&1 \
    | grep "^part=" >> $R/pp.log
}
pp default
pp lhs XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true
pp memcpy_p2p XLA_FLAGS=--xla_gpu_use_memcpy_local_p2p=true
pp channels32 NCCL_MIN_NCHANNELS=32 NCCL_MAX_NCHANNELS=32
pp p2p_chunk2m NCCL_P2P_NVL_CHUNKSIZE=2097152 NCCL_PROTO=Simple
pp p2p_nvl NCCL_P2P_LEVEL=NVL NCCL_P2P_NET_CHUNKSIZE=2097152 NCCL_BUFFSIZE=16777216
timeout 60 python3 - >> $R/pp.log 2>&1 <<'PY'
import torch
a = torch.randn(2**29, dtype=torch.bfloat16, device="cuda:0"); b = torch.empty_like(a, device="cuda:1")
for _ in range(3): b.copy_(a)
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(10):
    s.record(); b.copy_(a); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
ts.sort(); print(f"part=ppermute impl=torch_peer_copy 1024 MiB gpu0->gpu1 {2**30 / ts[5] / 1e6:.1f} GB/s")
PY
cp $R/tests.log $R/main.log $R/pp.log $R/bench_main.json $R/bench_main.png $OUT/ 2>/dev/null
tar czf $OUT/all.tgz -C /tmp res
grep -v "^|" $R/main.log | tail -60; cat $R/pp.log
