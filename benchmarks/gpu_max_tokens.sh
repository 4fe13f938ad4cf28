#!/usr/bin/env bash
# One-call search for the largest micro-batch per GPU (benchmarks/bench_max_tokens.py) on the lent H200 (no
# internet there): install the carried wheels (Liger-Kernel from .whl/), print the environment, run the search
# under `timeout` with --budget-s set to the time left, then print the summary and goals last. The whole
# script ends inside MAXTOK_TOTAL_S (default 540 s = 9 min, for a 10-minute device call). Extra arguments go
# to bench_max_tokens.py; split the work over calls and continue with --resume:
#
#   bash benchmarks/gpu_max_tokens.sh --checkpointing off                       # call 1: both axes, no ckpt
#   bash benchmarks/gpu_max_tokens.sh --checkpointing on --resume PREV.json     # call 2 (and 3: same again)
#   bash benchmarks/gpu_max_tokens.sh --model 3b --axes batch --checkpointing off --tag _3b
#   bash benchmarks/gpu_max_tokens.sh --checkpointing on --axes seq --sizes 16384,57344 --repeats 3 --tag _goal3
#
# PREV.json is the max_tokens.json an earlier call returned, put in the working tree where the device copy
# picks it up (e.g. benchmarks/results/<run>/max_tokens.json, untracked) or carried.
# Knobs (env): OUT (default ./bench_out), MAXTOK_TOTAL_S (540), PYTHON (python3).
# Local plumbing check without a GPU (Liger's Triton kernels fail on the CPU and show up as ERR):
#   OMP_NUM_THREADS=1 bash benchmarks/gpu_max_tokens.sh --device cpu --tiny --providers hf,flce --axes seq
# Files written under $OUT (5): env.txt, max_tokens.log, max_tokens.{json,md,png} (max_tokens<TAG>.* with --tag).
NAME=gpu_max_tokens
TOTAL=${MAXTOK_TOTAL_S:-540}
# shellcheck source=benchmarks/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"

print_environment triton lightning transformers liger_kernel matplotlib lightning_flce

t=$((TOTAL - (SECONDS - START) - 15))
STATUS="not run: only ${t}s left"
if [ "$t" -ge 60 ]; then
    step "bench_max_tokens $* (timeout ${t}s, budget $((t - 15))s)"
    # --budget-s first so a --budget-s in "$@" wins; a try starts only if its predicted time fits.
    timeout -k 10 "$t" "$PY" benchmarks/bench_max_tokens.py --budget-s $((t - 15)) "$@" 2>&1 | tee "$OUT/max_tokens.log"
    rc=$?
    STATUS=$([ $rc -eq 0 ] && echo ok || echo "rc $rc")
fi

step "summary"
for f in "$OUT"/max_tokens*.md; do
    [ -f "$f" ] || continue
    echo "--- $f"
    awk '/^```$/{n++; next} n==1' "$f"
done
echo "bench_max_tokens: $STATUS; total $((SECONDS - START))s; files in $OUT:"
ls -la "$OUT"
