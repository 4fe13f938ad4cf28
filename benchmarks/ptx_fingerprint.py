"""Fingerprints of the Triton kernels' GPU code, made on a machine without a GPU.

A refactor of a kernel that must not change its speed (a shared device function replacing a hand-written copy, a
renamed argument) can be checked without a GPU: if the kernel compiles to the same instructions for the same
specializations, it runs at the same speed. This script

1. runs a set of small calls of the package's ops under Triton's interpreter (CPU) and records every kernel launch:
   the kernel, its arguments' types and its constexpr values (the specialization a GPU run would compile);
2. compiles each recorded specialization for a CUDA target (default sm_90, the H200) with Triton's own compiler,
   which needs no GPU, to PTX (and SASS when ``--sass``, through the ``ptxas``/``cuobjdump`` that ship with Triton);
3. prints one line per specialization: the kernel, a short description of the specialization, and a hash of its
   code with debug information (file names, line numbers) removed.

Run it on two commits and compare (``diff``)::

    python benchmarks/ptx_fingerprint.py > /tmp/after.txt
    git stash; python benchmarks/ptx_fingerprint.py > /tmp/before.txt; git stash pop
    diff /tmp/before.txt /tmp/after.txt

The calls cover the cross-entropy (default options, softcap, label smoothing, z-loss, statistics, the wide-logits
precisions), the vocab-parallel shard kernels through their kernel functions, the log-probability and policy
kernels, and the distillation kernel. ``tests/test_gpu_compile.py`` runs it in CI: the interpreter runs a kernel
that Triton's GPU compiler refuses (a variable whose type changes across loops, say), so the tests alone would
not find it before a GPU run. Differences in argument specialization (Triton's divisibility-by-16 hints) are
recorded as the interpreter saw them, so both sides of a comparison are made alike; the hashes are not those of a
real GPU run's binaries, only comparable with each other.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

_DTYPE_CODES = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float64": "fp64",
    "torch.int64": "i64",
    "torch.int32": "i32",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.bool": "i1",
}


def record_launches(path: str) -> None:
    """Phase 1 (interpreter): run the calls, write each launch's kernel, argument types and constexprs to ``path``."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime import interpreter

    launches: List[Dict[str, Any]] = []
    original_run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        described = {}
        for name, value in bound.items():
            if isinstance(value, torch.Tensor):
                # Triton hints pointers 16-byte aligned; the interpreter's CPU tensors are too
                described[name] = {"type": "*" + _DTYPE_CODES[str(value.dtype)]}
            elif isinstance(value, bool):
                described[name] = {"type": "i1", "value": value}
            elif isinstance(value, int):
                described[name] = {"type": "i32" if -(2**31) <= value < 2**31 else "i64", "value": value}
            elif isinstance(value, float):
                described[name] = {"type": "fp32", "value": value}
            elif value is None:
                described[name] = {"type": "none"}
            else:
                described[name] = {"type": "other", "value": repr(value)}
        launches.append({"module": self.fn.__module__, "name": self.fn.__name__, "args": described})
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    try:
        _run_calls(torch)
    finally:
        interpreter.InterpretedFunction.run = original_run
    with open(path, "w") as f:
        json.dump(launches, f)


