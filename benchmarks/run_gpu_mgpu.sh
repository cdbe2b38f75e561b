#!/bin/bash
# Mosaic GPU ring-step kernels on one H100/H200: a smoke run (ptxas resource report), the kernel
# tests, then the step benchmark against cuDNN. Usage (repo root): OUT=dir bash benchmarks/run_gpu_mgpu.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $R/gpu.txt 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> $R/gpu.txt 2>&1
# smoke: one causal GQA fwd+bwd at 1K; a hang here (a barrier protocol bug) stops the run early
MOSAIC_GPU_DUMP_PTXAS=1 timeout ${SMOKE_S:-90} python3 -c "
import jax, jax.numpy as jnp, ringjax
ks = jax.random.split(jax.random.key(0), 4)
q, do = (jax.random.normal(k, (1, 1024, 32, 128), jnp.bfloat16) for k in ks[:2])
k, v = (jax.random.normal(k, (1, 1024, 8, 128), jnp.bfloat16) for k in ks[2:])
def loss(q, k, v, impl):
    return (ringjax.ring_attention(q, k, v, axis_name=None, causal=True, implementation=impl).astype(jnp.float32) * do).sum()
for impl in ('pallas_mosaic_gpu', 'xla'):
    out = jax.jit(lambda q, k, v: ringjax.ring_attention(q, k, v, axis_name=None, causal=True, implementation=impl))(q, k, v)
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, impl)
    if impl == 'xla':
        print('smoke rel err out/dq/dk/dv', [float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32))) for a, b in zip((o,) + tuple(gm), (out,) + tuple(g))])
    o, gm = out, g
print('smoke ok')
" > $R/smoke.log 2>&1
echo "smoke rc=$?" >> $R/smoke.log
grep -E "registers|spill|smoke|Error|error" $R/smoke.log | sort | uniq -c | head -20
if grep -q "smoke rc=0" $R/smoke.log; then
  timeout ${BENCH_S:-300} python3 benchmarks/bench_ring.py --parts mosaic --seqs ${SEQS:-8192,32768} \
    --tag mgpu --out $R --mosaic-configs "${CFGS:-}" --with-triton ${TRITON:-0} \
    --with-jax-mgpu ${JAX_MGPU:-0} --reps ${REPS:-5} > $R/bench.log 2>&1
  echo "bench rc=$?" >> $R/bench.log
  if [ -n "${PARTS:-}" ]; then
    timeout ${PARTS_S:-120} python3 benchmarks/mgpu_parts.py --seqs ${SEQS:-8192,32768} --configs "${CFGS:-}" \
      > $R/parts.log 2>&1
    echo "parts rc=$?" >> $R/parts.log
  fi
fi
timeout ${TESTS_S:-150} python3 -m pytest tests/test_pallas_mosaic_gpu.py -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
  > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
tail -15 $R/tests.log; grep -h "^part=\|^parts\|rc=" $R/bench.log $R/parts.log 2>/dev/null
