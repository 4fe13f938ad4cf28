#!/usr/bin/env bash
# One-call end-to-end Lightning benchmark for the lent H200 (no internet there): install the carried wheels
# (Liger-Kernel 0.8.5 from .whl/), print the environment, run benchmarks/bench_lightning_e2e.py (extra args
# are passed through) under `timeout`, then print the summary table last. The whole script ends inside
# E2E_TOTAL_S (default 540 s = 9 min, for a 10-minute device call).
#
#   bash benchmarks/gpu_e2e.sh                                  # ~1.2 B Llama, seq 4096, batch 4, hf,liger,flce
#   bash benchmarks/gpu_e2e.sh --batch-size 8 --steps 6         # more tokens per step
#   bash benchmarks/gpu_e2e.sh --providers flce,liger,liger_all
#
# Knobs (env): OUT (default ./bench_out), E2E_TOTAL_S (540), PYTHON (python3).
# Local plumbing check without a GPU (Liger's Triton kernels fail on the CPU and show up as ERR):
#   bash benchmarks/gpu_e2e.sh --device cpu --tiny
# Files written under $OUT (4): env.txt, e2e.log, e2e.json, e2e.md (e2e<TAG>.* with --tag).
NAME=gpu_e2e
TOTAL=${E2E_TOTAL_S:-540}
# shellcheck source=benchmarks/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"

print_environment triton lightning torchmetrics transformers liger_kernel lightning_flce

# --- 3. the benchmark (one subprocess per provider, each with its share of the budget) ---------------------
t=$((TOTAL - (SECONDS - START) - 15))
STATUS="not run: only ${t}s left"
if [ "$t" -ge 60 ]; then
    step "bench_lightning_e2e $* (timeout ${t}s, budget $((t - 20))s)"
    # --budget-s first so a --budget-s in "$@" wins; each provider gets (budget left) / (providers left).
    timeout -k 10 "$t" "$PY" benchmarks/bench_lightning_e2e.py --budget-s $((t - 20)) "$@" 2>&1 | tee "$OUT/e2e.log"
    rc=$?
    STATUS=$([ $rc -eq 0 ] && echo ok || echo "rc $rc")
fi

# --- 4. summary last (the device call returns only the output's tail) ---------------------------------------
step "summary"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null || true
for f in "$OUT"/e2e*.md; do
    [ -f "$f" ] || continue
    echo "--- $f"
    grep '^- \(date\|device\|torch\|lightning\|model\|batch\)' "$f" | cut -c1-400
    awk '/^```$/{n++; next} n==1' "$f"
done
echo "bench_lightning_e2e: $STATUS; total $((SECONDS - START))s; files in $OUT:"
ls "$OUT"