def _run_calls(torch) -> None:
    """Small calls of every op whose kernels a refactor may touch (forward and backward)."""
    import lightning_flce as flce

    generator = torch.Generator().manual_seed(0)
    n, hidden, vocab = 12, 16, 300

    def tensors(dtype):
        x = torch.randn(n, hidden, generator=generator).to(dtype).requires_grad_()
        weight = (torch.randn(vocab, hidden, generator=generator) / 4).to(dtype).requires_grad_()
        target = torch.randint(0, vocab, (n,), generator=generator)
        target[3] = -100
        return x, weight, target

    cross_entropy_options = [
        {},
        {"softcap": 20.0},
        {"label_smoothing": 0.1},
        {"lse_square_scale": 1e-4},
        {"reduction": "none"},
        {"reduction": "sum", "softcap": 10.0, "label_smoothing": 0.05},
        {"logits_precision": "fp32"},
        {"logits_precision": "fp32_compensated"},
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for options in cross_entropy_options:
            x, weight, target = tensors(dtype)
            loss = flce.fused_linear_cross_entropy(x, weight, target, impl="triton", **options)
            loss.sum().backward()
        x, weight, target = tensors(dtype)
        output = flce.fused_linear_cross_entropy_with_stats(x, weight, target, impl="triton")
        output.loss.backward()
        for softcap in (None, 15.0):
            x, weight, target = tensors(dtype)
            temperature = torch.rand(n, generator=generator) + 0.5
            result = flce.fused_linear_logprobs(
                x,
                weight,
                target,
                temperature=temperature,
                return_entropy=True,
                softcap=softcap,
                impl="triton",
            )
            (result.logprobs.sum() + result.entropy.sum()).backward()
            x, weight, target = tensors(dtype)
            policy = flce.fused_linear_policy_loss(
                x.view(3, 4, hidden),
                weight,
                target.view(3, 4),
                advantages=torch.randn(3, generator=generator),
                ref_logprobs=torch.full((3, 4), -5.0),
                beta=0.04,
                entropy_coef=0.01,
                softcap=softcap,
                impl="triton",
            )
            policy.loss.backward()
    _run_distillation(torch, flce, tensors, generator, n)
    _run_shard_kernels(torch, generator)


def _run_distillation(torch, flce, tensors, generator, n) -> None:
    """The distillation kernel: each divergence, with and without the hard-label term, softcaps, per-token
    temperatures, and the bf16 gradient in fp32 rows."""
    for dtype in (torch.float32, torch.bfloat16):
        for divergence in ("forward_kl", "reverse_kl", "jsd"):
            for options in (
                {},
                {"hard_weight": 0.3, "temperature": torch.rand(n, generator=generator) + 0.5},
            ):
                x, weight, target = tensors(dtype)
                teacher_x, teacher_weight, _ = tensors(dtype)
                loss = flce.fused_linear_distillation(
                    x, weight, teacher_x.detach(), teacher_weight.detach(), target,
                    divergence=divergence, impl="triton", **options,
                )  # fmt: skip
                loss.backward()
        x, weight, target = tensors(dtype)
        teacher_x, teacher_weight, _ = tensors(dtype)
        loss = flce.fused_linear_distillation(
            x, weight, teacher_x.detach(), teacher_weight.detach(), target,
            student_softcap=20.0, teacher_softcap=15.0, hard_weight=0.5, impl="triton",
            logits_precision="fp32" if dtype == torch.bfloat16 else "input",
        )  # fmt: skip
        loss.backward()
    _run_distillation_split_launch(torch, generator)


def _run_distillation_split_launch(torch, generator) -> None:
    """The distillation kernel's split launch (the op's launch for JSD on a GPU; whole rows for the others):
    each divergence and the CE alone, with and without the gradient, on bf16 rows cut into three slices."""
    from lightning_flce.kernels.distill import DistillLaunchConfig, ShardSlots, distill_chunk, shard_slices

    rows, columns = 4, 300
    per_row = {
        name: torch.rand(rows, generator=generator) + 0.5
        for name in (
            "student_inv_temperature",
            "teacher_inv_temperature",
            "ce_inv_temperature",
            "token_scale",
        )
    }
    for divergence, hard_weight in (
        ("forward_kl", 0.0),
        ("reverse_kl", 0.3),
        ("jsd", 0.0),
        ("jsd", 0.3),
        (None, 1.0),
    ):
        for compute_grad in (True, False):
            student = torch.randn(rows, columns, generator=generator).bfloat16()
            teacher = torch.randn(rows, columns, generator=generator).bfloat16()
            target = torch.randint(0, columns, (rows,), generator=generator)
            distill_chunk(
                student, teacher, target, divergence=divergence, beta=0.5, student_softcap=0.0,
                teacher_softcap=0.0, hard_weight=hard_weight, compute_grad=compute_grad,
                config=DistillLaunchConfig(64, 4, None, 3), **per_row,
            )  # fmt: skip
    # the vocab-parallel op's launch on a shard (SHARDED: its slots after other ranks', local targets that may lie
    # outside the shard); the sum over the ranks is a no-op here
    for divergence, hard_weight in (("jsd", 0.3), ("forward_kl", 0.3), ("reverse_kl", 0.0)):
        student = torch.randn(rows, columns, generator=generator).bfloat16()
        teacher = torch.randn(rows, columns, generator=generator).bfloat16()
        target = torch.randint(-columns, 2 * columns, (rows,), generator=generator)
        distill_chunk(
            student, teacher, target, divergence=divergence, beta=0.5, student_softcap=0.0,
            teacher_softcap=0.0, hard_weight=hard_weight, compute_grad=True,
            shard=ShardSlots(2, 2 + shard_slices(columns) + 1, lambda scratch: None), **per_row,
        )  # fmt: skip


def _run_shard_kernels(torch, generator) -> None:
    """The vocab-parallel shard kernels, called directly (the op needs a process group)."""
    from lightning_flce.kernels import triton_backend

    rows, columns = 6, 300
    for dtype in (torch.float32, torch.bfloat16):
        for softcap in (0.0, 12.0):
            for with_z_sum, with_stats in ((False, False), (True, False), (False, True)):
                logits = torch.randn(rows, columns, generator=generator).to(dtype)
                local_target = torch.randint(-1, columns, (rows,), generator=generator)
                stats = triton_backend.shard_row_stats(
                    logits, local_target, softcap=softcap, with_z_sum=with_z_sum, with_stats=with_stats
                )
                lse = torch.logsumexp(logits.float(), dim=1)
                coef = torch.rand(rows, generator=generator)
                smoothing = coef / columns if with_z_sum else None
                triton_backend.shard_softmax_grad(
                    logits, local_target, lse, coef, smoothing, coef, softcap=softcap
                )
                del stats


def compile_launches(path: str, arch: int, sass: bool, jobs: int = 1) -> None:
    """Phase 2 (no interpreter): compile each distinct recorded specialization and print its fingerprint, in the
    order recorded; ``jobs`` processes compile at once (each specialization is one ptxas run on one core)."""
    with open(path) as f:
        launches = json.load(f)
    specializations: List[tuple] = []
    seen = set()
    for launch in launches:
        kernel = _jit_function(launch["module"], launch["name"])
        signature, constexprs = {}, {}
        for param in kernel.params:
            described = launch["args"].get(param.name)
            if described is None:
                continue  # a default the launch did not pass
            if param.is_constexpr or described["type"] == "none":
                signature[param.name] = "constexpr"
                constexprs[param.name] = described.get("value")
            else:
                signature[param.name] = described["type"]
        # FAST_MATH (inline PTX) is off in the interpreter and on in every GPU run: compile the GPU's. The
        # interpreter has no libdevice, so it runs PRECISE=False; a GPU run of fp32 logits takes the precise
        # exp/log: compile both.
        if constexprs.get("FAST_MATH") is False:
            constexprs = {**constexprs, "FAST_MATH": True}
        variants = [constexprs]
        for flag in ("PRECISE", "PRECISE_GRAD"):
            if constexprs.get(flag) is False:
                variants.append({**constexprs, flag: True})
        for variant in variants:
            key = (
                launch["module"],
                launch["name"],
                json.dumps(signature),
                json.dumps(variant, sort_keys=True),
            )
            if key not in seen:
                seen.add(key)
                specializations.append((launch["module"], launch["name"], signature, variant, arch, sass))
    if jobs <= 1:
        lines = map(_fingerprint, specializations)
    else:  # spawned workers: nothing of this process's state (Triton's caches, threads) is forked
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        lines = pool.map(_fingerprint, specializations)
    for line in lines:
        print(line, flush=True)


def _jit_function(module_name: str, name: str):
    import triton

    kernel = getattr(importlib.import_module(module_name), name)
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn  # Autotuner / Heuristics wrappers
    return kernel


def _fingerprint(specialization: tuple) -> str:
    """One specialization's line: the kernel, a hash of its code, its constexprs and argument types."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module_name, name, signature, constexprs, arch, sass = specialization
    kernel = _jit_function(module_name, name)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    code = _sass(compiled.asm["cubin"]) if sass else _strip_debug(compiled.asm["ptx"])
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    special = ",".join(f"{k}={v}" for k, v in sorted(constexprs.items()))
    types = ",".join(f"{k}:{v}" for k, v in signature.items() if v != "constexpr")
    return f"{name}\t{digest}\t{special}\t{types}"


def _strip_debug(ptx: str) -> str:
    kept = []
    in_debug_section = False
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") and ".debug" in stripped:
            in_debug_section = True
        if in_debug_section:
            if stripped == "}":
                in_debug_section = False
            continue
        # $L__tmp labels mark source lines for the debug information (a label moves with its line, not code)
        if stripped.startswith((".loc", ".file", "//", "$L__tmp")) or not stripped:
            continue
        kept.append(re.sub(r"\s+//.*$", "", line))
    return "\n".join(kept)


def _sass(cubin: bytes) -> str:
    from triton.backends.nvidia import compiler as nvidia

    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return "\n".join(
        re.sub(r"/\*[0-9a-f]{4}\*/", "", line) for line in text.splitlines() if "Function" not in line
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--sass", action="store_true", help="hash the SASS (ptxas) instead of the PTX")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes compiling at once (default: every core)",
    )
    parser.add_argument("--record-only", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record_only:
        record_launches(args.record_only)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        subprocess.run([sys.executable, __file__, "--record-only", path], check=True, env=env)
        os.environ.pop("TRITON_INTERPRET", None)
        compile_launches(path, args.arch, args.sass, args.jobs)


if __name__ == "__main__":
    main()
