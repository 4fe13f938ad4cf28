#!/usr/bin/env bash
# One call on the 2-GPU machine (nvidia-h200-x2, no internet): install the carried wheels, print the
# environment, run benchmarks/bench_multi_gpu.py (DDP vs FSDP2 vs vocab-parallel head, ~1.5B Llama-style
# model) and then `pytest -m cuda tests/test_multi_gpu.py` (vocab-parallel op over NCCL; Lightning DDP, FSDP1,
# FSDP2 vs one float64 process), each under `timeout`, so the whole script ends inside GPU_CHECK_TOTAL_S
# (default 540 s = 9 min). Tables and the test summary are printed last (the device call returns the tail).
#
#   bash benchmarks/gpu_check_x2.sh                       # everything (extra args go to bench_multi_gpu.py)
#   SKIP_TESTS=1 bash benchmarks/gpu_check_x2.sh --seq 2048
#
# Knobs (env): OUT (default ./bench_out), GPU_CHECK_TOTAL_S (540), BENCH_TIMEOUT_S (210), SKIP_BENCH,
# SKIP_TESTS (1 skips a step), PYTEST_ARGS. Local plumbing check without GPUs (the cuda tests then skip):
#   bash benchmarks/gpu_check_x2.sh --device cpu --tiny
# DeepSpeed (ZeRO-3 suite) comes from .whl/deepspeed (benchmarks/fetch_peers.sh) when carried.
# Files written under $OUT (5 of the device tool's 8): env.txt, bench_multi_gpu.log, multi_gpu.json,
# multi_gpu.md, multi_gpu_tests.log.
#
# NVLink multicast stays off, here and in every process started from here (the workers inherit these).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NAME=gpu_check_x2
TOTAL=${GPU_CHECK_TOTAL_S:-540}
# shellcheck source=benchmarks/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"

# --- 2. environment ---------------------------------------------------------------------------------------
step "environment"
{
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi topo -m || true
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
    "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    try:
        print("nccl", torch.cuda.nccl.version())
    except Exception as exc:
        print("nccl version unknown:", exc)
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB")
for name in ["triton", "lightning", "torchmetrics", "transformers", "jsonargparse", "lightning_flce"]:
    try:
        mod = importlib.import_module(name)
        print(f"{name:14s} {getattr(mod, '__version__', '?'):12s} {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"{name:14s} IMPORT FAILED: {type(exc).__name__}: {exc}")
EOF
} 2>&1 | tee "$OUT/env.txt"

# --- 2b. DeepSpeed (for the ZeRO-3 suite): pip's resolver installs only what the image lacks ---------------
install_deepspeed

# --- 3. benchmark ------------------------------------------------------------------------------------------
BENCH_STATUS="skipped"
if [ "${SKIP_BENCH:-0}" != "1" ]; then
    cap=${BENCH_TIMEOUT_S:-210}
    t=$(( $(left) - 150 < cap ? $(left) - 150 : cap ))
    [ "$t" -lt 30 ] && t=30
    step "bench_multi_gpu.py $* (timeout ${t}s)"
    timeout -k 10 "$t" "$PY" benchmarks/bench_multi_gpu.py --timeout-s $((t - 10)) "$@" 2>&1 | tee "$OUT/bench_multi_gpu.log"
    rc=$?
    case $rc in
        0) BENCH_STATUS="ok" ;;
        124 | 137) BENCH_STATUS="TIMED OUT after ${t}s" ;;
        *) BENCH_STATUS="rc $rc" ;;
    esac
fi

# --- 4. 2-GPU tests ----------------------------------------------------------------------------------------
TEST_STATUS="skipped"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    t=$(( $(left) - 20 ))
    [ "$t" -lt 30 ] && t=30
    step "pytest -m cuda tests/test_multi_gpu.py (timeout ${t}s)"
    # -s: the tests print the measured errors ("[multi_gpu] ..." lines)
    # shellcheck disable=SC2086
    timeout -k 10 "$t" "$PY" -m pytest -q -s -m cuda tests/test_multi_gpu.py -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/multi_gpu_tests.log"
    rc=$?
    case $rc in
        0) TEST_STATUS="passed" ;;
        5) TEST_STATUS="no tests collected (rc 5)" ;;
        124 | 137) TEST_STATUS="TIMED OUT after ${t}s" ;;
        *) TEST_STATUS="FAILED (rc $rc)" ;;
    esac
fi

# --- 5. summary last -----------------------------------------------------------------------------------------
step "summary"
if [ -f "$OUT/multi_gpu_tests.log" ]; then
    grep -E '^\[multi_gpu\]' "$OUT/multi_gpu_tests.log" | cut -c1-300
    grep -E '^(FAILED|ERROR) ' "$OUT/multi_gpu_tests.log" | cut -c1-300
fi
if [ -f "$OUT/multi_gpu.md" ]; then
    awk '/^```$/{n++; next} n==1' "$OUT/multi_gpu.md"
fi
echo "bench_multi_gpu: $BENCH_STATUS"
echo "tests: $TEST_STATUS; $(tail -n 1 "$OUT/multi_gpu_tests.log" 2>/dev/null)"
echo "total $((SECONDS - START))s; files in $OUT:"
ls "$OUT"
