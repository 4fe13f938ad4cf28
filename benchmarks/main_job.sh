#!/usr/bin/env bash
# Measures the main job, `lightning-flce fit --config default` (the README's first command), on this CPU and
# writes benchmarks/results/<date>_cpu_<arch>_<cores>cores_main_job/: metrics.csv and memory.png of the run,
# time.txt, commit.txt, command.txt and summary.md (validation loss and token accuracy per validation, train
# loss, peak RSS, the logits FLCEMemoryCallback reports avoided) for the README's numbers.
#
#   bash benchmarks/main_job.sh                      # in the current environment (lightning_flce importable)
#   bash benchmarks/main_job.sh --fresh-venv         # as the README: new venv + pip install, timed with the job
#   bash benchmarks/main_job.sh -- --trainer.max_steps 20   # arguments after -- go to `lightning-flce fit`
#   OUT_DIR=/tmp/x bash benchmarks/main_job.sh ...    # another results folder (a quick check, say)
#
# The job runs in an empty temporary folder with its own data cache, so tokenizer training and tokenization
# are part of the time, as on a first run. Run it on an otherwise idle machine: the time is wall-clock.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

fresh_venv=0
fit_args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --fresh-venv) fresh_venv=1; shift ;;
        --) shift; fit_args=("$@"); break ;;
        *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done

commit="$(git -C "$root" rev-parse --short HEAD)"
if [[ -n "$(git -C "$root" status --porcelain --untracked-files=no)" ]]; then commit="$commit-dirty"; fi
out="${OUT_DIR:-$root/benchmarks/results/$(date -u +%F)_cpu_$(uname -m)_$(nproc)cores_main_job}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [[ $fresh_venv == 1 ]]; then
    setup="python3 -m venv $work/venv && $work/venv/bin/pip install -q torch==2.13.0 -e $root && "
    cli="$work/venv/bin/lightning-flce"
else
    setup=""
    cli="python -m lightning_flce"
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
command="${setup}$cli fit --config default --data.init_args.cache_dir $work/cache ${fit_args[*]:-}"
echo "$command" > "$out/command.txt"
echo "$commit" > "$out/commit.txt"
echo "[main_job] commit $commit, $(nproc) cores; results -> $out"

cd "$work"
TIMEFORMAT=$'real\t%3R s\nuser\t%3U s\nsys\t%3S s'
{ time bash -c "$command" > "$out/log.txt" 2>&1; } 2> "$out/time.txt" || {
    echo "[main_job] the job failed; the end of its log:" >&2
    tail -30 "$out/log.txt" >&2
    exit 1
}
cat "$out/time.txt"

log_dir="$work/lightning_logs/default/tinygpt/version_0"
cp "$log_dir/metrics.csv" "$out/metrics.csv"
[[ -f "$log_dir/memory.png" ]] && cp "$log_dir/memory.png" "$out/memory.png"

python3 - "$out" <<'EOF'
import csv
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = list(csv.DictReader(open(out / "metrics.csv")))


def column(name):
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]


val, accuracy, train = column("val/loss"), column("val/token_accuracy"), column("train/loss_step")
rss, avoided = column("memory/peak_rss_mib"), column("memory/saved_by_fused_head_mib")
real = next(line.split("\t")[1].strip() for line in open(out / "time.txt") if line.startswith("real"))
lines = [
    f"# Main job on commit {(out / 'commit.txt').read_text().strip()}",
    "",
    f"- command: `{(out / 'command.txt').read_text().strip()}`",
    f"- wall time: {real}",
    "- validation loss: " + " → ".join(f"{v:.2f}" for _, v in val) + f" at steps {[s + 1 for s, _ in val]}",
    "- token accuracy: " + " → ".join(f"{100 * v:.0f}%" for _, v in accuracy),
    f"- train loss: {train[0][1]:.2f} → {train[-1][1]:.2f}" if train else "- train loss: not logged",
    f"- peak RSS: {min(v for _, v in rss):.0f}–{max(v for _, v in rss):.0f} MiB" if rss else "- peak RSS: not logged",
    f"- saved by the fused head per step (estimate): {avoided[-1][1]:.0f} MiB" if avoided else "- saving: not logged",
]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
