"""Does a refactor of the distillation kernel leave its GPU code alone? The sm_90 SASS of this tree's kernel and of
another revision's, compared opcode by opcode per specialization, on any machine (no GPU): Triton compiles for
sm_90 with its bundled ptxas, and ``nvdisasm`` reads the cubins (as ``distill_kernel_resources.py`` does).

The other revision's kernel is compiled with that revision's own ``distill_kernel_resources.py`` (its signature and
constexprs), so the revision must have one (2026-12-05 and later). A row prints both instruction counts and the
opcodes whose counts differ; equal loops give equal speed.

    python3 benchmarks/experiments/distill_kernel_sass_diff.py 2ae6aa4

Run 2026-12-06 against 2ae6aa4 (the kernel the H100 results measured) after the split launch's refactor: the
whole-row kernel differs by one ``S2UR`` (``program_id(1)``), one compare and one branch, outside the loops
(with the CE also one scalar FFMA as FMUL + FADD).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import distill_kernel_resources as current  # noqa: E402

VARIANTS = [
    {"divergence": "forward_kl", "has_ce": False},
    {"divergence": "reverse_kl", "has_ce": False},
    {"divergence": "jsd", "has_ce": False},
    {"divergence": "jsd", "has_ce": True},
    {"divergence": None, "has_ce": True},
    {"divergence": "forward_kl", "has_ce": False, "logits": "fp32"},
]
_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def _show(revision: str, path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{revision}:{path}"], capture_output=True, text=True, check=True, cwd=HERE
    ).stdout


def revision_compiler(revision: str, folder: str) -> types.ModuleType:
    """That revision's ``distill_kernel_resources`` bound to that revision's kernel (a module in ``folder``)."""
    kernel_path = os.path.join(folder, f"distill_{revision}.py")
    with open(kernel_path, "w") as file:
        file.write(_show(revision, "lightning_flce/kernels/distill.py"))
    source = _show(revision, "benchmarks/experiments/distill_kernel_resources.py")
    source = source.replace("from lightning_flce.kernels.distill import", f"from distill_{revision} import")
    source = source.replace(
        "from lightning_flce.kernels import distill", f"import distill_{revision} as distill"
    )
    sys.path.insert(0, folder)
    module = types.ModuleType(f"resources_{revision}")
    module.__file__ = str(HERE / "distill_kernel_resources.py")  # its sys.path set-up is relative to it
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def opcodes(cubin: bytes) -> collections.Counter:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(cubin)
        sass = subprocess.run([current.TOOLS / "nvdisasm", "-c", path], capture_output=True, text=True).stdout
    return collections.Counter(_OPCODE.findall(sass))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the other revision (a commit with distill_kernel_resources.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        other = revision_compiler(args.revision, folder)
        for variant in VARIANTS:
            before = opcodes(other.compile_variant(**variant))
            after = opcodes(current.compile_variant(**variant))
            differ = {
                op: (before[op], after[op])
                for op in sorted(set(before) | set(after))
                if before[op] != after[op]
            }
            label = " ".join(f"{key}={value}" for key, value in variant.items())
            print(
                f"{label}: {sum(before.values())} -> {sum(after.values())} instructions; differing: {differ}"
            )


if __name__ == "__main__":
    main()
