#!/usr/bin/env bash
# One-call GPU check for the lent H200 (no internet there): install carried wheels, print the environment,
# run the CUDA tests, the accumulation benchmark, then bench_flce.py (extra args are passed through), each
# step under `timeout` so the whole script ends inside GPU_CHECK_TOTAL_S (default 540 s = 9 min).
#
#   bash benchmarks/gpu_check.sh                      # everything, bench_flce on all configs (time-budgeted)
#   bash benchmarks/gpu_check.sh --quick              # bench_flce --quick
#   SKIP_TESTS=1 SKIP_ACCUM=1 bash benchmarks/gpu_check.sh --dtypes fp16   # benchmark only
#
# Knobs (env): OUT (default ./bench_out), GPU_CHECK_TOTAL_S (540), TEST_TIMEOUT_S (180),
# ACCUM_TIMEOUT_S (90), SKIP_TESTS, SKIP_ACCUM, SKIP_FLCE (set to 1 to skip a step), PYTEST_ARGS and
# ACCUM_ARGS (extra arguments); RUN_TUNE=1 / RUN_PROFILE=1 add tune_ce_kernel.py / profile_flce.py after the
# tests (TUNE_ARGS, PROFILE_ARGS; TUNE_TIMEOUT_S, default 60 s, and 90 s at most). Local plumbing check without a GPU:
#   TRITON_INTERPRET=1 SKIP_TESTS=1 ACCUM_ARGS="--device cpu --quick" RUN_TUNE=1 TUNE_ARGS="--device cpu" \
#     RUN_PROFILE=1 PROFILE_ARGS="--device cpu" bash benchmarks/gpu_check.sh --device cpu --quick
# Files written under $OUT: env.txt, cuda_tests.log, bench.log, accumulation.{json,md}, flce.{json,md}
# (flce<TAG>.* with --tag), ce_kernel.{json,md}, profile.{json,md}. The device tool returns at most 8 files:
# with more, everything is packed into gpu_check.tar.gz and only the .md tables stay beside it.
NAME=gpu_check
TOTAL=${GPU_CHECK_TOTAL_S:-540}
# shellcheck source=benchmarks/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"

# --- 2. environment ---------------------------------------------------------------------------------------
step "environment"
{
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
    "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"cc {p.major}.{p.minor}", f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
for name in ["triton", "lightning", "torchmetrics", "transformers", "jsonargparse", "liger_kernel",
             "cut_cross_entropy", "lightning_flce"]:
    try:
        mod = importlib.import_module(name)
        print(f"{name:18s} {getattr(mod, '__version__', '?'):12s} {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"{name:18s} IMPORT FAILED: {type(exc).__name__}: {exc}")
print("F.linear_cross_entropy built in:", hasattr(torch.nn.functional, "linear_cross_entropy"))
EOF
} 2>&1 | tee "$OUT/env.txt"

# --- 3. CUDA tests -------------------------------------------------------------------------------------------
TEST_STATUS="skipped"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    t=$(( $(left) - 60 < ${TEST_TIMEOUT_S:-180} ? $(left) - 60 : ${TEST_TIMEOUT_S:-180} ))
    [ "$t" -lt 10 ] && t=10
    step "CUDA tests (timeout ${t}s)"
    # shellcheck disable=SC2086
    timeout -k 10 "$t" "$PY" -m pytest -q -m cuda tests/ -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/cuda_tests.log"
    rc=$?
    case $rc in
        0) TEST_STATUS="passed" ;;
        5) TEST_STATUS="no tests collected (rc 5)" ;;
        124 | 137) TEST_STATUS="TIMED OUT after ${t}s" ;;
        *) TEST_STATUS="FAILED (rc $rc)" ;;
    esac
fi

# --- 3b. optional: CE kernel launch sweep and per-stage profile ---------------------------------------------
if [ "${RUN_TUNE:-0}" = "1" ]; then
    cap=${TUNE_TIMEOUT_S:-60}
    t=$(( $(left) - 60 < cap ? $(left) - 60 : cap ))
    [ "$t" -lt 10 ] && t=10
    step "tune_ce_kernel (timeout ${t}s)"
    # shellcheck disable=SC2086
    timeout -k 10 "$t" "$PY" benchmarks/tune_ce_kernel.py ${TUNE_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | tail -n 16
fi
if [ "${RUN_PROFILE:-0}" = "1" ]; then
    t=$(( $(left) - 60 < 90 ? $(left) - 60 : 90 ))
    [ "$t" -lt 10 ] && t=10
    step "profile_flce (timeout ${t}s)"
    # shellcheck disable=SC2086
    timeout -k 10 "$t" "$PY" benchmarks/profile_flce.py ${PROFILE_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | tail -n 12
fi

# --- 4. accumulation benchmark ------------------------------------------------------------------------------
ACCUM_STATUS="skipped"
if [ "${SKIP_ACCUM:-0}" != "1" ]; then
    t=$(( $(left) - 60 < ${ACCUM_TIMEOUT_S:-90} ? $(left) - 60 : ${ACCUM_TIMEOUT_S:-90} ))
    [ "$t" -lt 10 ] && t=10
    step "bench_accumulation (timeout ${t}s)"
    # shellcheck disable=SC2086
    timeout -k 10 "$t" "$PY" benchmarks/bench_accumulation.py ${ACCUM_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
    rc=$?
    ACCUM_STATUS=$([ $rc -eq 0 ] && echo ok || echo "rc $rc")
fi

# --- 5. providers benchmark ---------------------------------------------------------------------------------
FLCE_STATUS="skipped"
if [ "${SKIP_FLCE:-0}" != "1" ]; then
    t=$(( $(left) - 15 ))
    if [ "$t" -lt 30 ]; then
        FLCE_STATUS="not run: only ${t}s left"
    else
        step "bench_flce $* (timeout ${t}s, budget $((t - 25))s)"
        # --budget-s first so a --budget-s in "$@" wins; the script skips configs that would not fit.
        timeout -k 10 "$t" "$PY" benchmarks/bench_flce.py --budget-s $((t - 25)) "$@" 2>&1 | tee -a "$OUT/bench.log"
        rc=$?
        FLCE_STATUS=$([ $rc -eq 0 ] && echo ok || echo "rc $rc")
    fi
fi

# --- 6. short summary last (the device call returns only the output's tail) ---------------------------------
step "summary"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null || true
if [ -f "$OUT/accumulation.md" ]; then
    grep '^|' "$OUT/accumulation.md" | cut -c1-150
fi
for f in "$OUT"/flce*.md; do
    [ -f "$f" ] || continue
    echo "--- $f"
    awk '/^```$/{n++; next} n==1' "$f"
done
echo "cuda tests: $TEST_STATUS; $(tail -n 1 "$OUT/cuda_tests.log" 2>/dev/null)"
echo "bench_accumulation: $ACCUM_STATUS; bench_flce: $FLCE_STATUS; total $((SECONDS - START))s; files in $OUT:"
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    # The device tool returns at most 8 files: pack them all, keep the markdown tables readable beside.
    (cd "$OUT" && tar czf gpu_check.tar.gz --exclude=gpu_check.tar.gz ./* && find . -maxdepth 1 -type f \
        ! -name gpu_check.tar.gz ! -name '*.md' -delete)
fi
ls "$OUT"
