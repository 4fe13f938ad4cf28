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
