"""Sequence parallelism for the vocab-parallel ops: each rank of the group holds its own block of tokens (as many on
every rank, rank-major), while the head's rows stay sharded over V.

Each chunk needs every token on every rank (a rank's columns of every token's logits), so the tokens are
all-gathered in; what leaves per token (the losses of ``reduction="none"``, the statistics) is cut back to this
rank's block, and dX, summed over the ranks' columns, is reduce-scattered: one collective that both sums the
ranks' partials and leaves each rank its rows. The agreement (:mod:`lightning_flce.parallel.agreement`) checks
first that every rank holds as many tokens, of one hidden size and dtype.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import Tensor

from lightning_flce._compat import all_gather_single, reduce_scatter_single

__all__ = ["gather_rows", "local_rows", "reduce_scatter_rows"]


def gather_rows(local: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Every rank's ``local`` rows, concatenated in rank order (the same row count on every rank)."""
    world = dist.get_world_size(group)
    out = local.new_empty(world * local.shape[0], *local.shape[1:])
    all_gather_single(out, local.contiguous(), group=group)
    return out


def local_rows(full: Optional[Tensor], group: Optional[dist.ProcessGroup]) -> Optional[Tensor]:
    """This rank's block of the rows of ``full`` (rank-major, equal blocks), a copy (not a view of a forward
    temporary); None stays None."""
    if full is None:
        return None
    rows = full.shape[0] // dist.get_world_size(group)
    rank = dist.get_rank(group)
    return full[rank * rows : (rank + 1) * rows].clone()


def reduce_scatter_rows(full: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """The sum over the group of every rank's ``full`` [world * n, ...], this rank's block of n rows only."""
    local = full.new_empty(full.shape[0] // dist.get_world_size(group), *full.shape[1:])
    reduce_scatter_single(local, full.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return local
