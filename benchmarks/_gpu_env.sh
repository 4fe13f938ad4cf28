# Common setup of the scripts run on the lent GPU machine (gpu_check.sh, gpu_check_x2.sh, gpu_e2e.sh),
# sourced after they set NAME (label of their log lines) and TOTAL (their time budget in seconds).
# Goes to the repo root; sets OUT (default ./bench_out), PY, START and the helpers step / left; installs
# the wheels carried in .whl/ (benchmarks/fetch_peers.sh: peers and lightning_flce's missing
# dependencies) into /tmp/site; puts the repo root on PYTHONPATH (the package is not installed there).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
START=$SECONDS
OUT=${OUT:-./bench_out}
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

left() { echo $((TOTAL - (SECONDS - START))); }
step() { echo; echo "=== [$NAME +$((SECONDS - START))s] $*"; }

SITE=/tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
    step "installing carried wheels into $SITE"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "warning: wheel install failed; peers or dependencies may be missing" >&2
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The GPU, torch and the packages named as arguments (version and path), into $OUT/env.txt as well.
print_environment() {
    step "environment"
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,temperature.gpu,power.draw \
            --format=csv || echo "nvidia-smi failed"
        "$PY" - "$@" <<'PYEOF'
import importlib, platform, sys
print("python", platform.python_version())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
        print(f"{name:16s} {getattr(mod, '__version__', '?'):10s} {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"{name:16s} IMPORT FAILED: {type(exc).__name__}: {exc}")
PYEOF
    } 2>&1 | tee "$OUT/env.txt"
}

# DeepSpeed (the ZeRO-3 tests), where benchmarks/fetch_peers.sh carried it in .whl/deepspeed: pip's resolver
# installs only what the image lacks.
install_deepspeed() {
    if compgen -G ".whl/deepspeed/deepspeed-*.whl" >/dev/null; then
        step "installing DeepSpeed from .whl/deepspeed"
        "$PY" -m pip install -q --no-index --find-links .whl/deepspeed --no-compile deepspeed 2>&1 | tail -n 5
        "$PY" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -n 3 | tee -a "$OUT/env.txt"
    fi
}
