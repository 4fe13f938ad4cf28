#!/usr/bin/env bash
# One-call GPU run of the teacher's top-k cache (fused_linear_top_k): its CUDA tests, then bench_top_k.py at the
# distillation issue's teacher shapes (bf16, k = 20) against the unfused logits -> log_softmax -> topk.
#
#   device call: carry [".whl"], command `FLCE_COMMIT=<the commit sent> bash benchmarks/gpu_top_k.sh`
#   (arguments go to bench_top_k.py). Files under $OUT: env.txt, cuda_tests.log, top_k.json, gpu_top_k.log.
NAME=gpu_top_k
TOTAL=${GPU_TOP_K_TOTAL_S:-420}
# shellcheck source=benchmarks/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"
{
    print_environment triton lightning lightning_flce
    echo "FLCE_COMMIT=${FLCE_COMMIT:-unknown}" | tee -a "$OUT/env.txt"
    step "CUDA tests of the top k and of the distillation from a cached top k"
    timeout -k 10 "${TEST_TIMEOUT_S:-180}" "$PY" -m pytest -q -p no:cacheprovider tests/test_top_k.py \
        tests/test_distill_cuda.py -k "cuda or cached_top_k" 2>&1 | tail -30 | tee "$OUT/cuda_tests.log"
    echo "pytest exit status ${PIPESTATUS[0]}" | tee -a "$OUT/cuda_tests.log"
    step "bench_top_k.py $*"
    timeout -k 10 "$(( $(left) - 10 ))" "$PY" benchmarks/bench_top_k.py --out "$OUT/top_k.json" "$@"
    echo "bench exit status $?"
} 2>&1 | tee "$OUT/$NAME.log"
