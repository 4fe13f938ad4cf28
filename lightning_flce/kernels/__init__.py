"""Per-chunk cross-entropy kernels and the registry of their backends.

A chunk kernel gets one chunk's logits and returns the loss per row and its LSE (and statistics), and
writes d loss / d logits over the logits (or into ``grad_out``, a [C, V] tensor of its own dtype: the
16-bit gradient of fp32 logits, laid out in the logits' own rows by :func:`gradient_in_logits_rows`). The
vocab-parallel op splits the same math around its all-reduces: ``shard_row_stats`` (one read of a shard's
columns), then ``shard_softmax_grad``. The log-probability losses (:mod:`lightning_flce.losses.logprobs`,
:mod:`lightning_flce.losses.policy`) split theirs the same way on the whole vocabulary: ``logprob_row_stats``
(log p of the target, LSE, entropy of ``softmax(softcap(logits) / T)``), then ``logprob_grad`` for per-row
upstream gradients. The distillation loss (:mod:`lightning_flce.losses.distillation`) has one kernel per chunk,
``distill_chunk`` (the divergence between the teacher's and the student's distributions, the hard-label
cross-entropy, and the student's logit gradient in place; contract in :mod:`~lightning_flce.kernels.distill_torch`).

A backend is one module with those six functions and one :class:`Backend` entry in :data:`BACKENDS`:

- ``triton`` (:mod:`~lightning_flce.kernels.triton_backend`): Triton kernels, one per file
  (:mod:`~lightning_flce.kernels.cross_entropy`, :mod:`~lightning_flce.kernels.cross_entropy_shard`,
  :mod:`~lightning_flce.kernels.logprobs`, :mod:`~lightning_flce.kernels.distill`); CUDA, or
  the CPU under Triton's interpreter (tests). The logits GEMM of ``logits_precision="fp32_compensated"``
  (:mod:`~lightning_flce.kernels.compensated_gemm`), which the chunk engine runs with this backend, lives
  beside them;
- ``torch`` (:mod:`~lightning_flce.kernels.torch_backend`): their plain-PyTorch twins
  (:mod:`~lightning_flce.kernels.cross_entropy_torch`, :mod:`~lightning_flce.kernels.cross_entropy_shard_torch`,
  :mod:`~lightning_flce.kernels.logprobs_torch`, :mod:`~lightning_flce.kernels.distill_torch`),
  for the CPU, devices without Triton, and fp64.

Every implementation transforms the logits (``softcap(r) / T``) and takes that transform's derivative through one
pair per language: :mod:`~lightning_flce.kernels.triton_math` (``load_transformed`` / ``transform_logits``,
``transform_backward``) and :mod:`~lightning_flce.kernels.transform_torch` (``transformed_logits``,
``transform_backward``).

The softmax runs in :func:`softmax_dtype` of the logits: fp32, or fp64 for fp64 logits. The Triton kernels
compute in fp32 only, so fp64 logits go to the PyTorch twins (:func:`backend_for`).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from lightning_flce._compat import triton_usable

#: The 16-bit GEMM dtypes (their products are widened to fp32 for the softmax and the dW accumulator).
LOW_PRECISION = (torch.float16, torch.bfloat16)


def softmax_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax, the loss and the statistics of ``logits_dtype`` logits run in: fp32 for
    fp16/bf16/fp32, fp64 for fp64 (as ``F.cross_entropy`` of upcast logits)."""
    return torch.promote_types(logits_dtype, torch.float32)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of the per-chunk kernels: a module (``module``) with ``cross_entropy_chunk``,
    ``shard_row_stats``, ``shard_softmax_grad``, ``logprob_row_stats``, ``logprob_grad`` and ``distill_chunk`` (the
    contracts above), and what the chunk engine needs to
    know of it.

    ``softmax_dtypes``: the dtypes its softmax computes in (logits of other dtypes run the ``torch`` backend);
    ``large_chunks``: its softmax works in place on the chunk's logits, so chunks are sized by the GEMMs' rule
    (at least ``4096`` rows where memory allows, see :func:`lightning_flce.engine.default_chunk_size`), not by
    the PyTorch twin's workspace of ``TORCH_WORKSPACE_COPIES`` fp32 copies.
    """

    name: str
    module: str
    softmax_dtypes: Tuple[torch.dtype, ...]
    large_chunks: bool
    usable: Callable[[torch.device], bool]
    unusable_hint: str = ""

    def kernels(self) -> types.ModuleType:
        """The backend's module (imported on first use: Triton is an optional dependency)."""
        return importlib.import_module(self.module)


#: The registered backends, in the order ``impl="auto"`` tries them. A new backend: one module with the six
#: functions, and one entry here; ``impl`` accepts its name from then on.
BACKENDS: Dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend(
            name="triton",
            module="lightning_flce.kernels.triton_backend",
            softmax_dtypes=(torch.float32,),
            large_chunks=True,
            usable=triton_usable,
            unusable_hint="needs Triton and a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors)",
        ),
        Backend(
            name="torch",
            module="lightning_flce.kernels.torch_backend",
            softmax_dtypes=(torch.float32, torch.float64),
            large_chunks=False,
            usable=lambda device: True,
        ),
    )
}
#: The backend whose softmax takes every dtype (fp64 GEMMs run it under any ``impl``).
FALLBACK_BACKEND = "torch"


def resolve_backend(impl: str, device: torch.device) -> Backend:
    """The backend ``impl`` names (``"auto"``: the first usable on ``device``). Raises if it cannot run there."""
    if impl == "auto":
        return next(backend for backend in BACKENDS.values() if backend.usable(device))
    backend = BACKENDS[impl]
    if not backend.usable(device):
        raise RuntimeError(f"impl={impl!r} {backend.unusable_hint}; got {device}")
    return backend


