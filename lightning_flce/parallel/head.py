"""An LM head whose ``[V, H]`` weight is sharded over V across a process group (:class:`VocabParallelHead`),
its default shard layout and its initialization."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flce.distill.top_k import TopKOutput
from lightning_flce.outputs import FLCEOutput
from lightning_flce.parallel.op import (
    vocab_parallel_fused_linear_cross_entropy,
    vocab_parallel_fused_linear_cross_entropy_with_stats,
)
from lightning_flce.parallel.top_k import vocab_parallel_fused_linear_top_k


def vocab_shard_range(vocab_size: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s rows in the default layout: contiguous shards in rank order whose
    sizes differ by at most one (the first ``vocab_size % world_size`` ranks get the extra row)."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of size {world_size}")
    if vocab_size < world_size:
        raise ValueError(f"cannot shard V={vocab_size} rows over {world_size} ranks (every rank needs one)")
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


_INIT_BLOCK_ROWS = 1024


def init_rows_like_linear(
    weight: Tensor, bias: Optional[Tensor], vocab_start: int, vocab_size: int, seed: int
) -> None:
    """``nn.Linear``'s init (``kaiming_uniform(a=sqrt(5))``: uniform(+-1/sqrt(H)), the bias likewise) of the
    rows ``[vocab_start, vocab_start + len(weight))`` of a ``vocab_size``-row head, each block of
    ``_INIT_BLOCK_ROWS`` rows drawn from its own generator seeded by ``seed`` and the block: the shards of any
    group size together hold the same head, and no shard draws from the global generator."""
    rows, hidden = weight.shape
    bound = 1.0 / hidden**0.5 if hidden else 0.0
    generator = torch.Generator(device=weight.device)
    first_block, last_block = vocab_start // _INIT_BLOCK_ROWS, (vocab_start + rows - 1) // _INIT_BLOCK_ROWS
    with torch.no_grad():
        for block in range(first_block, last_block + 1) if rows else ():
            block_start = block * _INIT_BLOCK_ROWS
            block_rows = min(_INIT_BLOCK_ROWS, vocab_size - block_start)
            lo, hi = max(vocab_start, block_start), min(vocab_start + rows, block_start + block_rows)
            for tensor, shape, stream in ((weight, (block_rows, hidden), 0), (bias, (block_rows,), 1)):
                if tensor is None:
                    continue
                generator.manual_seed(seed + 2 * block + stream)
                values = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
                values.uniform_(-bound, bound, generator=generator)
                tensor[lo - vocab_start : hi - vocab_start] = values[lo - block_start : hi - block_start]


class VocabParallelHead(nn.Module):
    """An LM head whose ``[V, H]`` weight is sharded over V across a process group.

    Holds the rows ``[vocab_start, vocab_start + V_r)`` of the full head (:func:`vocab_shard_range`);
    ``forward`` returns the local logits ``[..., V_r]``, :meth:`loss` the vocab-parallel fused loss, :meth:`top_k`
    each token's top k (a cached teacher's), and :meth:`gather_logits` the full logits (inference; builds
    ``[..., V]``).

    Example::

        dist.init_process_group("nccl")
        head = VocabParallelHead.from_linear(model.lm_head)  # keeps this rank's rows
        loss = head.loss(hidden, labels, label_smoothing=0.1)
        loss.backward()  # head.weight.grad: this rank's rows; hidden.grad: all-reduced over the group

    Not a tied embedding: a vocab-parallel input embedding is not provided here.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        bias: bool = False,
        *,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = group
        world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        start, end = vocab_shard_range(vocab_size, world_size, rank)
        self.in_features = in_features
        self.vocab_size = vocab_size
        self.vocab_start = start
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(end - start, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(end - start, **factory)) if bias else None
        # One draw from the global (CPU, also under a meta device context) generator on every rank, whatever
        # its shard's size: the ranks' random streams stay in step (dropout masks of a body every rank must
        # run identically).
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
        if self.weight.device.type != "meta":
            init_rows_like_linear(self.weight, self.bias, start, vocab_size, seed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[dist.ProcessGroup] = None) -> VocabParallelHead:
        """A head holding this rank's rows of ``linear`` (copied; ``linear`` itself is left unchanged)."""
        head = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group=group,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        rows = slice(head.vocab_start, head.vocab_start + head.weight.shape[0])
        with torch.no_grad():
            head.weight.copy_(linear.weight[rows])
            if head.bias is not None:
                head.bias.copy_(linear.bias[rows])
        return head

    def forward(self, hidden: Tensor) -> Tensor:
        """Local logits ``[..., V_r]`` (columns ``vocab_start .. vocab_start + V_r`` of the full logits)."""
        return F.linear(hidden, self.weight, self.bias)

    def loss(self, hidden: Tensor, target: Tensor, **kwargs) -> Tensor:
        """:func:`vocab_parallel_fused_linear_cross_entropy` of this head (keyword options passed on)."""
        return vocab_parallel_fused_linear_cross_entropy(
            hidden, self.weight, target, self.bias, group=self.group, vocab_start=self.vocab_start, **kwargs
        )

    def loss_with_stats(self, hidden: Tensor, target: Tensor, **kwargs) -> FLCEOutput:
        """:func:`vocab_parallel_fused_linear_cross_entropy_with_stats` of this head."""
        return vocab_parallel_fused_linear_cross_entropy_with_stats(
            hidden, self.weight, target, self.bias, group=self.group, vocab_start=self.vocab_start, **kwargs
        )

    def top_k(self, hidden: Tensor, k: int, **kwargs) -> TopKOutput:
        """:func:`~lightning_flce.parallel.vocab_parallel_fused_linear_top_k` of this head: each token's ``k`` most
        likely columns of the whole vocabulary and their log-probabilities, the same on every rank (keyword
        options passed on: ``target``, ``softcap``, ``log_probs``, ...). No gradient."""
        return vocab_parallel_fused_linear_top_k(
            hidden, self.weight, k, self.bias, group=self.group, vocab_start=self.vocab_start, **kwargs
        )

    @torch.no_grad()
    def gather_logits(self, hidden: Tensor) -> Tensor:
        """The full logits ``[..., V]`` on every rank (all-gather; no gradient). For inference only.
        Every rank of the group must pass hidden states of the same shape (checked: ValueError on all)."""
        # [ndim, sizes of the first 8 dims, 0-padded]; one MAX all-reduce of (row, -row) gives max and -min
        row = [hidden.dim(), *hidden.shape[:8]] + [0] * (8 - min(hidden.dim(), 8))
        bounds = torch.tensor(row + [-v for v in row], device=hidden.device, dtype=torch.int64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)
        if not bool((bounds[:9] == -bounds[9:]).all()):
            raise ValueError(
                "VocabParallelHead.gather_logits: the ranks of the head's group passed hidden states of different"
                f" shapes (this rank: {tuple(hidden.shape)}); every rank must pass the same tokens"
            )
        return self._gather_over_vocab(self.forward(hidden), dim=-1)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """``{"weight": [V, H], "bias": [V]}`` of the whole head on every rank (all-gather; a collective every
        rank of the group must join): the state of the equivalent ``nn.Linear``, for export or to load into a
        group of another size (:meth:`load_full_state_dict`)."""
        params = {"weight": self.weight, "bias": self.bias}
        return {name: self._gather_over_vocab(p, dim=0) for name, p in params.items() if p is not None}

    def _gather_over_vocab(self, local: Tensor, dim: int) -> Tensor:
        """Every rank's shard of ``local`` along its vocabulary dimension ``dim``, concatenated in row order
        (shards are padded to the largest for the all-gather)."""
        local = local.movedim(dim, 0)
        world_size = dist.get_world_size(self.group)
        sizes = [
            end - start
            for start, end in (vocab_shard_range(self.vocab_size, world_size, r) for r in range(world_size))
        ]
        padded = local.new_zeros(max(sizes), *local.shape[1:])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)]).movedim(0, dim)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Copies this rank's rows of a whole head's ``{"weight": [V, H], "bias": [V]}`` (an ``nn.Linear``'s
        state, or :meth:`full_state_dict` of a group of any size); no collective."""
        rows = slice(self.vocab_start, self.vocab_start + self.weight.shape[0])
        expected = {"weight": (self.vocab_size, self.in_features)}
        if self.bias is not None:
            expected["bias"] = (self.vocab_size,)
        if set(state) != set(expected) or any(
            tuple(state[k].shape) != shape for k, shape in expected.items()
        ):
            got = {k: tuple(v.shape) for k, v in state.items()}
            raise ValueError(f"load_full_state_dict expects {expected} (the whole head), got {got}")
        for name in expected:
            getattr(self, name).copy_(state[name][rows])

    def get_extra_state(self) -> dict:
        """The rows this module holds, saved with its ``state_dict``: loading them on a rank that owns other
        rows raises instead of silently mixing the head's rows (``torch.distributed.checkpoint`` keeps one
        copy of a key that every rank saves)."""
        rows = self.weight.shape[0]
        return {
            "vocab_start": self.vocab_start,
            "vocab_end": self.vocab_start + rows,
            "vocab_size": self.vocab_size,
        }

    def set_extra_state(self, state: Any) -> None:
        mine = self.get_extra_state()
        if state != mine:
            raise ValueError(
                f"this VocabParallelHead state holds rows [{state.get('vocab_start')}, {state.get('vocab_end')}) of"
                f" a {state.get('vocab_size')}-row head, but this rank's module owns rows [{mine['vocab_start']},"
                f" {mine['vocab_end']}) of {mine['vocab_size']}: a vocab-parallel head's state is per rank (save"
                " and load each rank's own, e.g. to a file per rank); for another group size save full_state_dict()"
                " and load it with load_full_state_dict()"
            )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, *args) -> None:
        key = prefix + "_extra_state"
        if key in state_dict:
            self.set_extra_state(state_dict[key])  # before any row is copied
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *args)
        if key in missing_keys:  # a checkpoint from before the rows were recorded: nothing to check
            missing_keys.remove(key)

    def extra_repr(self) -> str:
        rows = self.weight.shape[0]
        return (
            f"in_features={self.in_features}, vocab_size={self.vocab_size}, "
            f"rows=[{self.vocab_start}, {self.vocab_start + rows}), bias={self.bias is not None}"
        )
