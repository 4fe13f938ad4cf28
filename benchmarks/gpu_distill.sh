#!/usr/bin/env bash
# One-call GPU run of the distillation loss (issue 37) on the lent H200: the CUDA distillation tests, then
# bench_distill.py (unfused, Liger's LigerFusedLinearJSDLoss and LigerFusedLinearJSD, this package's
# fused_linear_distillation) at the issue's three shapes, forward KL and JSD, in one process.
#
#   device call: carry [".whl", ".baseline"], command `FLCE_COMMIT=<the commit sent> bash benchmarks/gpu_distill.sh`
#   (arguments go to bench_distill.py, e.g. `--shapes 0 --divergences jsd --repeats 20`; FLCE_COMMIT is recorded
#   in every JSON line, since the device's copy of .git can lag behind the tree that was sent)
#
# Time: the whole script ends within GPU_DISTILL_TOTAL_S (default 540 s = 9 min): the tests get at most
# TEST_TIMEOUT_S (150), the benchmark the rest as --budget-s (it skips a config predicted not to fit, and writes
# every config's lines as it ends, so a cut run keeps what finished). SKIP_TESTS=1 skips the tests; TEST_FILES
# (default the distillation test files) and PYTEST_ARGS change them; SKIP_BENCH=1 skips the benchmark.
# The distillation CUDA tests are 64 (22 of the kernel, 42 of the op end to end) with their Triton compiles: if the
# 150 s do not hold them, run two calls: `SKIP_TESTS=1 bash benchmarks/gpu_distill.sh` (the benchmark, up to
# 9 min), then `SKIP_BENCH=1 TEST_TIMEOUT_S=500 TEST_FILES="tests/" PYTEST_STOP= bash benchmarks/gpu_distill.sh`
# (every CUDA test of the suite, the engine's changes included; PYTEST_STOP empty: no -x, every failure listed).
# LAUNCH_TESTS=4096:8 runs the distillation CUDA tests a second time under that launch of the kernel (blocks of at
# most 4096 columns, rows split for 8 programs an SM: the split launch; LAUNCH_TEST_TIMEOUT_S, 120).
# Files under $OUT: env.txt, cuda_tests.log, cuda_tests_launch.log, gpu_distill.log (everything), distill.jsonl,
# distill.md.
NAME=gpu_distill
TOTAL=${GPU_DISTILL_TOTAL_S:-540}
# shellcheck source=benchmarks/_gpu_env.sh
source "$(dirname "$0")/_gpu_env.sh"
{
    print_environment triton lightning liger_kernel lightning_flce
    install_deepspeed  # (tests/test_distill_fsdp1_zero3.py's ZeRO-3 case)

    if [ "${SKIP_TESTS:-0}" != "1" ]; then
        # test_distill_cuda.py whole (its module name matches -k cuda), and the tests of the other distillation
        # files that are marked or named cuda.
        read -r -a files <<<"${TEST_FILES:-$(ls tests/test_distill*.py 2>/dev/null | tr '\n' ' ')}"
        if [ "${#files[@]}" -gt 0 ]; then
            reserve=$([ "${SKIP_BENCH:-0}" = "1" ] && echo 20 || echo 240)  # the benchmark's time
            t=$(( $(left) - reserve < ${TEST_TIMEOUT_S:-150} ? $(left) - reserve : ${TEST_TIMEOUT_S:-150} ))
            [ "$t" -lt 30 ] && t=30
            step "CUDA distillation tests (timeout ${t}s): ${files[*]}"
            # shellcheck disable=SC2086
            timeout -k 10 "$t" "$PY" -m pytest -q ${PYTEST_STOP--x} -p no:cacheprovider -k cuda "${files[@]}" ${PYTEST_ARGS:-} \
                2>&1 | tail -40 | tee "$OUT/cuda_tests.log"
            echo "pytest exit status ${PIPESTATUS[0]} (5: none collected; 124/137: timed out)" | tee -a "$OUT/cuda_tests.log"
        else
            echo "no tests/test_distill*.py in this tree" | tee "$OUT/cuda_tests.log"
        fi
    fi

    if [ -n "${LAUNCH_TESTS:-}" ]; then
        # The distillation CUDA tests again under a candidate launch of the kernel (experiments/
        # distill_launch_override.py): LAUNCH_TESTS=<max block columns>:<programs an SM>, e.g. 4096:8 (the split
        # launch on blocks of 4096 x 8 warps) or 4096:0 (whole rows), so that one call checks a launch before it
        # becomes the default.
        reserve=$([ "${SKIP_BENCH:-0}" = "1" ] && echo 20 || echo 180)
        t=$(( $(left) - reserve < ${LAUNCH_TEST_TIMEOUT_S:-120} ? $(left) - reserve : ${LAUNCH_TEST_TIMEOUT_S:-120} ))
        [ "$t" -lt 30 ] && t=30
        step "CUDA distillation tests under the launch ${LAUNCH_TESTS} (timeout ${t}s)"
        # shellcheck disable=SC2086
        PYTHONPATH="$PWD/benchmarks/experiments:$PYTHONPATH" DISTILL_MAX_BLOCK_V="${LAUNCH_TESTS%%:*}" \
            DISTILL_PROGRAMS_PER_SM="${LAUNCH_TESTS##*:}" timeout -k 10 "$t" "$PY" -m pytest -q -p no:cacheprovider \
            -p distill_launch_override -k cuda tests/test_distill*.py ${PYTEST_ARGS:-} \
            2>&1 | tail -40 | tee "$OUT/cuda_tests_launch.log"
        echo "pytest exit status ${PIPESTATUS[0]} (5: none collected; 124/137: timed out)" | tee -a "$OUT/cuda_tests_launch.log"
    fi

    if [ "${SKIP_BENCH:-0}" != "1" ]; then
        step "bench_distill (left: $(left) s)"
        timeout -k 10 "$(( $(left) - 10 ))" "$PY" benchmarks/bench_distill.py --budget-s "$(( $(left) - 40 ))" "$@"
        echo "bench_distill exit status $?"
    fi
    step "done"
} 2>&1 | tee "$OUT/gpu_distill.log"
