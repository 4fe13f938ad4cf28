#!/usr/bin/env bash
# Fetch everything the GPU benchmark needs that the (offline) GPU machine lacks, into the ignored
# folder .whl/ at the repo root (`/.whl/` is in .gitignore; nothing here is ever committed):
#
#   .whl/*.whl       peer libraries (Liger-Kernel 0.8.5, cut-cross-entropy 25.1.1) and the pure-Python
#                    dependencies of lightning_flce missing from the GPU image (jsonargparse[signatures]).
#   .whl/deepspeed/  DeepSpeed 0.19.8 (a py3-none-any wheel built here from its sdist, ops JIT-compiled on use)
#                    and its dependencies for cp312 x86-64, installed by gpu_check_x2.sh with pip's resolver
#                    (`--no-index --find-links`): only what the GPU image lacks gets installed.
#   .whl/torch213/   the two pure-Python modules of torch 2.13's chunked F.linear_cross_entropy, copied
#                    from a local torch >= 2.13 install, loaded at run time by benchmarks/_providers.py
#                    when the GPU's torch is older.
#
# Run it here (where PyPI is reachable), then carry `.whl` in the device call.
# Usage: bash benchmarks/fetch_peers.sh            (uses `python3`, or $PYTHON if set)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl
mkdir -p "$DEST"

# All of these are pure-Python py3-none-any wheels, so a plain download matches the GPU's cp312/x86-64.
# Versions pinned to the ones tested here; keep ONE version of each (two stop the install there).
PEERS=(liger-kernel==0.8.5 cut-cross-entropy==25.1.1)
# lightning_flce needs jsonargparse[signatures]; the GPU image has PyYAML and typing-extensions
# but not these three (see /work/.library/device/KINDS.md, "Python packages already there").
DEPS=(jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0)

"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "${PEERS[@]}" "${DEPS[@]}"

# Refuse non-pure wheels (they would need --platform/--python-version matching the GPU machine).
for w in "$DEST"/*.whl; do
    case "$w" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
        *) echo "warning: $w is not a pure-Python wheel; re-download it for cp312 manylinux x86_64" >&2 ;;
    esac
done

# DeepSpeed (ZeRO-3 test on 2 GPUs): no wheel on PyPI, so build one from the sdist (DS_BUILD_OPS=0: pure
# Python; setup.py imports torch, hence --no-build-isolation with this interpreter's torch).
DS="$DEST/deepspeed"
mkdir -p "$DS"
if ! compgen -G "$DS/deepspeed-0.19.8-*.whl" >/dev/null; then
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DS" deepspeed==0.19.8
fi
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DS" \
    hjson py-cpuinfo einops msgpack ninja psutil pydantic pydantic-core annotated-types typing-inspection \
    typing-extensions tqdm packaging

# torch 2.13's linear_cross_entropy modules (pure Python: they import only torch, dataclasses, functools,
# typing). Copy them only if this interpreter's torch actually has them.
TORCH_NN_MODULES=$("$PY" -c 'import os, torch.nn.modules as m; print(os.path.dirname(m.__file__))')
mkdir -p "$DEST/torch213"
found=0
for f in linear_cross_entropy.py linear_cross_entropy_options.py; do
    if [ -f "$TORCH_NN_MODULES/$f" ]; then
        cp "$TORCH_NN_MODULES/$f" "$DEST/torch213/$f"
        found=$((found + 1))
    fi
done
if [ "$found" -ne 2 ]; then
    echo "warning: $TORCH_NN_MODULES lacks linear_cross_entropy*.py (torch < 2.13?); torch_native will be skipped on older GPUs" >&2
fi
"$PY" -c 'import torch; print(torch.__version__)' >"$DEST/torch213/SOURCE_TORCH_VERSION"

echo "fetched into $DEST:"
ls -la "$DEST" "$DEST/torch213"
du -sh "$DEST"
