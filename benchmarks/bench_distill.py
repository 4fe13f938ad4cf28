"""Logit distillation on a GPU (issue 37): forward + backward of the student's loss (its dX and dW; the teacher
gets no gradient) for four providers in one run, with time, peak memory, errors against float64 and the FLOP
floor at the matmul rate measured in the same run.

    python3 benchmarks/bench_distill.py                                  # 3 shapes x {forward_kl, jsd}
    python3 benchmarks/bench_distill.py --shapes 0 --divergences jsd --providers liger_jsd_loss,flce
    python3 benchmarks/bench_distill.py --quick                          # CPU smoke test of the plumbing

Every provider computes the same loss: the divergence of the student's distribution p = softmax(z_s / T) from
the teacher's q = softmax(z_t / T) (z = x @ W.T), averaged over the tokens whose target is not -100, no hard
(cross-entropy) term, no T^2 factor. "forward_kl" is KL(q || p); "jsd" is beta KL(q || M) + (1 - beta) KL(p || M)
with M = beta q + (1 - beta) p (beta = 0 is "forward_kl"), the convention of TRL, of both Liger calls and of
``lightning_flce.fused_linear_distillation``.

Providers (``PROVIDERS``; benchmarks/README.md says how each is configured): ``unfused`` (both [N, V] logits,
``log_softmax`` in fp32, TRL's ``generalized_jsd_loss`` formula, the teacher under ``no_grad``), Liger-Kernel's
``liger_jsd_loss`` (``chunked_loss.LigerFusedLinearJSDLoss``, compiled on CUDA) and ``liger_fused_linear_jsd``
(``transformers.LigerFusedLinearJSD``, CUDA only), and ``flce`` (``lightning_flce.fused_linear_distillation``,
imported when its row is built: a tree without it reports the row unavailable).

Method, per shape x divergence: the float64 loss, dX and dW at the same shape (all N rows, ``--ref-chunk-mib``
of float64 logits at a time); one fwd+bwd per provider (its compilation; the errors: relative for the loss,
relative L2 for dX and dW); one more for the peak (the increase of ``max_memory_allocated`` over the inputs, the
returned dX and dW included); the four GEMMs of the floor as bf16 ``torch.mm`` at the shape's sizes (median of
10); then ``--warmup`` untimed and ``--repeats`` timed rounds over the providers in a rotating order, CUDA
events, the median. Writes one JSON line per provider x shape x divergence to ``$OUT/distill<TAG>.jsonl``
(``./bench_out`` without $OUT) and a markdown table to ``$OUT/distill<TAG>.md``, printed last.
benchmarks/README.md has the columns and the caveats.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import math
import os
import time
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import _common as C
import torch
import torch.nn.functional as F

C.ensure_repo_on_path()

IGNORE_INDEX = -100
# (N, H_student, H_teacher, V): the issue's Llama-3 (128K), Qwen2 (152K) and Gemma-2 (256K) heads.
SHAPES: List[Tuple[int, int, int, int]] = [
    (8192, 4096, 4096, 128256),
    (8192, 3584, 3584, 151936),
    (8192, 2304, 2304, 256000),
]
QUICK_SHAPE = (64, 48, 40, 1000)  # the student's and the teacher's hidden sizes differ, as they may
DIVERGENCES = ("forward_kl", "jsd")
# Relative error bounds of the gate (bf16 operands and logits): a provider over them is "FAIL" but still timed.
TOLERANCE_LOSS, TOLERANCE_GRAD = 2e-2, 5e-2
# The student's and teacher's confidence in the shared mode of each row (see make_inputs): cross-entropies of
# about 2 and 1 nats, as a student and its larger teacher have on text.
STUDENT_TARGET_LOSS, TEACHER_TARGET_LOSS = 2.0, 1.0

LossFn = Callable[..., torch.Tensor]  # (x_s, W_s, x_t, W_t, target) -> the mean loss


# ----------------------------------------------------------------------------------------------- the loss
def divergence_rows(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float
) -> torch.Tensor:
    """Per-row generalized JSD of two [rows, V] log-distributions, as TRL's ``generalized_jsd_loss`` writes it:
    beta = 0 is KL(teacher || student), beta = 1 is KL(student || teacher), otherwise
    beta KL(teacher || M) + (1 - beta) KL(student || M) with M = beta teacher + (1 - beta) student, M's log
    from a logsumexp of the two weighted log-distributions."""
    if beta == 0.0:
        terms = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1.0:
        terms = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + math.log(1.0 - beta), teacher_log_probs + math.log(beta)]), dim=0
        )
        teacher_kl = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        student_kl = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        terms = beta * teacher_kl + (1.0 - beta) * student_kl
    return terms.sum(-1)


def beta_of(divergence: str, jsd_beta: float) -> float:
    return {"forward_kl": 0.0, "jsd": jsd_beta}[divergence]


# ---------------------------------------------------------------------------------------------- providers
def _build_unfused(device: torch.device, divergence: str, beta: float, temperature: float) -> LossFn:
    def fn(xs, ws, xt, wt, target):
        student_log_probs = F.log_softmax(F.linear(xs, ws).float() / temperature, dim=-1)
        with torch.no_grad():
            teacher_log_probs = F.log_softmax(F.linear(xt, wt).float() / temperature, dim=-1)
        valid = target != IGNORE_INDEX
        rows = divergence_rows(student_log_probs, teacher_log_probs, beta)
        return (rows * valid).sum() / valid.sum().clamp(min=1)

    return fn


def _build_liger_jsd_loss(device: torch.device, divergence: str, beta: float, temperature: float) -> LossFn:
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    # weight_hard_loss=0: no cross-entropy term (0.8.5 then skips its log-softmax); weight_soft_loss=1: the
    # divergence unscaled. Its sum over the chunks is divided by the number of non-ignored targets.
    loss_fn = LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0,
        weight_soft_loss=1.0,
        beta=beta,
        ignore_index=IGNORE_INDEX,
        temperature=temperature,
        compiled=device.type == "cuda",
    )

    def fn(xs, ws, xt, wt, target):
        return loss_fn(xs, ws, xt, wt, target)

    return fn


def _build_liger_fused_linear_jsd(
    device: torch.device, divergence: str, beta: float, temperature: float
) -> LossFn:
    from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

    loss_fn = LigerFusedLinearJSD(jsd_beta=beta, ignore_index=IGNORE_INDEX, temperature=temperature)

    def fn(xs, ws, xt, wt, target):
        return loss_fn(xs, ws, xt, wt, target)

    try:  # 0.8.5 dispatches its per-chunk kernel (Triton, or CuTe DSL where installed): say which one runs
        from liger_kernel.backends.dispatch import resolve_impl

        fn.note = "per-chunk kernel " + resolve_impl("jsd_loss_and_grad", device=device).impl_name
    except Exception as exc:  # noqa: BLE001 - the note only
        fn.note = "per-chunk kernel unknown: " + C.short_error(exc, 200)
    return fn


def _build_flce(
    device: torch.device,
    divergence: str,
    beta: float,
    temperature: float,
    *,
    package: Optional[ModuleType] = None,
    **extra: Any,
) -> LossFn:
    """``fused_linear_distillation`` of this package, or of ``package`` (another commit's copy), with ``extra``."""
    if package is None:
        import lightning_flce as package

    options = dict(divergence=divergence, temperature=temperature, hard_weight=0.0, **extra)
    if divergence == "jsd":  # beta is JSD's alone
        options["beta"] = beta
    loss = package.fused_linear_distillation

    def fn(xs, ws, xt, wt, target):
        return loss(xs, ws, xt, wt, target, **options)

    return fn


def _build_flce_accum_bf16(device: torch.device, divergence: str, beta: float, temperature: float) -> LossFn:
    """The memory-lean choice: dW accumulated in the bf16 weight's dtype (Liger's accumulation), no fp32 [V, H]."""
    return _build_flce(device, divergence, beta, temperature, accum_dtype=torch.bfloat16)


def _build_flce_base(device: torch.device, divergence: str, beta: float, temperature: float) -> LossFn:
    """The default loss of another commit, as package ``lightning_flce_base`` in this process: the copy that
    ``benchmarks/make_baseline.py REV`` writes to ``.baseline/`` (carried to the GPU), so that a change is measured
    against the loss before it in the same run."""
    import make_baseline
    from _providers import DEFAULT_BASELINE_DIR

    package = make_baseline.import_baseline(DEFAULT_BASELINE_DIR)
    fn = _build_flce(device, divergence, beta, temperature, package=package)
    fn.note = make_baseline.describe(DEFAULT_BASELINE_DIR)
    return fn


@contextlib.contextmanager
def _module_setting(module: str, name: str, value: Any) -> Iterator[None]:
    """The library's ``module.name`` set to ``value`` while the block runs (the settings are read while a call runs;
    "mean" computes its gradients in forward)."""
    target_module = importlib.import_module(module)
    default = getattr(target_module, name)
    setattr(target_module, name, value)
    try:
        yield
    finally:
        setattr(target_module, name, default)


def _with_module_setting(module: str, name: str, value) -> Callable[..., LossFn]:
    """A builder of the default loss with the library's ``module.name`` set to ``value`` during each call
    (:func:`_module_setting`): an alternative against the default in the same run."""

    def build(device: torch.device, divergence: str, beta: float, temperature: float) -> LossFn:
        loss_fn = _build_flce(device, divergence, beta, temperature)

        def fn(xs, ws, xt, wt, target):
            with _module_setting(module, name, value):
                return loss_fn(xs, ws, xt, wt, target)

        return fn

    return build


def _teacher_blocks(rows: int) -> Callable[..., LossFn]:
    """The default loss with ``engine.AUXILIARY_BLOCK_ROWS`` = ``rows`` (the chunk rule and the chunk loop read
    it): the teacher's block size against the default's. ``rows`` above any chunk is the rule before teacher
    blocks (both buffers a chunk's rows)."""
    return _with_module_setting("lightning_flce.engine", "AUXILIARY_BLOCK_ROWS", rows)


def _teacher_blocks_same_chunks(rows: int) -> Callable[..., LossFn]:
    """The default loss with the teacher on ``rows``-row blocks and the student's chunks the default's (the chunk
    rule's rows at the default block size, passed as ``chunk_size``): the teacher GEMM's block size alone, where
    :func:`_teacher_blocks` also lets the chunk rule shrink the chunks to pay for the larger block."""

    def build(device: torch.device, divergence: str, beta: float, temperature: float) -> LossFn:
        from lightning_flce import engine

        def fn(xs, ws, xt, wt, target):
            chunk = engine.chunk_rows(
                None,
                xs.shape[0],
                xs.shape[0],
                ws.shape[0],
                ws.shape[1],
                xs.dtype,
                xs.is_cuda,
                auxiliary_dtype=wt.dtype,
            )
            loss_fn = _build_flce(device, divergence, beta, temperature, chunk_size=chunk)
            with _module_setting("lightning_flce.engine", "AUXILIARY_BLOCK_ROWS", rows):
                return loss_fn(xs, ws, xt, wt, target)

        return fn

    return build


@contextlib.contextmanager
def launch_override(max_block_v: int, programs_per_sm: int) -> Iterator[None]:
    """While the block runs: the distillation kernel's blocks capped at ``max_block_v`` columns (the library's
    launch rule otherwise: a warp per 512 columns) and rows split for ``programs_per_sm`` programs an SM for every
    divergence's kernel (the library: JSD's only), 0: whole rows. Here, in ``experiments/profile_distill.py`` and
    in the pytest plugin ``experiments/distill_launch_override.py``."""
    from functools import partial

    from lightning_flce.kernels import distill as distill_kernel

    saved = (
        distill_kernel.default_distill_launch_config,
        distill_kernel.PROGRAMS_PER_SM,
        distill_kernel.SPLIT_DIVERGENCES,
    )
    distill_kernel.default_distill_launch_config = partial(saved[0], max_block_v=max_block_v)
    distill_kernel.PROGRAMS_PER_SM = programs_per_sm
    distill_kernel.SPLIT_DIVERGENCES = frozenset(distill_kernel.DIVERGENCES)
    try:
        yield
    finally:
        (
            distill_kernel.default_distill_launch_config,
            distill_kernel.PROGRAMS_PER_SM,
            distill_kernel.SPLIT_DIVERGENCES,
        ) = saved


def _build_flce_vocab_parallel(
    device: torch.device, divergence: str, beta: float, temperature: float
) -> LossFn:
    """``vocab_parallel_fused_linear_distillation`` in a process group of one (NCCL on CUDA, gloo on the CPU; the
    whole heads are the one shard): the sharded path's own cost on one device (the PyTorch twin per block of rows,
    collectives of one rank) beside the single-device op's Triton kernel."""
    import tempfile

    import torch.distributed as dist

    from lightning_flce.parallel import vocab_parallel_fused_linear_distillation

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = f"file://{tempfile.mkdtemp()}/store"
        dist.init_process_group(backend, init_method=store, rank=0, world_size=1)
    options = dict(divergence=divergence, temperature=temperature, hard_weight=0.0)
    if divergence == "jsd":
        options["beta"] = beta

    def fn(xs, ws, xt, wt, target):
        return vocab_parallel_fused_linear_distillation(xs, ws, xt, wt, target, **options)

    return fn


def _kernel_launch(
    max_block_v: int, block_rows: Optional[int], programs_per_sm: int
) -> Callable[..., LossFn]:
    """A builder of the default loss under :func:`launch_override` and, if given, ``engine.AUXILIARY_BLOCK_ROWS`` set
    to ``block_rows``, during each call: launch configurations inside the op, against the default, in one run
    (``experiments/bench_distill_kernel.py`` times the kernel alone on whole chunks)."""

    def build(device: torch.device, divergence: str, beta: float, temperature: float) -> LossFn:
        from lightning_flce import engine

        loss_fn = _build_flce(device, divergence, beta, temperature)
        blocks = functools.partial(
            _module_setting,
            "lightning_flce.engine",
            "AUXILIARY_BLOCK_ROWS",
            block_rows or engine.AUXILIARY_BLOCK_ROWS,
        )

        def fn(xs, ws, xt, wt, target):
            with blocks(), launch_override(max_block_v, programs_per_sm):
                return loss_fn(xs, ws, xt, wt, target)

        return fn

    return build


def _launch_provider(block: int, programs_per_sm: int, rows: Optional[int]) -> Tuple[str, str]:
    """(name, call) of a launch provider: ``block`` columns (a warp per 512, the library's rule), whole rows
    (``programs_per_sm`` 0) or split for that many programs an SM, the teacher's block rows if given."""
    warps = max(4, min(16, block // 512))
    name = f"flce_launch_{block}x{warps}"
    call = f"flce with the distillation kernel launched as {block}x{warps} (block columns x warps)"
    if programs_per_sm == 0:
        name, call = name + "_whole_rows", call + ", one program per row (whole rows)"
    else:
        name += f"_split_{programs_per_sm}"
        call += f", rows split for {programs_per_sm} programs an SM"
    if rows:
        name, call = name + f"_block_{rows}", call + f", AUXILIARY_BLOCK_ROWS = {rows}"
    return name, call


# name -> (call, builder, needs CUDA)
PROVIDERS: Dict[str, Tuple[str, Callable[..., LossFn], bool]] = {
    "unfused": (
        "both [N, V] logits, log_softmax in fp32, TRL's generalized_jsd_loss formula; teacher under no_grad",
        _build_unfused,
        False,
    ),
    "liger_jsd_loss": (
        "liger_kernel.chunked_loss.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta, "
        "temperature, compiled=on CUDA, chunk_size=1024)",
        _build_liger_jsd_loss,
        False,
    ),
    "liger_fused_linear_jsd": (
        "liger_kernel.transformers.fused_linear_jsd.LigerFusedLinearJSD(jsd_beta=beta, temperature) "
        "(ops.fused_linear_jsd, accum_dtype=None)",
        _build_liger_fused_linear_jsd,
        True,
    ),
    "flce": (
        "lightning_flce.fused_linear_distillation(divergence, beta, temperature, hard_weight=0.0)",
        _build_flce,
        False,
    ),
    "flce_accum_bf16": (
        "lightning_flce.fused_linear_distillation(divergence, beta, temperature, hard_weight=0.0, "
        "accum_dtype=torch.bfloat16)",
        _build_flce_accum_bf16,
        False,
    ),
    "flce_vocab_parallel_1": (
        "lightning_flce.parallel.vocab_parallel_fused_linear_distillation(divergence, beta, temperature, "
        "hard_weight=0.0) in a process group of one (the whole heads as the one shard)",
        _build_flce_vocab_parallel,
        False,
    ),
    "flce_base": (
        "lightning_flce_base.fused_linear_distillation(divergence, beta, temperature, hard_weight=0.0): the default of"
        " the commit in .baseline/ (benchmarks/make_baseline.py REV)",
        _build_flce_base,
        False,
    ),
    # the teacher's block size (engine.AUXILIARY_BLOCK_ROWS, 256 by default), measured beside the default
    "flce_teacher_block_512": (
        "flce with engine.AUXILIARY_BLOCK_ROWS = 512 (the teacher's GEMM and the row kernel on 512-row blocks)",
        _teacher_blocks(512),
        False,
    ),
    **{
        f"flce_teacher_block_{rows}_same_chunks": (
            f"flce with engine.AUXILIARY_BLOCK_ROWS = {rows} and chunk_size = the default's chunk rows (the teacher "
            "GEMM's block size alone)",
            _teacher_blocks_same_chunks(rows),
            False,
        )
        for rows in (512, 1024)
    },
    "flce_teacher_unblocked": (
        "flce with the teacher's buffer a whole chunk (AUXILIARY_BLOCK_ROWS above any chunk: the chunk rule then "
        "gives the two buffers the floor together, about half the default's rows)",
        _teacher_blocks(1 << 30),
        False,
    ),
    # rows per chunk (the default: the chunk rule's, 4096 / 2752 / 2048 rows at the issue's shapes). Each chunk
    # reads and writes the whole fp32 dW accumulator (8 V H bytes); fewer, larger chunks trade that traffic for a
    # larger logits buffer (2 V bytes a row) in the peak.
    **{
        f"flce_chunk_rows_{rows}": (
            f"flce with chunk_size={rows}",
            functools.partial(_build_flce, chunk_size=rows),
            False,
        )
        for rows in (2048, 4096, 8192)
    },
    "flce_jsd_recompute_ratio": (
        "flce with kernels.distill.JSD_LOG_RATIO_IN_TEACHER = False (JSD's gradient pass reads both rows again)",
        # JSD's gradient pass recomputing log p - log M from both rows, against reading it where pass 2 stored it
        _with_module_setting("lightning_flce.kernels.distill", "JSD_LOG_RATIO_IN_TEACHER", False),
        True,
    ),
    # the distillation kernel's launch inside the op (block columns x warps; rows split for programs an SM, 0:
    # whole rows; the teacher's block rows). The default: JSD split at 4096 x 8 for 8 programs an SM, the other
    # divergences whole rows at 8192 x 16.
    **{
        name: (call, _kernel_launch(block, rows, programs), True)
        for block, programs, rows in (
            (8192, 0, None),  # whole rows for every divergence: the default before JSD's split launch
            (4096, 0, None),
            (2048, 0, None),
            (4096, 8, None),
            (2048, 8, None),
            (8192, 8, None),
            (4096, 4, None),
            (4096, 16, None),
            (4096, 8, 512),
            # with slices the kernel needs no more rows, so the teacher's GEMM may have them
            (4096, 8, 1024),
            (4096, 0, 512),
            (2048, 0, 512),
        )
        for name, call in [_launch_provider(block, programs, rows)]
    },
}
# Providers that run only when named in --providers: flce_base needs the copy benchmarks/make_baseline.py writes.
NAMED_ONLY = ("flce_base", "flce_vocab_parallel_1")
LIGER_BASELINE = "liger_jsd_loss"  # the issue's goal: >= 1.5x its speed, at a peak no higher
# "Within the unfused loss's errors": two results of the same precision differ in their rounding, so an error
# ratio a few percent over 1 is a tie, not a miss.
ERROR_RATIO_SLACK = 1.05


def build_providers(
    names: Sequence[str], device: torch.device, divergence: str, beta: float, temperature: float
) -> Dict[str, Tuple[Optional[LossFn], Optional[str]]]:
    """name -> (callable, None) or (None, why it does not run)."""
    built: Dict[str, Tuple[Optional[LossFn], Optional[str]]] = {}
    for name in names:
        _, build, needs_cuda = PROVIDERS[name]
        if needs_cuda and device.type != "cuda":
            built[name] = (None, "skipped: needs CUDA (a Triton kernel)")
            continue
        try:
            built[name] = (build(device, divergence, beta, temperature), None)
        except Exception as exc:  # noqa: BLE001 - a missing library or name disables only its row
            built[name] = (None, "unavailable: " + C.short_error(exc))
    return built


# ---------------------------------------------------------------------------------------------- the data
def make_inputs(shape: Tuple[int, int, int, int], device: torch.device, seed: int, ignore_fraction: float):
    """bf16 student (x_s, W_s; both require grad) and teacher (x_t, W_t) hidden states and heads, and targets.

    Each head is W ~ N(0, 1/H), so its logits of noise ~ N(0, I) hidden states are ~N(0, 1). Each row has a
    mode, the same token m for both models: x = noise + a W[m] / ||W[m]|| puts its logit a above the others,
    with a chosen so the model's cross-entropy on m is about STUDENT_TARGET_LOSS (TEACHER_TARGET_LOSS): two
    peaked distributions that agree on the mode and differ elsewhere, as a student's and its teacher's do. The
    targets are the modes, ``ignore_fraction`` of them set to -100.
    """
    n, h_student, h_teacher, v = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    mode = torch.randint(0, v, (n,), device=device, generator=gen)

    def side(hidden: int, target_loss: float):
        w = torch.randn(v, hidden, device=device, generator=gen) / hidden**0.5
        # A logit a above V - 1 others ~N(0, 1) (E exp = e^0.5): loss = log(1 + (V - 1) e^(0.5 - a)).
        lift = math.log(v - 1) + 0.5 - math.log(math.expm1(target_loss))
        direction = w[mode] / w[mode].norm(dim=1, keepdim=True)
        x = torch.randn(n, hidden, device=device, generator=gen) + lift * direction
        return x.bfloat16(), w.bfloat16()

    xs, ws = side(h_student, STUDENT_TARGET_LOSS)
    xt, wt = side(h_teacher, TEACHER_TARGET_LOSS)
    target = mode.clone()
    if ignore_fraction > 0:
        target[torch.rand(n, device=device, generator=gen) < ignore_fraction] = IGNORE_INDEX
    return xs.requires_grad_(), ws.requires_grad_(), xt, wt, target


def reference(xs, ws, xt, wt, target, beta: float, temperature: float, rows: int):
    """float64 mean loss, dX and dW of the student, ``rows`` tokens at a time (autograd on each chunk's
    float64 logits, so the reference's gradient is derived from the formula, not written by hand)."""
    n, v = xs.shape[0], ws.shape[0]
    ws64, wt64 = ws.detach().double(), wt.detach().double()
    valid = target != IGNORE_INDEX
    n_valid = max(int(valid.sum()), 1)
    dx = torch.empty(xs.shape, dtype=torch.float64, device=xs.device)
    dw = torch.zeros(v, xs.shape[1], dtype=torch.float64, device=xs.device)
    loss = 0.0
    for start in range(0, n, rows):
        chunk = slice(start, start + rows)
        xs64 = xs.detach()[chunk].double()
        with torch.no_grad():
            teacher_log_probs = F.log_softmax((xt[chunk].double() @ wt64.t()) / temperature, dim=-1)
        student_logits = (xs64 @ ws64.t()).requires_grad_()
        with torch.enable_grad():
            student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
            rows_loss = divergence_rows(student_log_probs, teacher_log_probs, beta)
            chunk_loss = (rows_loss * valid[chunk]).sum() / n_valid
            (grad,) = torch.autograd.grad(chunk_loss, student_logits)
        loss += float(chunk_loss.detach())
        dx[chunk] = grad @ ws64
        dw.addmm_(grad.t(), xs64)
        del xs64, teacher_log_probs, student_logits, student_log_probs, rows_loss, chunk_loss, grad
    return loss, dx, dw


def reference_rows(v: int, budget_mib: int) -> int:
    """Rows per reference chunk so that one float64 [rows, V] block stays within the budget (the chunk holds
    about eight: logits, log-probabilities, the mixture's stack and the gradient)."""
    rows = max(16, budget_mib * C.MIB // (8 * v))
    return 1 << (rows.bit_length() - 1)


# ------------------------------------------------------------------------------------------- the floor
def floor_flops(shape: Tuple[int, int, int, int]) -> float:
    """The two logits GEMMs, the student's dX and dW: 2 N V (3 H_student + H_teacher)."""
    n, h_student, h_teacher, v = shape
    return 2.0 * n * v * (3 * h_student + h_teacher)


def gemm_floor(xs, ws, xt, wt, device: torch.device, reps: int = 10, warmup: int = 3) -> Dict[str, Any]:
    """Median ms of each GEMM of the floor as one bf16 ``torch.mm`` at its full size and layout (x @ W.T for
    both logits, g @ W_s for dX, g.T @ x_s for dW, g a random [N, V] operand); the floor is their sum."""
    xs, ws = xs.detach(), ws.detach()
    n, v = xs.shape[0], ws.shape[0]
    gen = torch.Generator(device=device).manual_seed(4321)
    grad = torch.randn(n, v, device=device, generator=gen).to(xs.dtype)
    logits, dx, dw = (
        torch.empty(n, v, device=device, dtype=xs.dtype),
        torch.empty_like(xs),
        torch.empty_like(ws),
    )
    gemms = {
        "student_logits": (lambda: torch.mm(xs, ws.t(), out=logits), 2.0 * n * v * xs.shape[1]),
        "teacher_logits": (lambda: torch.mm(xt, wt.t(), out=logits), 2.0 * n * v * xt.shape[1]),
        "dx": (lambda: torch.mm(grad, ws, out=dx), 2.0 * n * v * xs.shape[1]),
        "dw": (lambda: torch.mm(grad.t(), xs, out=dw), 2.0 * n * v * xs.shape[1]),
    }
    out: Dict[str, Any] = {"gemm_ms": {}, "gemm_tflops": {}}
    for name, (call, flops) in gemms.items():
        for _ in range(warmup):
            call()
        timers = []
        for _ in range(reps):
            timer = C.Timer(device)
            timer.start()
            call()
            timer.stop()
            timers.append(timer)
        C.synchronize(device)
        ms = C.percentile([t.ms() for t in timers], 50)
        out["gemm_ms"][name] = ms
        out["gemm_tflops"][name] = flops / (ms * 1e-3) / 1e12
    out["floor_ms"] = sum(out["gemm_ms"].values())
    return out


# ------------------------------------------------------------------------------------------- one config
def _release(device: torch.device) -> None:
    """Hand the freed blocks back between phases on a GPU (a garbage collection costs ~0.2 s: not on the CPU,
    where there is no allocator cache and no peak to measure)."""
    if device.type == "cuda":
        C.free_memory(device)


def _clear_grads(*leaves: torch.Tensor) -> None:
    for leaf in leaves:
        leaf.grad = None


def _error_text(exc: BaseException) -> str:
    return ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc)


def run_config(
    shape: Tuple[int, int, int, int],
    divergence: str,
    names: Sequence[str],
    args: argparse.Namespace,
    device: torch.device,
) -> List[Dict[str, Any]]:
    n, h_student, h_teacher, v = shape
    beta = beta_of(divergence, args.jsd_beta)
    config = {
        "shape": f"{n}x{h_student}x{h_teacher}x{v}",
        "N": n,
        "H_student": h_student,
        "H_teacher": h_teacher,
        "V": v,
        "dtype": "bf16",
        "divergence": divergence,
        "beta": beta,
        "temperature": args.temperature,
        "hard_weight": 0.0,
        "reduction": "mean over non-ignored targets",
        "ignore_fraction": args.ignore_fraction,
        "floor_tflop": floor_flops(shape) / 1e12,
    }
    built = build_providers(names, device, divergence, beta, args.temperature)
    records = {
        name: {
            "provider": name,
            "call": PROVIDERS[name][0],
            **config,
            "status": error.split(":")[0] if error else None,
            "error": error,
        }
        for name, (_, error) in built.items()
    }
    runnable = {name: fn for name, (fn, _) in built.items() if fn is not None}
    for name, fn in runnable.items():
        records[name]["note"] = getattr(fn, "note", None)

    xs, ws, xt, wt, target = make_inputs(shape, device, args.seed, args.ignore_fraction)
    ref_loss, ref_dx, ref_dw = reference(
        xs, ws, xt, wt, target, beta, args.temperature, reference_rows(v, args.ref_chunk_mib)
    )
    for record in records.values():
        record["ref_loss"] = ref_loss

    def call(fn: LossFn) -> torch.Tensor:
        loss = fn(xs, ws, xt, wt, target)
        loss.backward()
        return loss.detach()

    # 1. correctness: the first call of each provider (its compilation, timed apart).
    for name, fn in list(runnable.items()):
        record = records[name]
        try:
            _clear_grads(xs, ws)
            started = time.perf_counter()
            loss = float(call(fn).float())
            C.synchronize(device)
            record["first_call_s"] = time.perf_counter() - started
            if xs.grad is None or ws.grad is None:
                raise RuntimeError("backward produced no dX or no dW")
            record["loss"] = loss
            record["loss_rel_err"] = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
            record["dx_rel_err"] = C.rel_l2(xs.grad, ref_dx)
            record["dw_rel_err"] = C.rel_l2(ws.grad, ref_dw)
            record["dw_dtype"] = C.DTYPE_NAMES.get(ws.grad.dtype, str(ws.grad.dtype))
            errors = [record["loss_rel_err"], record["dx_rel_err"], record["dw_rel_err"]]
            if not all(math.isfinite(e) for e in errors):
                raise FloatingPointError("non-finite loss or gradient")
            within = errors[0] <= TOLERANCE_LOSS and max(errors[1:]) <= TOLERANCE_GRAD
            record["status"] = "ok" if within else "FAIL"
        except Exception as exc:  # noqa: BLE001 - an OOM or a provider's bug: recorded, the run goes on
            record["status"], record["error"] = "error", _error_text(exc)
            del runnable[name]
        finally:
            _clear_grads(xs, ws)
            _release(device)
    del ref_dx, ref_dw
    _release(device)

    # 2. peak memory, one provider at a time, over the inputs (x_s, W_s, x_t, W_t, targets).
    for name, fn in list(runnable.items()):
        try:
            _clear_grads(xs, ws)
            records[name]["peak_mib"] = C.measure_peak_mib(lambda fn=fn: call(fn), device)
        except Exception as exc:  # noqa: BLE001
            records[name]["status"], records[name]["error"] = "error", _error_text(exc)
            del runnable[name]
        finally:
            _clear_grads(xs, ws)
            _release(device)

    # 3. the floor's GEMMs at this shape, then the providers, round-robin with a rotating first.
    floor = gemm_floor(xs, ws, xt, wt, device)
    _release(device)
    order = list(runnable)
    timers: Dict[str, List[C.Timer]] = {name: [] for name in order}
    for round_index in range(args.warmup + args.repeats):
        k = round_index % max(1, len(order))
        for name in order[k:] + order[:k]:
            if name not in runnable:
                continue
            _clear_grads(xs, ws)
            timer = C.Timer(device)
            try:
                timer.start()
                call(runnable[name])
                timer.stop()
            except Exception as exc:  # noqa: BLE001
                records[name]["status"], records[name]["error"] = "error", _error_text(exc)
                del runnable[name]
                _release(device)
                continue
            if round_index >= args.warmup:
                timers[name].append(timer)
    _clear_grads(xs, ws)
    C.synchronize(device)
    for name in runnable:
        times = [t.ms() for t in timers[name]]
        records[name].update(
            ms=C.percentile(times, 50),
            p20_ms=C.percentile(times, 20),
            p80_ms=C.percentile(times, 80),
            samples=len(times),
        )
    for record in records.values():
        record.update(gemm_ms=floor["gemm_ms"], gemm_tflops=floor["gemm_tflops"], floor_ms=floor["floor_ms"])
        record["matmul_tflops"] = config["floor_tflop"] / floor["floor_ms"] * 1e3
        if record.get("ms"):
            record["pct_floor"] = 100.0 * floor["floor_ms"] / record["ms"]
            for baseline in ("liger_jsd_loss", "liger_fused_linear_jsd"):
                if records.get(baseline, {}).get("ms"):
                    record[f"speedup_vs_{baseline}"] = records[baseline]["ms"] / record["ms"]
    return list(records.values())


def config_failed_records(
    shape, divergence: str, names: Sequence[str], args, status: str, reason: str
) -> List[Dict[str, Any]]:
    """The lines of a config that did not run (skipped for time, or its data, reference or floor failed)."""
    n, h_student, h_teacher, v = shape
    return [
        {
            "provider": name,
            "shape": f"{n}x{h_student}x{h_teacher}x{v}",
            "divergence": divergence,
            "beta": beta_of(divergence, args.jsd_beta),
            "status": status,
            "error": reason,
        }
        for name in names
    ]


# ---------------------------------------------------------------------------------------------- output
def table_lines(records: List[Dict[str, Any]]) -> List[str]:
    headers = ["shape", "div", "provider", "ms", "p20-p80", "% floor", "x liger", "peak MiB", "ref loss",
               "loss err", "dX err", "dW err", "dW", "status"]  # fmt: skip
    rows = []
    for r in records:
        spread = f"{C.fmt(r.get('p20_ms'), '.1f')}-{C.fmt(r.get('p80_ms'), '.1f')}" if r.get("ms") else "-"
        status = r.get("status") or "-"
        if r.get("error"):  # "unavailable: ...", "skipped: ...", or "error" with the exception's text
            status = r["error"][:80] if r["error"].startswith(status) else f"{status}: {r['error'][:70]}"
        rows.append(
            [
                r["shape"],
                r["divergence"],
                r["provider"],
                C.fmt(r.get("ms"), ".1f"),
                spread,
                C.fmt(r.get("pct_floor"), ".0f"),
                C.fmt(r.get(f"speedup_vs_{LIGER_BASELINE}"), ".2f"),
                C.fmt(r.get("peak_mib"), ",.0f"),
                C.fmt(r.get("ref_loss"), ".4f"),
                C.fmt(r.get("loss_rel_err"), ".1e"),
                C.fmt(r.get("dx_rel_err"), ".1e"),
                C.fmt(r.get("dw_rel_err"), ".1e"),
                r.get("dw_dtype") or "-",
                status,
            ]
        )
    return C.md_table(headers, rows)


def goal_lines(records: List[Dict[str, Any]]) -> List[str]:
    """The issue's goals for the flce rows (the default and ``flce_accum_bf16``): >= 1.5x Liger's fused JSD at a
    peak no higher, >= 80% of the FLOP floor, the loss and gradient errors within the unfused bf16 loss's."""
    by = {(r["shape"], r["divergence"], r["provider"]): r for r in records}
    lines = []
    for (shape, divergence, provider), r in by.items():
        if not provider.startswith("flce") or not r.get("ms"):
            continue
        liger, unfused = (
            by.get((shape, divergence, LIGER_BASELINE), {}),
            by.get((shape, divergence, "unfused"), {}),
        )
        checks = [
            f"{C.fmt(r.get('pct_floor'), '.0f')}% floor (>= 80: {'yes' if r['pct_floor'] >= 80 else 'NO'})"
        ]
        if liger.get("ms"):
            speedup = r[f"speedup_vs_{LIGER_BASELINE}"]
            checks.append(f"{speedup:.2f}x liger (>= 1.5: {'yes' if speedup >= 1.5 else 'NO'})")
        if liger.get("peak_mib") is not None and r.get("peak_mib") is not None:
            lower = r["peak_mib"] <= liger["peak_mib"]
            checks.append(
                f"peak {r['peak_mib']:,.0f} vs {liger['peak_mib']:,.0f} MiB ({'yes' if lower else 'NO'})"
            )
        if unfused.get("loss_rel_err") is not None:
            ratios = [r[k] / max(unfused[k], 1e-300) for k in ("loss_rel_err", "dx_rel_err", "dw_rel_err")]
            within = all(q <= ERROR_RATIO_SLACK for q in ratios)
            checks.append(
                "errors / unfused's (loss, dX, dW) "
                + ", ".join(f"{q:.3f}" for q in ratios)
                + f" (<= {ERROR_RATIO_SLACK}: {'yes' if within else 'NO'})"
            )
        lines.append(f"- {shape} {divergence} {provider}: " + "; ".join(checks))
    return ["goals (flce):"] + (lines or ["- no timed flce row"])


# ------------------------------------------------------------------------------------------------- main
def parse_shapes(text: str) -> List[Tuple[int, int, int, int]]:
    """Comma-separated indices into SHAPES or N x H_student x H_teacher x V."""
    shapes = []
    for item in text.split(","):
        item = item.strip()
        if item.isdigit():
            shapes.append(SHAPES[int(item)])
        else:
            parts = tuple(int(p) for p in item.split("x"))
            if len(parts) != 4:
                raise argparse.ArgumentTypeError(f"a shape is an index or NxH_sxH_txV, got {item!r}")
            shapes.append(parts)
    return shapes


def parse_names(text: str, allowed: Sequence[str], what: str) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {list(allowed)}")
    return names


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default="0,1,2", help="indices into SHAPES (0,1,2) or NxH_sxH_txV, comma-separated"
    )
    parser.add_argument("--divergences", default=",".join(DIVERGENCES))
    parser.add_argument(
        "--providers",
        default=",".join(name for name in PROVIDERS if name not in NAMED_ONLY),
        help=f"comma-separated; {', '.join(NAMED_ONLY)} only when named (flce_base needs .baseline/)",
    )
    parser.add_argument(
        "--repeats", type=int, default=10, help="timed rounds (one call of each provider each)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds before them (after the first call and the peak call)",
    )
    parser.add_argument("--jsd-beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--ignore-fraction",
        type=float,
        default=0.0,
        help="targets set to -100 (default none: the floor counts all N rows, and a loss that drops ignored "
        "rows before its GEMMs would do less work than the floor and than Liger)",
    )
    parser.add_argument(
        "--ref-chunk-mib", type=int, default=1024, help="float64 [rows, V] block of the reference"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budget-s", type=float, default=None, help="skip a config predicted to end past this"
    )
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--quick", action="store_true", help=f"shape {QUICK_SHAPE}, 2 repeats: a smoke test")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = [QUICK_SHAPE] if args.quick else parse_shapes(args.shapes)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    divergences = parse_names(args.divergences, DIVERGENCES, "divergence")
    names = parse_names(args.providers, list(PROVIDERS), "provider")
    if not 0.0 < args.jsd_beta < 1.0:
        parser.error("--jsd-beta must be in (0, 1) (0 is forward_kl)")

    env = C.environment(device)
    env["lightning_flce_file"] = _module_file("lightning_flce")
    # The device's copy of .git can lag behind the tree that was sent: the caller may state the commit it sent.
    env["commit_stated"] = os.environ.get("FLCE_COMMIT")
    print("\n".join(C.header_lines(env)), flush=True)
    out = C.out_dir()
    jsonl_path, md_path = out / f"distill{args.tag}.jsonl", out / f"distill{args.tag}.md"
    jsonl_path.write_text("")
    started = time.perf_counter()
    records: List[Dict[str, Any]] = []
    last: Optional[Tuple[float, float]] = None  # (seconds, FLOP floor) of the last config that ran
    for shape in shapes:
        for divergence in divergences:
            elapsed = time.perf_counter() - started
            predicted = 0.0 if last is None else last[0] * floor_flops(shape) / last[1]
            if args.budget_s is not None and last is not None and elapsed + predicted > args.budget_s:
                new = config_failed_records(shape, divergence, names, args, "skipped", "skipped: time budget")
            else:
                config_started = time.perf_counter()
                if device.type == "cuda":
                    # Liger's compiled chunk function: a fresh static graph per config, as one shape and
                    # divergence compile in training (dynamo would otherwise recompile later shapes dynamic).
                    torch._dynamo.reset()
                try:
                    new = run_config(shape, divergence, names, args, device)
                    last = (time.perf_counter() - config_started, floor_flops(shape))
                except Exception as exc:  # noqa: BLE001 - the inputs, the reference or the floor: the run goes on
                    new = config_failed_records(shape, divergence, names, args, "error", _error_text(exc))
                _release(device)  # the config's inputs went with its frame
            with jsonl_path.open("a") as handle:
                for record in new:
                    handle.write(json.dumps({**record, "env": env}, default=str) + "\n")
            records += new
            print("\n".join(table_lines(new)), flush=True)
            md_path.write_text("\n".join(report_lines(records, env, args)) + "\n")  # a cut run keeps it
    print("\n" + "\n".join(report_lines(records, env, args, header=False)))
    return records


def report_lines(
    records: List[Dict[str, Any]], env: Dict[str, Any], args: argparse.Namespace, header: bool = True
) -> List[str]:
    """distill.md: the run's environment and settings, the table, the providers' notes and the goals."""
    settings = [
        f"- lightning_flce imported from {env['lightning_flce_file']}; commit stated by the caller (FLCE_COMMIT): "
        f"{env.get('commit_stated') or '-'}",
        f"- loss: the divergence of the student from the teacher at temperature {args.temperature}, the mean over "
        f"non-ignored targets ({args.ignore_fraction:.0%} ignored), no hard loss, no T^2; jsd: beta "
        f"{args.jsd_beta}, M = beta teacher + (1 - beta) student; bf16 inputs",
        f"- {args.repeats} timed rounds after {args.warmup} untimed (and the first and the peak calls); floor: the "
        "four GEMMs of 2 N V (3 H_s + H_t), each a bf16 torch.mm at the shape, measured in this run",
    ]
    notes = sorted({f"- {r['provider']}: {r['note']}" for r in records if r.get("note")})
    lines = ["# Distillation, forward + backward of the student (issue 37)", ""] if header else []
    lines += [*(C.header_lines(env) if header else []), *settings, *notes, ""]
    return lines + [*table_lines(records), "", *goal_lines(records)]


def _module_file(name: str) -> Optional[str]:
    """Where ``import name`` would load from (without importing it)."""
    spec = importlib.util.find_spec(name)
    return spec.origin if spec is not None else None


if __name__ == "__main__":
    main()
