"""Vocab-parallel fused linear cross-entropy: the LM head's weight is sharded over V across a process group.

Rank ``r`` of ``group`` holds the rows ``[vocab_start_r, vocab_start_r + V_r)`` of the ``[V, H]`` head weight
(and of the bias); the hidden states and targets are the same on every rank of the group (replicated, as in
Megatron-style tensor parallelism). Per chunk of C tokens each rank computes only its ``[C, V_r]`` logits and::

    M        = all_reduce_max(max_j z_j)                         # [C]
    S, z_t.. = all_reduce_sum(sum_j exp(z_j - M), z_target, ...)  # [k, C] in one collective
    lse      = M + log S                                          # the global log-sum-exp
    d loss / d z_j = coef * exp(z_j - M) / S - smoothing - one-hot(target), on the local columns only
    dW_r    (+)= (d loss / d logits).T @ x_c                      # stays local
    dX_part (+)= (d loss / d logits) @ W_r                        # summed over the group once, at the end

where ``z`` are the (softcapped) logits in fp32 (fp64 for fp64 GEMMs), ``z_target`` comes from the rank that
owns the target (the others add 0), and the label-smoothing and entropy sums ride in the same sum. No rank
holds ``[N, V]`` or the full ``[V, H]``. Every collective goes through :mod:`torch.distributed` on ``group``
(gloo on the CPU, NCCL on GPUs). Default chunks follow the single-device op's rule for the device (on GPUs:
large chunks, since each one reads and writes the whole dW accumulator). The per-chunk softmax is a pair of Triton kernels
around the all-reduces (``lightning_flce.kernels.cross_entropy_shard``: one read for the row statistics,
one read + write for the gradient), or their PyTorch twin in row slices that bound its temporaries (fp64
GEMMs always run the twin: the kernels compute in fp32).

Like the single-device op, "mean"/"sum" compute the gradients in forward (backward multiplies them by
``grad_output``), and "none" recomputes the chunks in backward with the per-token ``grad_output`` (its
collectives then run in backward too, on every rank in the same order). fp16 gradients get the
single-device op's powers of two (see ``lightning_flce.op``), so a GradScaler works as with the unfused loss.

Shard layout and consistency are checked with one small integer all-reduce per call (one host sync), the
call's first collective: every rank learns every shard's ``(start, size)``, and a mismatch between ranks
(different hidden states count, targets, hidden size, chunk size, dtype, ``requires_grad`` or
``sequence_parallel``) raises the same error on every rank instead of hanging in a later collective. Every
rank joins it even when its own argument checks failed (it then sends a flag instead of its row), so a bad
argument on one rank raises on all: there its own error, on the others one naming it. Only errors raised
before the group is known (no initialized ``torch.distributed``, a DTensor weight whose mesh gives no
group) stay on the rank.

Not supported (raise): ``class_weight`` (``NotImplementedError``). Not tested: ``torch.compile`` of a graph
containing this op (it is a plain ``autograd.Function`` with host syncs and collectives, so dynamo
graph-breaks around it).
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flce._compat import all_gather_single, dtensor_api, reduce_scatter_single
from lightning_flce.functional import (
    FLCEOutput,
    _accum_mode,
    _check_inputs,
    _check_options,
    _class_indices,
    _resolve_impl,
    _shaped_like_target,
    takes_options_of,
)
from lightning_flce.kernels import (
    ChunkOutputs,
    LossOptions,
    chunk_kernels_use_triton,
    shard_row_stats,
    shard_softmax_grad,
    softmax_dtype,
)
from lightning_flce.kernels.scale import scale_, scale_into
from lightning_flce.op import (
    _CHUNK_ALIGN,
    _FLOOR_LIMITED_ALIGN,
    _accumulator_dtype,
    _loss_scales,
    balanced_chunk_rows,
    check_single_backward,
    default_chunk_size,
    run_chunks,
    valid_rows,
)

__all__ = [
    "VocabParallelHead",
    "fully_shard_lm",
    "register_fsdp_step_methods",
    "vocab_parallel_fused_linear_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy_with_stats",
    "vocab_shard_range",
]

_REDUCTION_CODES = {"mean": 0, "sum": 1, "none": 2}
# Columns of the per-rank row of the agreement all-reduce.
(
    _C_FAILED,  # 0, or 1 + the index in _PEER_ERROR_TYPES of the error this rank's argument checks raised
    _C_SEQUENCE_PARALLEL,
    _C_START_GIVEN,
    _C_START,
    _C_ROWS,
    _C_HIDDEN,
    _C_TOKENS,
    _C_VALID,
    _C_TARGET_MIN,
    _C_TARGET_MAX,
    _C_FINGERPRINT,
    _C_CHUNK,
    _C_DTYPES,
    _C_FLAGS,
    _C_OPTIONS,
) = range(15)
_N_COLUMNS = 15
# The ranks whose checks passed raise the failed rank's error type: the first listed that it is, else RuntimeError
_PEER_ERROR_TYPES = (ValueError, TypeError, NotImplementedError, RuntimeError)
_FINGERPRINT_PRIME = 2**31 - 1  # the targets fingerprint (see _agreement_row)
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


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


def vocab_parallel_fused_linear_cross_entropy(
    input: Tensor,
    weight_shard: Tensor,
    target: Tensor,
    bias_shard: Optional[Tensor] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    class_weight: Optional[Tensor] = None,
    impl: str = "auto",
    sequence_parallel: bool = False,
) -> Tensor:
    """:func:`~lightning_flce.fused_linear_cross_entropy` with the head weight sharded over V across ``group``.

    Call it on every rank of ``group`` with the same ``input``, ``target`` and options; each rank passes its
    own rows of the weight (and bias). The result — the loss and the gradient w.r.t. ``input`` — is the same
    on every rank and equals the single-device op on the full weight; ``weight_shard.grad`` (and
    ``bias_shard.grad``) get the rows of the full gradient that the rank holds.

    Args:
        input: [..., H] hidden states, identical on every rank of ``group``.
        weight_shard: [V_r, H] this rank's rows of the head weight (V_r >= 1). A ``DTensor`` sharded
            ``Shard(0)`` on a 1-D device mesh is accepted too: its local rows and the mesh's group are used.
        target: [...] global class indices in ``[0, V)`` (or ``ignore_index``), identical on every rank.
        bias_shard: optional [V_r] rows of the head bias.
        group: the process group the vocabulary is sharded over (default: the world).
        vocab_start: first global row of ``weight_shard``. ``None`` (default): shards are contiguous in rank
            order, ``vocab_start_r = V_0 + ... + V_{r-1}`` (the sizes are exchanged, so uneven shards work).
            If given, it must be given on every rank and the shards must tile ``[0, V)``.
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, chunk_size, accum_dtype: as in
            :func:`~lightning_flce.fused_linear_cross_entropy` (``chunk_size=None`` picks the same size on
            every rank, from the largest shard).
        class_weight: not supported (``NotImplementedError``).
        impl: the per-chunk softmax: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` (CUDA, or
            CPU tensors under ``TRITON_INTERPRET=1``) or ``"torch"``; the GEMMs are cuBLAS either way.
        sequence_parallel: ``input`` and ``target`` hold this rank's tokens only (sequence parallelism: the
            same number on every rank, rank ``r``'s after rank ``r - 1``'s). They are all-gathered for the
            loss; dX is reduce-scattered back to this rank's tokens instead of all-reduced; "none" returns the
            losses of this rank's tokens (their ``grad_output`` is all-gathered in backward), and so do the
            statistics of ``..._with_stats``. "mean"/"sum" are over all ranks' tokens.

    Returns:
        The loss (a scalar, or one per token in the target's shape for ``reduction="none"``) in fp32, fp64 for
        fp64 inputs, replicated on every rank. Backpropagate the same ``grad_output`` on every rank (the usual
        case: the loss feeds the same computation on all).
    """
    return _call(
        input,
        weight_shard,
        target,
        bias_shard,
        group=group,
        vocab_start=vocab_start,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        chunk_size=chunk_size,
        accum_dtype=accum_dtype,
        class_weight=class_weight,
        impl=impl,
        sequence_parallel=sequence_parallel,
        compute_stats=False,
    ).loss


@takes_options_of(vocab_parallel_fused_linear_cross_entropy)
def vocab_parallel_fused_linear_cross_entropy_with_stats(
    input: Tensor, weight_shard: Tensor, target: Tensor, bias_shard: Optional[Tensor] = None, **kwargs
) -> FLCEOutput:
    """:func:`vocab_parallel_fused_linear_cross_entropy` plus the per-token global LSE, ``argmax == target``
    (first maximum over the whole vocabulary on ties) and entropy, as
    :func:`~lightning_flce.fused_linear_cross_entropy_with_stats` returns them (one more all-reduce per
    chunk, for the argmax)."""
    return _call(input, weight_shard, target, bias_shard, compute_stats=True, **kwargs)


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
    ``forward`` returns the local logits ``[..., V_r]``, :meth:`loss` the vocab-parallel fused loss, and
    :meth:`gather_logits` the full logits (inference; builds ``[..., V]``).

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


# ----------------------------------------------------------------------------------------------
# FSDP2 (ModelParallelStrategy)
# ----------------------------------------------------------------------------------------------

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _fsdp2():
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    except ImportError:  # torch 2.4/2.5
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    return FSDPModule, fully_shard, register_fsdp_forward_method


def register_fsdp_step_methods(module: nn.Module) -> list:
    """Registers the step methods that a LightningModule overrides as FSDP2 forward methods; returns their
    names. A no-op for a module that is not FSDP2-sharded, and for methods already registered.

    FSDP2 unshards a module's parameters around ``forward`` only. Lightning calls ``training_step`` (and the
    other steps) directly, and :class:`~lightning_flce.FLCEMixin` computes the loss inside them, so the
    parameters that the root FSDP unit manages (e.g. the embeddings, and a head tied to them) would still be
    sharded ``DTensor`` s there.
    """
    fsdp_module, _, register = _fsdp2()
    if not isinstance(module, fsdp_module):
        return []
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    registered = []
    for name in _STEP_METHODS:
        if name in module.__dict__:  # already patched on the instance (by the user or an earlier call)
            continue
        if isinstance(module, pl.LightningModule) and not is_overridden(name, module, pl.LightningModule):
            continue
        if callable(getattr(module, name, None)):
            register(module, name)
            registered.append(name)
    return registered


def fully_shard_lm(
    module: nn.Module,
    mesh: Optional[Any] = None,
    *,
    blocks: Iterable[nn.Module] = (),
    head: Optional[nn.Module] = None,
    register_steps: bool = True,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """FSDP2 for a language model that computes its loss with FLCE: ``fully_shard`` each of ``blocks``, the
    (untied) ``head`` as its own unit, then ``module`` as the root; then :func:`register_fsdp_step_methods`.

    Call it in ``configure_model`` under Lightning's ``ModelParallelStrategy``::

        def configure_model(self):
            if self.device_mesh is not None:
                fully_shard_lm(self, self.device_mesh["data_parallel"], blocks=self.blocks, head=self.lm_head)

    A head tied to the input embedding must stay in the root unit (``head=None``): FSDP2 cannot shard one
    parameter in two units, and this raises instead. The head's weight is unsharded by its own forward
    call (or the root's), which is where the fused loss reads it, so the op always sees the full ``[V, H]``
    weight and the gradient lands, reduce-scattered, in the sharded parameter. ``fully_shard_kwargs`` (e.g.
    ``mp_policy``, ``reshard_after_forward``) go to every ``fully_shard`` call. A module that is already
    sharded is left as it is (``configure_model`` may run again, e.g. for ``trainer.validate`` after ``fit``).
    """
    fsdp_module, fully_shard, _ = _fsdp2()
    if isinstance(module, fsdp_module):
        if register_steps:
            register_fsdp_step_methods(module)
        return module
    if head is not None:
        head_params = {id(p) for p in head.parameters()}
        head_modules = {id(m) for m in head.modules()}
        outside = {
            id(p) for m in module.modules() if id(m) not in head_modules for p in m.parameters(recurse=False)
        }
        if head_params & outside:
            raise ValueError(
                "the head shares a parameter with the rest of the model (tied embeddings): leave it in the root"
                " unit (head=None)"
            )
    for block in blocks:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    if head is not None:
        fully_shard(head, mesh=mesh, **fully_shard_kwargs)
    fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    if register_steps:
        register_fsdp_step_methods(module)
    return module


# ----------------------------------------------------------------------------------------------
# Implementation
# ----------------------------------------------------------------------------------------------


class _Plan(NamedTuple):
    """What every rank agreed on in :func:`_layout`, plus the loss options."""

    group: Optional[dist.ProcessGroup]
    vocab_start: int
    vocab: int
    n_valid: int
    chunk_size: int
    compute_dtype: torch.dtype
    accum: str
    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float
    use_triton: bool  # the Triton shard kernels (CUDA, or the interpreter) rather than their PyTorch twin
    sequence_parallel: bool  # inputs are this rank's tokens: gathered in, dX reduce-scattered out


def _call(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    *,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    class_weight: Optional[Tensor] = None,
    impl: str = "auto",
    sequence_parallel: bool = False,
    compute_stats: bool,
) -> FLCEOutput:
    # Raised on this rank only: without a process group there is no collective to tell the others through.
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_fused_linear_cross_entropy needs an initialized torch.distributed")
    group = _call_group(weight, group)
    sequence_parallel = bool(sequence_parallel)
    # The argument checks of this rank: an error is re-raised after the agreement all-reduce, which every
    # rank must join (a rank raising before it would leave the others waiting there).
    failure = row = None
    try:
        if class_weight is not None:
            raise NotImplementedError(
                "class_weight is not supported by the vocab-parallel op (its normalizer and smoothing term would"
                " need the weights of every shard); use fused_linear_cross_entropy on the full weight"
            )
        input, weight, bias = _from_dtensors(input, weight, bias)
        compute_dtype = _check_inputs(input, weight, target, bias, None)
        token_shape = target.shape  # this rank's tokens: the shape of "none"'s losses and of the statistics
        target, ignore_index = _class_indices(target, ignore_index)
        _check_options(reduction, label_smoothing, lse_square_scale, softcap, accum_dtype, chunk_size, impl)
        use_triton = chunk_kernels_use_triton(_resolve_impl(impl, input.device), compute_dtype)
        accum = _accum_mode(accum_dtype, weight, compute_dtype)
        grad_enabled = torch.is_grad_enabled()
        needs = (
            grad_enabled and input.requires_grad,
            grad_enabled and weight.requires_grad,
            grad_enabled and bias is not None and bias.requires_grad,
        )
        row = _agreement_row(
            input,
            weight,
            target,
            vocab_start=vocab_start,
            ignore_index=int(ignore_index),
            reduction=reduction,
            chunk_size=chunk_size,
            compute_dtype=compute_dtype,
            need_grad_input=needs[0],
            compute_stats=compute_stats,
            sequence_parallel=sequence_parallel,
            has_bias=bias is not None,
            loss_options=(float(label_smoothing), float(lse_square_scale), float(softcap or 0.0)),
        )
    except Exception as exc:
        failure = exc
    rows = _agree(row, failure, group, _agreement_device(input, group))
    layout = _layout(
        rows,
        rank=dist.get_rank(group),
        chunk_size=chunk_size,
        compute_dtype=compute_dtype,
        on_gpu=input.device.type == "cuda",
    )
    local_input = input
    # After the agreement: every rank holds as many tokens, of one hidden size and dtype.
    if sequence_parallel:
        input, target = _gather_tokens(input, target, group)
    if not layout.targets_in_range:  # the same targets on every rank now: the same message
        raise _target_range_error(target, layout.vocab, int(ignore_index))
    plan = _Plan(
        group=group,
        vocab_start=layout.vocab_start,
        vocab=layout.vocab,
        n_valid=layout.n_valid,
        chunk_size=layout.chunk_size,
        compute_dtype=compute_dtype,
        accum=accum,
        ignore_index=int(ignore_index),
        label_smoothing=float(label_smoothing),
        lse_square_scale=float(lse_square_scale),
        softcap=float(softcap) if softcap is not None else 0.0,
        use_triton=use_triton,
        sequence_parallel=sequence_parallel,
    )
    loss, lse, correct, entropy = _VocabParallelFLCE.apply(
        local_input, weight, target, bias, plan, reduction, compute_stats, needs, input
    )
    return _shaped_like_target(FLCEOutput(loss, lse, correct, entropy), token_shape, reduction, compute_stats)


def _call_group(weight: Tensor, group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The call's process group: a DTensor weight's 1-D mesh's (``group``, if given, must be the same), else
    ``group``. Its errors raise on this rank only (no group to agree through)."""
    api = dtensor_api()
    if api is None or not isinstance(weight, api.DTensor):
        return group
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"a DTensor weight must be Shard(0) on a 1-D mesh, got {weight.placements} on a {mesh.ndim}-D mesh"
        )
    mesh_group = mesh.get_group()
    if group is not None and group != mesh_group:
        raise ValueError("group differs from the process group of the DTensor weight's mesh")
    return mesh_group


def _from_dtensors(
    input: Tensor, weight: Tensor, bias: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Local tensors of a ``Shard(0)`` DTensor weight (and bias) on a 1-D mesh (see :func:`_call_group`) whose
    ranks are in ascending order; a ``Replicate`` DTensor input becomes its local tensor. Plain tensors pass
    through."""
    api = dtensor_api()
    if api is None:  # pragma: no cover - torch without distributed
        return input, weight, bias
    DTensor, Replicate, Shard = api.DTensor, api.Replicate, api.Shard
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if tuple(weight.placements) != (Shard(0),):
            raise ValueError(
                f"a DTensor weight must be Shard(0) on a 1-D mesh, got {weight.placements} on a {mesh.ndim}-D mesh"
            )
        mesh_ranks = mesh.mesh.flatten().tolist()  # the same list on every rank: all raise or none
        if mesh_ranks != sorted(mesh_ranks):
            raise ValueError(
                f"a DTensor weight's mesh must list its ranks in ascending order, got {mesh_ranks}: shards are"
                " placed in process-group rank order (and torch's own scatter/gather disagree on such meshes)"
            )
        weight = weight.to_local()
        if isinstance(bias, DTensor):
            if tuple(bias.placements) != (Shard(0),) or bias.device_mesh != mesh:
                raise ValueError(
                    f"a DTensor bias must be Shard(0) on the weight's mesh, got {bias.placements}"
                )
            bias = bias.to_local()
    elif isinstance(bias, DTensor):
        raise ValueError("the bias is a DTensor but the weight is not")
    if isinstance(input, DTensor):
        if any(p != Replicate() for p in input.placements):
            raise ValueError(f"a DTensor input must be replicated, got {input.placements}")
        input = input.to_local()
    return input, weight, bias


def _agreement_row(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    vocab_start: Optional[int],
    ignore_index: int,
    reduction: str,
    chunk_size: Optional[int],
    compute_dtype: torch.dtype,
    need_grad_input: bool,
    compute_stats: bool,
    sequence_parallel: bool,
    has_bias: bool = False,
    loss_options: Tuple[float, ...] = (),
) -> Tensor:
    """This rank's int64 row of the agreement table (see :func:`_layout`): its shard, its tokens' count and
    target statistics, and codes of what must agree."""
    device = input.device
    flat_target = target.reshape(-1).long()
    n_tokens = flat_target.numel()
    valid = flat_target != ignore_index
    big = torch.iinfo(torch.int64).max
    target_min = torch.where(valid, flat_target, big).amin() if n_tokens else flat_target.new_tensor(big)
    target_max = torch.where(valid, flat_target, -big).amax() if n_tokens else flat_target.new_tensor(-big)
    # sum over tokens of ((target, position) mixed, squared) mod a prime: not linear in the targets, so
    # differing targets (a permutation among positions included) change it but with chance ~1 / 2^31
    mixed = (
        (flat_target % _FINGERPRINT_PRIME + 1) * 65537 + torch.arange(n_tokens, device=device)
    ) % _FINGERPRINT_PRIME
    fingerprint = (mixed * mixed % _FINGERPRINT_PRIME).sum() % (1 << 40)
    # must agree as well (a bias on some ranks only would leave the others' logits without it)
    flags = (
        int(need_grad_input) | int(compute_stats) << 1 | _REDUCTION_CODES[reduction] << 2 | int(has_bias) << 4
    )
    # fp16 and bf16 have one itemsize: compare the dtypes themselves (input's and the GEMMs')
    dtypes = _DTYPE_CODES.get(input.dtype, 0) * 16 + _DTYPE_CODES.get(compute_dtype, 0)
    # Python's hash of ints and floats is the same in every process (no hash randomization for numbers).
    # The target's shape too (the shape of "none"'s losses), where every rank holds the same tokens.
    shape = () if sequence_parallel else tuple(target.shape)
    options = hash((ignore_index, *loss_options, shape)) & ((1 << 62) - 1)
    return torch.stack(
        [
            flat_target.new_tensor(0),
            flat_target.new_tensor(int(sequence_parallel)),
            flat_target.new_tensor(int(vocab_start is not None)),
            flat_target.new_tensor(int(vocab_start) if vocab_start is not None else 0),
            flat_target.new_tensor(weight.shape[0]),
            flat_target.new_tensor(weight.shape[1]),
            flat_target.new_tensor(n_tokens),
            valid.sum(),
            target_min,
            target_max,
            fingerprint,
            flat_target.new_tensor(int(chunk_size) if chunk_size is not None else 0),
            flat_target.new_tensor(dtypes),
            flat_target.new_tensor(flags),
            flat_target.new_tensor(options),
        ]
    )


def _agreement_device(input: Any, group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the agreement table lives: the input's device, or CUDA's under NCCL (a rank whose input is not
    a CUDA tensor, a bad argument, must still join the all-reduce)."""
    device = input.device if isinstance(input, Tensor) else torch.device("cpu")
    if device.type != "cuda" and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _agree(
    row: Optional[Tensor],
    failure: Optional[Exception],
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> Sequence[Sequence[int]]:
    """Every rank's agreement row, through one int64 all-reduce (one host sync): the call's first collective,
    joined by every rank whatever its argument checks raised (``failure``; it then sends only the flag). If
    any rank's checks failed, every rank raises: that rank its own error, the others one of the same type
    naming it (its message cannot be sent)."""
    table = torch.zeros(dist.get_world_size(group), _N_COLUMNS, dtype=torch.int64, device=device)
    rank = dist.get_rank(group)
    if failure is None:
        table[rank] = row
    else:
        table[rank, _C_FAILED] = 1 + next(
            (i for i, kind in enumerate(_PEER_ERROR_TYPES) if isinstance(failure, kind)),
            _PEER_ERROR_TYPES.index(RuntimeError),
        )
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    rows: Sequence[Sequence[int]] = table.tolist()
    if failure is not None:
        raise failure
    failed = [r for r, values in enumerate(rows) if values[_C_FAILED]]
    if failed:
        kind = _PEER_ERROR_TYPES[rows[failed[0]][_C_FAILED] - 1]
        raise kind(
            f"rank(s) {failed} of the vocab-parallel group failed their argument checks ({kind.__name__} on"
            f" rank {failed[0]}); see that rank's error"
        )
    return rows


class _Layout(NamedTuple):
    """What the agreement rows say, the same on every rank."""

    vocab_start: int
    vocab: int
    n_valid: int  # over all ranks' tokens with sequence parallelism
    chunk_size: int
    targets_in_range: bool  # the caller raises otherwise, once it holds every token


def _layout(
    rows: Sequence[Sequence[int]],
    *,
    rank: int,
    chunk_size: Optional[int],
    compute_dtype: torch.dtype,
    on_gpu: bool,
) -> _Layout:
    """The shard layout and chunk size from every rank's agreement row (:func:`_agreement_row`); raises the
    same error on every rank where the ranks disagree. Without sequence parallelism every rank holds the same
    tokens, so their counts and target fingerprints must be equal; with it each holds its own (as many on
    every rank): the counts of non-ignored targets add up, the target bounds combine by min / max."""

    def column(index: int) -> list:
        return [r[index] for r in rows]

    if len(set(column(_C_SEQUENCE_PARALLEL))) > 1:
        raise ValueError(
            "the ranks of the vocab-parallel group disagree on sequence_parallel:"
            f" {[bool(flag) for flag in column(_C_SEQUENCE_PARALLEL)]}; give the same on every rank"
        )
    sequence_parallel = bool(rows[0][_C_SEQUENCE_PARALLEL])
    must_agree = [
        (_C_HIDDEN, "hidden sizes (weight columns)"),
        (_C_TOKENS, "numbers of tokens"),
        (_C_VALID, "numbers of non-ignored targets"),
        (_C_FINGERPRINT, "targets"),
        (_C_CHUNK, "chunk_size"),
        (_C_DTYPES, "input or compute dtypes"),
        (_C_FLAGS, "reduction, stats, bias (given or not) or input.requires_grad"),
        (_C_OPTIONS, "ignore_index, label_smoothing, lse_square_scale, softcap or target shape"),
        (_C_START_GIVEN, "use of vocab_start (give it on every rank or on none)"),
    ]
    tokens = column(_C_TOKENS)
    if sequence_parallel:
        if len(set(tokens)) > 1:
            raise ValueError(f"sequence_parallel needs the same number of tokens on every rank, got {tokens}")
        input_dtypes = {code // 16 for code in column(_C_DTYPES)}
        if len(set(column(_C_HIDDEN))) > 1 or len(input_dtypes) > 1:
            raise ValueError(
                "sequence_parallel needs the same hidden size and input dtype on every rank (the tokens are"
                " all-gathered as one tensor)"
            )
        must_agree = [(index, what) for index, what in must_agree if index not in (_C_VALID, _C_FINGERPRINT)]
    for index, what in must_agree:
        if len(set(column(index))) > 1:
            raise ValueError(
                f"the ranks of the vocab-parallel group disagree on their {what}: {column(index)}; input, target"
                " and options must be the same on every rank"
            )
    sizes = column(_C_ROWS)
    if min(sizes) < 1:
        raise ValueError(f"every rank needs at least one vocabulary row, got shard sizes {sizes}")
    vocab = sum(sizes)
    if rows[0][_C_START_GIVEN]:
        starts = column(_C_START)
        spans = sorted(zip(starts, sizes))
        covered = 0
        for start, size in spans:
            if start != covered:
                raise ValueError(
                    f"the shards (vocab_start, rows) {list(zip(starts, sizes))} do not tile [0, {vocab}) exactly"
                )
            covered += size
        start = starts[rank]
    else:
        start = sum(sizes[:rank])

    n_tokens = sum(tokens) if sequence_parallel else tokens[0]
    n_valid = sum(column(_C_VALID)) if sequence_parallel else rows[0][_C_VALID]
    in_range = min(column(_C_TARGET_MIN)) >= 0 and max(column(_C_TARGET_MAX)) < vocab
    if chunk_size is None:
        # The same on every rank: chunk boundaries must line up for the per-chunk collectives.
        # On a GPU the GEMM-side rule (>= 4096 rows while the logits fit in dX + dW): each chunk reads and
        # writes the whole dW accumulator, and the CPU rule's 128 MiB of fp32 temporaries meant ~128-row
        # chunks at 64K local columns. The softmax's temporaries are bounded by row slices instead.
        itemsize = torch.empty((), dtype=compute_dtype).element_size()
        max_rows = default_chunk_size(n_tokens, max(sizes), rows[0][_C_HIDDEN], itemsize, use_triton=on_gpu)
        chunk_size = balanced_chunk_rows(n_valid, max_rows, _FLOOR_LIMITED_ALIGN if on_gpu else _CHUNK_ALIGN)
    return _Layout(start, vocab, n_valid, int(chunk_size), in_range)


def _target_range_error(target: Tensor, vocab: int, ignore_index: int) -> ValueError:
    flat_target = target.reshape(-1)
    bad = flat_target[(flat_target != ignore_index) & ((flat_target < 0) | (flat_target >= vocab))]
    return ValueError(
        f"{bad.numel()} target(s) outside [0, {vocab}) and not ignore_index={ignore_index},"
        f" e.g. {bad[:5].tolist()}"
    )


class _VocabParallelFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, bias, plan: _Plan, reduction: str, compute_stats: bool, needs, x_all):
        # x: this rank's input (what autograd sees); x_all: every token's (x itself without sequence parallelism)
        need_gx, need_gw, need_gb = needs
        grads_now = reduction != "none"
        # dW stays in its accumulator's dtype until backward casts it with grad_output folded in (see op.py)
        n_chunks = -(-plan.n_valid // plan.chunk_size)
        grad_weight_dtype = _accumulator_dtype(plan.accum, weight, plan.compute_dtype, n_chunks)
        with torch.autocast(x.device.type, enabled=False):
            ce_scale, z_scale = _loss_scales(
                target,
                reduction,
                LossOptions(ignore_index=plan.ignore_index),
                x.device,
                softmax_dtype(plan.compute_dtype),
            )
            loss, lse, correct, entropy, gx, gw, gb, scales = _chunk_loop(
                x_all,
                weight,
                target,
                bias,
                plan,
                ce_scale=ce_scale,
                z_scale=z_scale,
                need_grad_input=need_gx and grads_now,
                need_grad_weight=need_gw and grads_now,
                need_grad_bias=need_gb and grads_now,
                compute_stats=compute_stats,
                keep_scaled=True,
                grad_weight_dtype=grad_weight_dtype,
            )
        # the per-token results are the same on every rank: reduce them whole, or keep this rank's tokens'
        if reduction != "none":
            loss = loss.sum()
        elif plan.sequence_parallel:
            loss = _local_rows(loss, plan.group)
        if plan.sequence_parallel:
            lse, correct, entropy = (_local_rows(t, plan.group) for t in (lse, correct, entropy))
        if gx is not None:
            gx = gx.view(x.shape)
        ctx.plan, ctx.reduction, ctx.needs, ctx.input_shape = plan, reduction, needs, x.shape
        ctx.weight_dtype = weight.dtype
        ctx.stored_scales = scales[1:]  # the powers of two fp16 dX, dW, d bias carry (1 otherwise)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for t in (lse, correct, entropy) if t is not None))
        if reduction == "none":
            ctx.save_for_backward(x_all, weight, target, bias)
        else:
            ctx.save_for_backward(gx, gw, gb)
        return loss, lse, correct, entropy

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grads = [None] * 9
        if grad_loss is None:
            return tuple(grads)
        need_gx, need_gw, need_gb = ctx.needs
        if ctx.reduction == "none":
            x_all, weight, target, bias = ctx.saved_tensors
            scale = grad_loss.reshape(-1).to(softmax_dtype(ctx.plan.compute_dtype))
            if ctx.plan.sequence_parallel:  # every rank's chunks need every token's grad_output
                scale = _gather_rows(scale.contiguous(), ctx.plan.group)
            with torch.autocast(x_all.device.type, enabled=False):
                *_, gx, gw, gb, _ = _chunk_loop(
                    x_all,
                    weight,
                    target,
                    bias,
                    ctx.plan,
                    ce_scale=scale,
                    z_scale=scale,
                    need_grad_input=need_gx,
                    need_grad_weight=need_gw,
                    need_grad_bias=need_gb,
                    compute_stats=False,
                )
            if gx is not None:
                gx = gx.view(ctx.input_shape)
        else:
            check_single_backward(ctx)
            gx, gw, gb = ctx.saved_tensors
            fx, fw, fb = (grad_loss if stored == 1.0 else grad_loss / stored for stored in ctx.stored_scales)
            # A wide dW accumulator is cast to the weight's dtype and scaled in one pass.
            if gw is not None and gw.dtype != ctx.weight_dtype:
                gw = scale_into(torch.empty_like(gw, dtype=ctx.weight_dtype), gw, fw.float())
            elif gw is not None:
                scale_(gw, fw)
            for grad, factor in ((gx, fx), (gb, fb)):
                if grad is not None:
                    scale_(grad, factor)
        grads[0] = gx if need_gx else None
        grads[1] = gw if need_gw else None
        grads[3] = gb if need_gb else None
        return tuple(grads)


def _gather_rows(local: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Every rank's ``local`` rows, concatenated in rank order (same row count on every rank)."""
    world = dist.get_world_size(group)
    out = local.new_empty(world * local.shape[0], *local.shape[1:])
    all_gather_single(out, local.contiguous(), group=group)
    return out


def _local_rows(full: Optional[Tensor], group: Optional[dist.ProcessGroup]) -> Optional[Tensor]:
    """This rank's block of the rows of ``full`` (rank-major, equal blocks)."""
    if full is None:
        return None
    rows = full.shape[0] // dist.get_world_size(group)
    rank = dist.get_rank(group)
    return full[rank * rows : (rank + 1) * rows].clone()  # not a view of a forward temporary


def _gather_tokens(
    input: Tensor, target: Tensor, group: Optional[dist.ProcessGroup]
) -> Tuple[Tensor, Tensor]:
    """Sequence parallelism: all ranks' tokens, ``[sum N_r, H]`` and ``[sum N_r]`` (the agreement checked that
    every rank holds as many, of one hidden size and dtype)."""
    hidden = input.reshape(-1, input.shape[-1]).detach()
    return _gather_rows(hidden, group), _gather_rows(target.reshape(-1), group)


def _chunk_loop(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    plan: _Plan,
    *,
    ce_scale: Tensor,
    z_scale: Tensor,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    compute_stats: bool,
    keep_scaled: bool = False,
    grad_weight_dtype: Optional[torch.dtype] = None,
) -> Tuple[Optional[Tensor], ...]:
    """The op's chunk loop (:func:`lightning_flce.op.run_chunks`) on a shard: per-token loss/LSE/stats [N]
    (replicated), the gradients (dX [N, H] all-reduced over the group, or with sequence parallelism this
    rank's reduce-scattered rows; dW, db local rows; None for gradients not asked for) and their
    :class:`~lightning_flce.op.GradScales` (``keep_scaled`` and ``grad_weight_dtype`` as in ``run_chunks``)."""
    target = target.reshape(-1)

    def chunk_cross_entropy(logits, chunk_target, chunk_ce_scale, chunk_z_scale, compute_grad):
        return ChunkOutputs(
            *_shard_chunk(
                logits,
                chunk_target,
                plan,
                ce_scale=chunk_ce_scale,
                z_scale=chunk_z_scale,
                compute_grad=compute_grad,
                compute_stats=compute_stats,
            )
        )

    # Each rank's partial dX is summed over the group: in fp32 at least, so fp16/bf16 partials are not
    # rounded before the sum.
    reduce_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    *per_token, grad_input, grad_weight, grad_bias, scales = run_chunks(
        x,
        weight,
        target,
        bias,
        chunk_cross_entropy,
        LossOptions(plan.ignore_index, plan.label_smoothing, plan.lse_square_scale, plan.softcap),
        rows=valid_rows(target != plan.ignore_index, plan.n_valid),
        n_valid=plan.n_valid,
        chunk_size=plan.chunk_size,
        ce_scale=ce_scale,
        z_scale=z_scale,
        compute_dtype=plan.compute_dtype,
        need_grad_input=need_grad_input,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
        compute_stats=compute_stats,
        accum=plan.accum,
        grad_input_dtype=reduce_dtype,
        keep_scaled=keep_scaled,
        grad_weight_dtype=grad_weight_dtype,
    )
    if grad_input is not None:
        grad_input = grad_input.view(-1, x.shape[-1])
        if plan.sequence_parallel:  # this rank's tokens only: reduce-scatter instead of all-reduce
            local = grad_input.new_empty(grad_input.shape[0] // dist.get_world_size(plan.group), x.shape[-1])
            reduce_scatter_single(local, grad_input, op=dist.ReduceOp.SUM, group=plan.group)
            grad_input = local
        else:
            dist.all_reduce(grad_input, op=dist.ReduceOp.SUM, group=plan.group)
        grad_input = grad_input.to(x.dtype)
    return (*per_token, grad_input, grad_weight, grad_bias, scales)


def _shard_chunk(
    logits: Tensor,
    target: Tensor,
    plan: _Plan,
    *,
    ce_scale: Tensor,
    z_scale: Tensor,
    compute_grad: bool,
    compute_stats: bool,
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """One chunk of non-ignored rows on this rank's columns: the loss rows and global LSE (and stats), and
    with ``compute_grad`` ``logits`` overwritten with d loss / d logits of the local columns.

    Same formulas as :mod:`lightning_flce.kernels.cross_entropy` (without class weights): one read of the
    local logits for per-row statistics relative to the local maximum (:func:`shard_row_stats`), two
    all-reduces on [k, C] vectors that make them global, and one read + write for the gradient.
    """
    group = plan.group
    n_rows = logits.shape[0]
    vocab = plan.vocab
    eps = plan.label_smoothing
    lam = plan.lse_square_scale
    local_target = target - plan.vocab_start
    local = shard_row_stats(
        logits,
        local_target,
        softcap=plan.softcap,
        with_z_sum=eps > 0.0,
        with_stats=compute_stats,
        use_triton=plan.use_triton,
    )
    row_max = local.max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    rescale = (local.max - row_max).exp()  # this shard's sums, relative to the global maximum
    sums = [local.sum_exp * rescale, local.z_target]
    if eps > 0.0:
        sums.append(local.z_sum)
    if compute_stats:
        sums.append(local.exp_z_sum * rescale)
        # first global index of the row maximum: from the first shard (in V order) that holds it
        first = torch.where(local.max == row_max, local.argmax + plan.vocab_start, vocab)
        neg_first = -first
        dist.all_reduce(neg_first, op=dist.ReduceOp.MAX, group=group)
    summed = torch.stack(sums)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    sum_exp, z_target = summed[0], summed[1]
    lse = row_max + sum_exp.log()

    ce_scale = ce_scale.to(lse.dtype)
    z_scale = z_scale.to(lse.dtype)
    ce = (1.0 - eps) * (lse - z_target)
    if eps > 0.0:
        ce = ce + eps * (lse - summed[2] / vocab)
    loss = ce_scale * ce + z_scale * lam * lse.square()

    correct = entropy = None
    if compute_stats:
        correct = -neg_first == target
        entropy = lse - summed[-1] / sum_exp

    if compute_grad:
        # softmax * (ce_scale + 2 z_scale lam lse) - ce_scale eps / V - ce_scale (1 - eps) one-hot
        shard_softmax_grad(
            logits,
            local_target,
            lse,
            (ce_scale + z_scale * 2.0 * lam * lse).expand(n_rows).contiguous(),
            (ce_scale * eps / vocab).expand(n_rows).contiguous() if eps > 0.0 else None,
            (ce_scale * (1.0 - eps)).expand(n_rows).contiguous(),
            softcap=plan.softcap,
            use_triton=plan.use_triton,
        )
    return loss, lse, correct, entropy
