export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/checks
timeout 130 python3 benchmarks/bench.py step --implementation pallas_mosaic_gpu --variant persistent=false \
    --seqs 8192 --rounds 2 --reps 5 --budget 3 --out $OUT/checks 2>&1 | grep -v "^library" | tail -30
timeout 150 python3 benchmarks/bench.py coverage --seqs 8192 --features plain,segments,chunked_documents \
    --candidates --reps 5 --budget 2 --out $OUT/checks 2>&1 | tail -20
