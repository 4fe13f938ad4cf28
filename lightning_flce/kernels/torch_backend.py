"""The ``torch`` backend: plain-PyTorch twins of the Triton kernels (same contracts, same formulas).

The kernels are looked up in their modules at each call, so a test can replace one there.
"""

from __future__ import annotations

from lightning_flce.kernels import cross_entropy_shard_torch as _shard_kernels
from lightning_flce.kernels import cross_entropy_torch as _chunk_kernel
from lightning_flce.kernels import distill_torch as _distill_kernel
from lightning_flce.kernels import logprobs_torch as _logprob_kernels


def cross_entropy_chunk(logits, target, options, **kwargs):
    """See :func:`lightning_flce.kernels.cross_entropy_torch.cross_entropy_chunk_torch`."""
    return _chunk_kernel.cross_entropy_chunk_torch(logits, target, options, **kwargs)


def shard_row_stats(logits, local_target, **kwargs):
    """See :func:`lightning_flce.kernels.cross_entropy_shard_torch.shard_row_stats_torch`."""
    return _shard_kernels.shard_row_stats_torch(logits, local_target, **kwargs)


def shard_softmax_grad(logits, local_target, lse, p_coef, smoothing, target_coef, **kwargs):
    """See :func:`lightning_flce.kernels.cross_entropy_shard_torch.shard_softmax_grad_torch`."""
    _shard_kernels.shard_softmax_grad_torch(
        logits, local_target, lse, p_coef, smoothing, target_coef, **kwargs
    )


def logprob_row_stats(logits, target, **kwargs):
    """See :func:`lightning_flce.kernels.logprobs_torch.logprob_row_stats_torch`."""
    return _logprob_kernels.logprob_row_stats_torch(logits, target, **kwargs)


def logprob_grad(logits, target, **kwargs):
    """See :func:`lightning_flce.kernels.logprobs_torch.logprob_grad_torch`."""
    _logprob_kernels.logprob_grad_torch(logits, target, **kwargs)


def distill_chunk(student_logits, teacher_logits, target, **kwargs):
    """See :func:`lightning_flce.kernels.distill_torch.distill_chunk`."""
    return _distill_kernel.distill_chunk(student_logits, teacher_logits, target, **kwargs)
