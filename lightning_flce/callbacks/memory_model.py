"""What the LM head costs in memory, and where a training step's peak goes: plain arithmetic, no Trainer.

:class:`HeadMemoryModel` estimates what the unfused head (``F.linear``, the upcast to the softmax dtype and
``F.cross_entropy``, as ``FLCEHeadLoss(naive=True)`` runs it) adds to the peak of a training step, what the
fused head's own buffers take at its peak, and so what the fused head saves. :class:`MemoryBreakdown` splits
a measured CUDA peak into parameters, gradients, optimizer state and the rest.

Why the unfused head costs three ``[N, V]`` tensors in the softmax dtype (fp32; fp64 for fp64 logits), in
every precision: the logits in the compute dtype (bf16 under ``bf16-mixed``) live only until their upcast,
which is the tensor everything after reads. The forward's high point is ``logsumexp`` (the loss's LSE): the
upcast logits, the ``log_softmax`` output that backward keeps and ``logsumexp``'s ``exp`` temporary. The
backward's is ``log_softmax``'s backward: the kept output, its incoming gradient and the logits gradient;
the cast of that gradient back to bf16 (6 bytes a logit) comes after them. So 12 bytes a logit for
``16-mixed``, ``bf16-mixed``, ``bf16-true`` and ``32-true``, 24 for ``64-true``; a softcap keeps its
``tanh`` output for backward (one tensor more), a z-loss the upcast logits and the LSE's gradient (two
more). Hugging Face's own loss (``logits.float()`` then ``F.cross_entropy``) has no ``logsumexp`` but the
same backward, so the same count, plus the bf16 logits while the model's output still holds them (not
measured here). This package's unfused head is measured on CPU by ``tests/test_memory_model.py`` and,
against real runs on the GPU, by ``tests/test_memory_callback_cuda.py`` and
``benchmarks/memory_naive_vs_fused.py``.

The fused head holds, at its peak (the forward, where it computes the gradients): one chunk of logits,
``chunk_rows x V`` in the compute dtype (with its upcast and softmax on the PyTorch path), the hidden
states' gradient ``N x H`` and the weight gradient's accumulator ``V x H`` (fp32 under autocast; fp64 for
fp32 GEMMs on GPUs with full-rate fp64, whose dX GEMM then also reads an fp64 copy of the weight). The
chunk's rows are the op's own (``engine.chunk_rows``). With ``logits_precision`` "fp32" / "fp32_compensated"
the chunk's logits are fp32 (their gradient, in the compute dtype, written into the same rows), plus the weight
copy a fallback GEMM makes (fp32, or fp64 with an fp64 chunk product); "fp32_compensated"'s Triton GEMM without
label smoothing keeps the 16-bit buffer and adds its LSE partials (``engine.RELATIVE_16BIT_LOGITS``); "fp32_head"
runs the fp32 path.

Distillation (:class:`~lightning_flce.models.DistillationModule`) has a second head, the teacher's, run
without gradient: the unfused formula holds its ``[N, V]`` logits in their compute dtype and their
log-softmax in the softmax dtype while the divergence reads them (:func:`teacher_logits_bytes`, added by
:meth:`HeadMemoryEstimate.with_teacher`); the fused loss holds one more chunk of logits for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Optional

import torch

from lightning_flce import engine
from lightning_flce.engine import WideLogitsGemm, chunk_rows, saved_grad_weight_dtype
from lightning_flce.kernels import BACKENDS, LOW_PRECISION, backend_for, softmax_dtype
from lightning_flce.options import WIDE_LOGITS_PRECISIONS, AccumDtype, FLCEOptions, resolve_logits_precision

_MIB = 2**20
# autocast's dtype for each mixed precision; the other precisions run the head in the weight's dtype
_AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
# [N, V] softmax-dtype tensors alive at the unfused head's peak (see the module docstring)
_UNFUSED_COPIES = 3
_UNFUSED_COPIES_SOFTCAP = 1
_UNFUSED_COPIES_Z_LOSS = 2


# the weights' dtype of the "-true" precisions, for a module whose head weight is not found
_TRUE_DTYPES = {
    "64-true": torch.float64,
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}


def teacher_logits_bytes(num_tokens: int, vocab_size: int, compute_dtype: torch.dtype) -> int:
    """What the teacher's head adds to the peak of an unfused distillation step: its ``[N, V]`` logits in the
    compute dtype and their log-softmax in the softmax dtype (fp32; fp64 for fp64 logits), both alive while the
    divergence reads them (no gradient: nothing is kept for backward). 8 bytes a logit in fp32, 6 in bf16."""
    return num_tokens * vocab_size * (compute_dtype.itemsize + softmax_dtype(compute_dtype).itemsize)


def precision_weight_dtype(precision: Optional[str]) -> torch.dtype:
    """The weights' dtype a Lightning ``precision`` implies: its own for ``-true``, fp32 otherwise."""
    return _TRUE_DTYPES.get(str(precision), torch.float32)


