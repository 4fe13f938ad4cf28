#!/usr/bin/env bash
# One-call GPU check of the RL losses (issue 36) on the lent H200: CUDA tests of the log-prob and policy-loss
# kernels and of the cross-entropy after the engine's plug-in change, bench_rl.py at the issue's three shapes
# (Liger's fused GRPO loss in the same run when carried), and the cross-entropy against the commit before the
# change (bench_flce.py's flce_base row from .baseline/, `python3 benchmarks/make_baseline.py REV` here first).
#
#   device call: carry [".whl", ".baseline"], command `bash benchmarks/gpu_rl.sh`
# Files under $OUT: env.txt, cuda_tests.log, bench_rl.json, flce.json, flce.md (and the whole log via tee).
NAME=gpu_rl
TOTAL=${GPU_RL_TOTAL_S:-560}
# shellcheck source=benchmarks/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"
print_environment triton lightning liger_kernel lightning_flce

step "CUDA tests"
timeout "${TEST_TIMEOUT_S:-200}" "$PY" -m pytest -q -x -p no:cacheprovider -m cuda \
    tests/test_logprobs.py tests/test_policy_loss.py tests/test_op_cuda.py tests/test_logits_precision.py \
    2>&1 | tail -25 | tee "$OUT/cuda_tests.log"

step "bench_rl (left: $(left) s)"
timeout "${RL_TIMEOUT_S:-220}" "$PY" benchmarks/bench_rl.py --rounds "${RL_ROUNDS:-5}" --reps "${RL_REPS:-2}"

step "cross-entropy against the baseline (left: $(left) s)"
timeout "$(( $(left) - 10 ))" "$PY" benchmarks/bench_flce.py --shapes 1,2,3 --dtypes bf16 --dists random \
    --providers flce,flce_base --samples "${CE_SAMPLES:-12}" --budget-s "$(( $(left) - 20 ))"
step "done"