def backend_for(backend: Backend, compute_dtype: torch.dtype) -> Backend:
    """The backend that runs the softmax of ``compute_dtype`` GEMMs: ``backend``, or the fallback when its
    kernels do not compute in that softmax dtype (the Triton kernels compute in fp32 only, so fp64 GEMMs, an
    accuracy dtype rather than a speed one, run the PyTorch twins in fp64, on CUDA too)."""
    if softmax_dtype(compute_dtype) in backend.softmax_dtypes:
        return backend
    return BACKENDS[FALLBACK_BACKEND]


def gradient_in_logits_rows(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [C, V] ``dtype`` (16-bit) view of the second half of each row's bytes of the fp32 [C, V] chunk
    ``logits``: where the chunk kernels write the 16-bit gradient of fp32 logits, so the wide-logits path needs
    no second [C, V] buffer (its one buffer is twice the default's 16-bit one, and its chunks as large).

    Why it is safe: the Triton kernel's second pass walks a row from its last block to its first, and the
    16-bit values of columns [j, V) land in the fp32 columns [(V + j) / 2, V), which that pass has already
    read (a barrier per block orders the loads before the stores); :func:`copy_gradient` is the PyTorch
    paths' equivalent. Row r's gradient touches row r's storage only; the view's row stride is 2 V, which the
    dX / dW GEMMs take as any strided operand."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"gradient_in_logits_rows needs fp32 [C, V] logits with unit column stride, got {logits}"
        )
    if torch.empty((), dtype=dtype).element_size() != 2:
        raise ValueError(f"gradient_in_logits_rows holds a 16-bit gradient, got {dtype}")
    vocab = logits.shape[1]
    return logits.view(dtype)[:, vocab:]


def is_gradient_in_logits_rows(logits: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Whether ``grad_out`` shares ``logits``' memory; raises unless it is laid out as
    :func:`gradient_in_logits_rows` lays it out (any other overlap would be overwritten before it is read)."""
    if grad_out is logits or logits.numel() == 0:
        return False
    if grad_out.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
        return False
    vocab = logits.shape[1]
    laid_out = (
        logits.dtype == torch.float32
        and grad_out.element_size() == 2
        and grad_out.shape == logits.shape
        and grad_out.stride() == (2 * logits.stride(0), 1)
        and grad_out.data_ptr() == logits.data_ptr() + 2 * vocab
    )
    if not laid_out:
        raise ValueError(
            "grad_out overlaps the logits but is not gradient_in_logits_rows(logits, dtype): got"
            f" {grad_out.dtype} {tuple(grad_out.shape)} stride {grad_out.stride()} over {logits.dtype}"
            f" {tuple(logits.shape)} stride {logits.stride()}"
        )
    return True


def copy_gradient(grad: torch.Tensor, grad_out: torch.Tensor, rows_per_copy: int = 256) -> None:
    """``grad_out.copy_(grad)`` where ``grad_out`` may be :func:`gradient_in_logits_rows` of ``grad``'s own
    memory (the PyTorch paths compute the gradient of fp32 logits in place, then narrow it): a block of rows
    at a time is narrowed into a temporary before it is written, so every value is read before its bytes
    are overwritten, and the temporary stays ``rows_per_copy`` rows."""
    if not is_gradient_in_logits_rows(grad, grad_out):
        grad_out.copy_(grad)
        return
    for source, target in zip(grad.split(rows_per_copy), grad_out.split(rows_per_copy)):
        target.copy_(source.to(target.dtype))


class LossOptions(NamedTuple):
    """The loss definition shared by every chunk of one call.

    ``class_weight`` is [V] in the softmax dtype, or None; ``class_weight_sum`` its sum as a [1] device
    tensor (the label-smoothing term needs it; kept on device to avoid a host sync). ``softcap`` 0.0 means
    off.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float = 0.0
    class_weight: Optional[torch.Tensor] = None
    class_weight_sum: Optional[torch.Tensor] = None


class ChunkOutputs(NamedTuple):
    """Per-row outputs of one chunk ([C] each in the softmax dtype; ``correct`` bool). Stats are None unless
    asked."""

    loss: torch.Tensor
    lse: torch.Tensor
    correct: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


class ShardRowStats(NamedTuple):
    """Per-row statistics of one shard's columns of a chunk, relative to the shard's own row maximum
    ([C] each in the softmax dtype; ``argmax`` int64). The optional ones are None unless asked for."""

    max: torch.Tensor  # max_j z_j over the local columns (after the softcap)
    sum_exp: torch.Tensor  # sum_j exp(z_j - max)
    z_target: torch.Tensor  # z at the target column if this shard holds it, else 0
    z_sum: Optional[torch.Tensor] = None  # sum_j z_j (label smoothing)
    exp_z_sum: Optional[torch.Tensor] = None  # sum_j exp(z_j - max) z_j (entropy)
    argmax: Optional[torch.Tensor] = None  # local index of the first maximum (accuracy)

    @classmethod
    def empty(
        cls,
        n_rows: int,
        device: torch.device,
        *,
        with_z_sum: bool,
        with_stats: bool,
        dtype: torch.dtype = torch.float32,
    ) -> ShardRowStats:
        """Uninitialized outputs for ``n_rows`` rows in ``dtype`` (the optional ones only when asked for)."""

        def rows(row_dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(n_rows, dtype=row_dtype, device=device)

        return cls(
            rows(),
            rows(),
            rows(),
            rows() if with_z_sum else None,
            rows() if with_stats else None,
            rows(torch.int64) if with_stats else None,
        )
