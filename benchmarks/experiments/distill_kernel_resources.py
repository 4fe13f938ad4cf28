"""Issue 37: what does the distillation kernel cost in registers, and are its loads 16 bytes wide? Answered
without a GPU: Triton compiles the kernel for sm_90 on any machine (its bundled ptxas), and the bundled
``cuobjdump`` / ``nvdisasm`` read the cubin.

Why registers: one program of ``num_warps * 32`` threads per row; at 16 warps, 64 registers a thread or fewer
let two programs share an SM (65536 registers), more leave one, and that halves the loads in flight.

For each variant (divergence, hard-label CE, softcaps, logits dtype, launch) this prints the registers, the
stack frame, and the SASS counts of 16-byte global loads and stores, barriers and special-function (MUFU)
instructions. The rows are specialized as a launch would be on 16-byte aligned rows (a row stride that is a
multiple of 16 bytes: V = 128256).

    python3 benchmarks/experiments/distill_kernel_resources.py
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402

_common.ensure_repo_on_path()
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightning_flce.kernels import distill  # noqa: E402
from lightning_flce.kernels.distill import DIVERGENCES  # noqa: E402

# The kernel's steps: whole rows, and the split launch's three.
STEPS = {
    "whole": distill.WHOLE_ROW,
    "statistics": distill.SLICE_STATISTICS,
    "mixture": distill.SLICE_MIXTURE,
    "finish": distill.SLICE_FINISH,
}

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
VOCAB = 128256
POINTERS = (
    "student_ptr",
    "teacher_ptr",
    "ratio_ptr",
    "grad_ptr",
    "target_ptr",
    "student_inv_t_ptr",
    "teacher_inv_t_ptr",
)
POINTERS += ("ce_inv_t_ptr", "token_scale_ptr", "loss_ptr", "divergence_ptr", "ce_ptr")
POINTERS += ("statistics_ptr", "mixture_ptr", "target_logit_ptr")
ALIGNED = POINTERS + ("student_row_stride", "teacher_row_stride", "grad_row_stride")


def signature(student, teacher, grad):
    types = {"student_ptr": f"*{student}", "teacher_ptr": f"*{teacher}", "grad_ptr": f"*{grad}"}
    types["ratio_ptr"] = "*fp32" if teacher == "fp32" else "*fp16"  # the stored ratio's view of the teacher
    types.update({"target_ptr": "*i64", "loss_ptr": "*fp32", "divergence_ptr": "*fp32", "ce_ptr": "*fp32"})
    types.update({name: "*fp32" for name in POINTERS if name not in types})
    names = distill._distill_kernel.arg_names
    ints = {"student_row_stride", "teacher_row_stride", "grad_row_stride"}
    types["slot_offset"] = "i32"  # (0: not a shard's launch)
    floats = {"beta", "hard_weight", "student_softcap", "teacher_softcap"}
    out = {}
    for name in names:
        if name in types:
            out[name] = types[name]
        elif name in ints:
            out[name] = "i64"
        elif name in floats:
            out[name] = "fp32"
        elif name.endswith("_stride"):
            out[name] = "i32"
        else:
            out[name] = "constexpr"
    return out


def compile_variant(
    divergence,
    has_ce,
    caps=(False, False),
    logits="bf16",
    block_v=8192,
    num_warps=16,
    kernel="whole",
    splits=1,
):
    """The cubin of one specialization as a GPU launch compiles it (FAST_MATH; JSD stores its ratio in the teacher
    row, as the loss lets it); fp32 logits: a bf16 teacher and the bf16 gradient in the rows; a split ``kernel``
    with ``splits`` slices a row."""
    fp32 = logits == "fp32"
    sig = signature("fp32" if fp32 else "bf16", "bf16", "bf16")
    names_known = set(distill._distill_kernel.arg_names)
    constants = {
        "V": VOCAB,
        "DIVERGENCE": DIVERGENCES[divergence],
        "DIVERGENCE_GRAD": divergence is not None,
        "HAS_CE": has_ce,
        "STUDENT_SOFTCAP": caps[0],
        "TEACHER_SOFTCAP": caps[1],
        "COMPUTE_GRAD": True,
        "PRECISE": fp32,
        "PRECISE_GRAD": False,
        "FAST_MATH": True,
        "GRAD_IN_ROW": fp32,
        "RATIO_IN_TEACHER": divergence == "jsd" and distill.JSD_LOG_RATIO_IN_TEACHER,
        "BLOCK_V": block_v,
        "SLICE_V": triton.cdiv(triton.cdiv(VOCAB, splits), block_v) * block_v,
        "SPLITS": splits,
        "SPLITS_POW2": max(2, triton.next_power_of_2(splits)),
        "MERGED": splits,
        "MERGED_POW2": max(2, triton.next_power_of_2(splits)),
        "SHARDED": False,
        "STEP": STEPS[kernel],
    }
    constants = {name: value for name, value in constants.items() if name in names_known}  # older revisions
    names = list(sig)
    source = ASTSource(
        fn=distill._distill_kernel,
        signature=sig,
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm[
        "cubin"
    ]


def resources(cubin: bytes):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(cubin)
        usage = subprocess.run(
            [TOOLS / "cuobjdump", "-res-usage", path], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([TOOLS / "nvdisasm", "-c", path], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    ops = collections.Counter(re.findall(r"\b(LDG\.E\.128|STG\.E\.128|BAR\.SYNC|MUFU)", sass))
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M))
    return [
        instructions,
        found.get("REG"),
        found.get("STACK"),
        ops["LDG.E.128"],
        ops["STG.E.128"],
        ops["BAR.SYNC"],
        ops["MUFU"],
    ]


VARIANTS = [
    {"divergence": "forward_kl", "has_ce": False},
    {"divergence": "reverse_kl", "has_ce": False},
    {"divergence": "jsd", "has_ce": False},
    {"divergence": None, "has_ce": True},
    {"divergence": "forward_kl", "has_ce": True},
    {"divergence": "jsd", "has_ce": True},
    {"divergence": "jsd", "has_ce": False, "caps": (True, True)},
    {"divergence": "forward_kl", "has_ce": False, "logits": "fp32"},
    {"divergence": "jsd", "has_ce": True, "logits": "fp32"},
    {"divergence": "jsd", "has_ce": False, "block_v": 4096, "num_warps": 8},
    {"divergence": "jsd", "has_ce": False, "block_v": 16384, "num_warps": 16},
    # the split launch's three kernels, at the blocks it was written for (4096 x 8)
    *(
        {
            "divergence": divergence,
            "has_ce": has_ce,
            "kernel": kernel,
            "splits": 5,
            "block_v": 4096,
            "num_warps": 8,
        }
        for kernel in ("statistics", "mixture", "finish")
        for divergence, has_ce in (("forward_kl", False), ("jsd", False), ("jsd", True))
        if kernel != "mixture" or divergence == "jsd"
    ),
]


def main():
    rows = []
    for variant in VARIANTS:
        label = " ".join(f"{key}={value}" for key, value in variant.items())
        rows.append([label, *resources(compile_variant(**variant))])
    headers = [
        "variant",
        "instructions",
        "registers",
        "stack",
        "16-byte loads",
        "16-byte stores",
        "barriers",
        "MUFU",
    ]
    print(*_common.text_table(headers, rows), sep="\n")


if __name__ == "__main__":
    main()
