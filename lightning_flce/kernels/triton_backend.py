"""The ``triton`` backend: the Triton chunk kernel, the vocab-parallel shard kernels, the log-probability kernels
and the distillation kernel.

The kernels are looked up in their modules at each call, so a test can replace one there.
"""

from __future__ import annotations

from lightning_flce.kernels import cross_entropy as _chunk_kernel
from lightning_flce.kernels import cross_entropy_shard as _shard_kernels
from lightning_flce.kernels import distill as _distill_kernel
from lightning_flce.kernels import logprobs as _logprob_kernels


def cross_entropy_chunk(logits, target, options, **kwargs):
    """See :func:`lightning_flce.kernels.cross_entropy.cross_entropy_chunk_triton`."""
    return _chunk_kernel.cross_entropy_chunk_triton(logits, target, options, **kwargs)


def shard_row_stats(logits, local_target, **kwargs):
    """See :func:`lightning_flce.kernels.cross_entropy_shard.shard_row_stats_triton`."""
    return _shard_kernels.shard_row_stats_triton(logits, local_target, **kwargs)


def shard_softmax_grad(logits, local_target, lse, p_coef, smoothing, target_coef, **kwargs):
    """See :func:`lightning_flce.kernels.cross_entropy_shard.shard_softmax_grad_triton`."""
    _shard_kernels.shard_softmax_grad_triton(
        logits, local_target, lse, p_coef, smoothing, target_coef, **kwargs
    )


def logprob_row_stats(logits, target, **kwargs):
    """See :func:`lightning_flce.kernels.logprobs.logprob_row_stats_triton`."""
    return _logprob_kernels.logprob_row_stats_triton(logits, target, **kwargs)


def logprob_grad(logits, target, **kwargs):
    """See :func:`lightning_flce.kernels.logprobs.logprob_grad_triton`."""
    _logprob_kernels.logprob_grad_triton(logits, target, **kwargs)


def distill_chunk(student_logits, teacher_logits, target, **kwargs):
    """See :func:`lightning_flce.kernels.distill.distill_chunk`."""
    return _distill_kernel.distill_chunk(student_logits, teacher_logits, target, **kwargs)