def head_compute_dtype(precision: Optional[str], weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the head's GEMM under a Lightning ``precision`` (``trainer.precision``)."""
    return _AUTOCAST_DTYPES.get(str(precision), weight_dtype)


@dataclass(frozen=True)
class HeadMemoryEstimate:
    """Bytes of the LM head at the peak of a training step, for one ``[N, V]`` loss call.

    ``unfused_bytes``: what the unfused head adds to the peak. ``fused_bytes``: the fused head's own buffers
    at its peak (``chunk_bytes`` of them the chunk's logits); 0 when the hidden size is unknown.
    ``naive``: the unfused head is the one that ran, so nothing was saved.
    """

    num_tokens: int
    vocab_size: int
    hidden_size: Optional[int]
    precision: str
    compute_dtype: str
    bytes_per_logit: int
    unfused_bytes: int
    chunk_rows: Optional[int]
    chunk_bytes: int
    fused_bytes: int
    naive: bool
    #: the teacher's part of ``unfused_bytes`` (distillation; 0 without a teacher)
    teacher_bytes: int = 0

    def with_teacher(
        self,
        num_tokens: int,
        vocab_size: int,
        compute_dtype: torch.dtype,
        block_rows: Optional[int] = None,
    ) -> HeadMemoryEstimate:
        """This estimate with a teacher head of ``num_tokens x vocab_size`` logits in ``compute_dtype``: the
        unfused side adds :func:`teacher_logits_bytes`, the fused side the teacher's buffer: one block of
        ``block_rows`` (the GPU's :data:`~lightning_flce.engine.AUXILIARY_BLOCK_ROWS`), or without blocks one more
        chunk (the chunk rows as the student's; an estimate, as the op may pick fewer rows for two buffers)."""
        teacher = teacher_logits_bytes(num_tokens, vocab_size, compute_dtype)
        rows = self.chunk_rows or 0
        if block_rows:
            rows = min(rows, block_rows)
        chunk = rows * vocab_size * compute_dtype.itemsize
        return replace(
            self,
            unfused_bytes=self.unfused_bytes + teacher,
            fused_bytes=self.fused_bytes + chunk if self.fused_bytes else 0,
            chunk_bytes=self.chunk_bytes + chunk,
            teacher_bytes=self.teacher_bytes + teacher,
        )

    @property
    def saved_bytes(self) -> int:
        """What the fused head saved against the unfused one: the difference of the two heads' peaks."""
        return 0 if self.naive else max(self.unfused_bytes - self.fused_bytes, 0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class HeadMemoryModel:
    """Estimates the head's memory from the loss call's shape, the precision and the head's options.

    Args:
        precision: Lightning's precision string (``trainer.precision``), e.g. ``"bf16-mixed"``.
        weight_dtype: dtype of the head weight.
        hidden_size: the head's input size ``H``; ``None`` leaves the fused head's buffers out (the saving is
            then the unfused head's whole addition, an upper bound).
        softcap: the loss's logit softcap, if any.
        lse_square_scale: the loss's z-loss coefficient.
        chunk_size: the fused head's tokens per chunk; ``None`` for the op's default.
        impl: the op's ``impl`` resolved (``"triton"`` or ``"torch"``).
        accum_dtype: the op's ``accum_dtype`` (a dtype or its name; None: the op's rule), as the loss's
            :class:`~lightning_flce.head.FLCEHeadLoss` passes it for this weight.
        device: the head weight's device (the dW accumulator's dtype depends on the GPU).
        logits_precision: the op's ``logits_precision`` (fp32 chunk logits, twice the 16-bit ones, for
            ``"fp32"`` / ``"fp32_compensated"``, fp32 GEMMs for ``"fp32_head"``, and the weight copies their
            fallbacks make; ``"fp32_compensated"``'s Triton GEMM without label smoothing: the 16-bit buffer and
            the LSE partials, ``engine.RELATIVE_16BIT_LOGITS``).
        label_smoothing: the loss's label smoothing (it keeps ``"fp32_compensated"`` on the fp32 buffer).
    """

    def __init__(
        self,
        precision: Optional[str],
        weight_dtype: torch.dtype,
        hidden_size: Optional[int] = None,
        *,
        softcap: Optional[float] = None,
        lse_square_scale: float = 0.0,
        chunk_size: Optional[int] = None,
        impl: str = "torch",
        accum_dtype: AccumDtype = None,
        device: Optional[torch.device] = None,
        logits_precision: str = "input",
        label_smoothing: float = 0.0,
    ) -> None:
        self.precision = str(precision)
        self.label_smoothing = label_smoothing
        self.logits_precision = logits_precision
        self.weight_dtype = weight_dtype
        self.hidden_size = hidden_size
        self.softcap = softcap
        self.lse_square_scale = lse_square_scale
        self.chunk_size = chunk_size
        self.impl = impl
        self.accum_dtype = accum_dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.compute_dtype = head_compute_dtype(precision, weight_dtype)

    def bytes_per_logit(self) -> int:
        copies = _UNFUSED_COPIES
        if self.softcap:
            copies += _UNFUSED_COPIES_SOFTCAP
        if self.lse_square_scale:
            copies += _UNFUSED_COPIES_Z_LOSS
        return copies * softmax_dtype(self.compute_dtype).itemsize

    def estimate(self, num_tokens: int, vocab_size: int, naive: bool = False) -> HeadMemoryEstimate:
        unfused = num_tokens * vocab_size * self.bytes_per_logit()
        chunk_rows = None
        chunk_bytes = fused = 0
        if self.hidden_size and num_tokens:
            chunk_rows, chunk_bytes, fused = self._fused_bytes(num_tokens, vocab_size, self.hidden_size)
        return HeadMemoryEstimate(
            num_tokens=num_tokens,
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            precision=self.precision,
            compute_dtype=str(self.compute_dtype).replace("torch.", ""),
            bytes_per_logit=self.bytes_per_logit(),
            unfused_bytes=unfused,
            chunk_rows=chunk_rows,
            chunk_bytes=chunk_bytes,
            fused_bytes=fused,
            naive=naive,
        )

    def auxiliary_block_rows(self) -> Optional[int]:
        """The rows of a distillation teacher's buffer on this head's backend (None: a whole chunk's)."""
        return engine.auxiliary_block_rows(backend_for(BACKENDS[self.impl], self.compute_dtype).large_chunks)

    def _fused_bytes(self, num_tokens: int, vocab_size: int, hidden_size: int) -> tuple[int, int, int]:
        # What runs, by the op's own rules: "fp32_head" is fp32 GEMMs with an fp32 accumulator
        options, compute_dtype = resolve_logits_precision(
            FLCEOptions.of(logits_precision=self.logits_precision, accum_dtype=self.accum_dtype),
            self.compute_dtype,
        )
        itemsize = compute_dtype.itemsize
        backend = backend_for(BACKENDS[self.impl], compute_dtype)
        use_triton = backend.large_chunks  # the softmax works in place on the chunk (Triton)
        rows = chunk_rows(
            self.chunk_size,
            num_tokens,
            num_tokens,
            vocab_size,
            hidden_size,
            compute_dtype,
            use_triton,
        )
        rows = min(rows, num_tokens)
        wide = options.logits_precision in WIDE_LOGITS_PRECISIONS and compute_dtype in LOW_PRECISION
        mode = (
            WideLogitsGemm.mode_for(
                self.device,
                compensated=options.logits_precision == "fp32_compensated",
                triton=backend.name == "triton",  # as the op decides it
            )
            if wide
            else None
        )
        # "fp32_compensated"'s Triton GEMM may hand the chunk kernel 16-bit relative logits (the op's rule, for a
        # loss without statistics: the mixin's training loss)
        relative = engine.relative_16bit_logits(mode, vocab_size, self.label_smoothing, compute_stats=False)
        # the chunk's logits buffer (fp32 logits: their 16-bit gradient goes into its rows' second halves)
        logits_itemsize = 4 if wide and not relative else itemsize
        softmax_itemsize = softmax_dtype(compute_dtype).itemsize
        if use_triton:  # the kernel overwrites the logits with their gradient in place
            per_logit = logits_itemsize
        else:  # the PyTorch twins: the chunk, its upcast (if it has one) and logsumexp's temporary
            per_logit = logits_itemsize + softmax_itemsize * (1 if softmax_itemsize == logits_itemsize else 2)
        copies = 0  # made once per call
        partials = 0  # the relative path's LSE partials (max, sum per row and column tile) and target logits
        if relative:
            from lightning_flce.kernels.compensated_gemm import tile_lse_bytes

            partials = tile_lse_bytes(rows, vocab_size, self.device, with_target_logit=True)
        if wide:
            copy_dtype = WideLogitsGemm.WEIGHT_COPY_DTYPES.get(mode)
            if copy_dtype is not None:  # the fallbacks' widened weight
                copies += vocab_size * hidden_size * copy_dtype.itemsize
            if copy_dtype == torch.float64:
                # float64's [C, V] product, freed (rounded into the logits) before the softmax's temporary
                # exists: the larger of the two is the chunk's peak
                per_logit += 8 - (0 if use_triton else softmax_itemsize)
        elif compute_dtype != self.compute_dtype and self.weight_dtype != compute_dtype:
            copies += vocab_size * hidden_size * compute_dtype.itemsize  # "fp32_head": the weight widened
        chunk_bytes = rows * vocab_size * per_logit + partials
        # shapes only: the op's rule reads the sizes and the weight's dtype and device, never the data
        # (one element on the weight's device, whose GPU model decides between an fp32 and an fp64 accumulator)
        hidden = torch.empty((num_tokens, hidden_size), dtype=compute_dtype, device="meta")
        weight = torch.empty((), dtype=self.weight_dtype, device=self.device).expand(vocab_size, hidden_size)
        accumulator = saved_grad_weight_dtype(
            hidden, weight, compute_dtype, options.accum_dtype, self.chunk_size, backend.large_chunks
        )
        grad_weight = vocab_size * hidden_size * accumulator.itemsize
        if accumulator == torch.float64 and compute_dtype != torch.float64:
            grad_weight += vocab_size * hidden_size * 8  # the fp64 weight copy dX's GEMM reads
        grad_input = num_tokens * hidden_size * self.compute_dtype.itemsize  # dX in the hidden states' dtype
        return rows, chunk_bytes, chunk_bytes + copies + grad_weight + grad_input


def tensor_bytes(tensors: Iterable[Any], device: Optional[torch.device] = None) -> int:
    """Bytes of the storages behind ``tensors`` (each storage once: tied weights, views), on ``device`` if
    given; entries that are not tensors are skipped."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: this rank's shard
        if device is not None and local.device != device:
            continue
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            key, size = id(local), local.numel() * local.element_size()
        if key in seen:
            continue
        seen.add(key)
        total += size
    return total


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where a peak of allocated memory goes: parameters, gradients, optimizer state and the rest
    (activations kept for backward and the temporaries of the moment, the head's buffers among them)."""

    step: int
    peak_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int

    @property
    def rest_bytes(self) -> int:
        return max(
            self.peak_bytes - self.parameter_bytes - self.gradient_bytes - self.optimizer_state_bytes, 0
        )

    @classmethod
    def measure(
        cls,
        step: int,
        peak_bytes: int,
        parameters: Iterable[torch.Tensor],
        optimizers: Iterable[torch.optim.Optimizer],
        device: Optional[torch.device] = None,
    ) -> MemoryBreakdown:
        """Counts the tensors now: gradients as the step left them (what the next forward holds; Lightning
        clears them only after the forward), optimizer state as far as it is made of tensors."""
        parameters = list(parameters)
        state = [value for optimizer in optimizers for s in optimizer.state.values() for value in s.values()]
        return cls(
            step=step,
            peak_bytes=peak_bytes,
            parameter_bytes=tensor_bytes(parameters, device),
            gradient_bytes=tensor_bytes((p.grad for p in parameters), device),
            optimizer_state_bytes=tensor_bytes(state, device),
        )

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "rest_bytes": self.rest_bytes}

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> MemoryBreakdown:
        return cls(**{name: values[name] for name in cls.__dataclass_fields__})

    def metrics(self, prefix: str = "memory/peak_breakdown/") -> dict[str, float]:
        """The parts in MiB, as logger metrics."""
        parts = {
            "parameters": self.parameter_bytes,
            "gradients": self.gradient_bytes,
            "optimizer_state": self.optimizer_state_bytes,
            "activations_and_temporaries": self.rest_bytes,
        }
        return {f"{prefix}{name}_mib": value / _MIB for name, value in parts.items()}
