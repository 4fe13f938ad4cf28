"""The chunk-loss plug-in interface of the chunk engine (:func:`lightning_flce.engine.run_chunks`).

The engine owns everything that does not depend on the loss: the rows that carry one, the chunk size, the
logits GEMM into one reused buffer (and the wide-logits precisions), dX rows, the dW accumulation and its
dtype, d bias, and the fp16 scaling of the logit gradient. A loss is a :class:`ChunkLoss`: per chunk it gets
the chunk's logits, targets, row indices and its side inputs gathered for those rows, returns its per-row
outputs, and (when asked) writes ``d loss / d logits`` over the logits or into ``grad_out``. What the engine
needs to know of a loss it declares as data:

- :meth:`ChunkLoss.outputs`: its named per-token outputs (:class:`OutputSpec`), in the order the per-chunk
  call returns them; the engine allocates them ([N] or [N, width]; 0, or the spec's ``fill``, at rows that carry
  no loss) and writes each chunk's rows;
- :meth:`ChunkLoss.side_inputs`: its per-token inputs by name, each [N] (one value per token, gathered per
  chunk by the engine from the chunk's row indices) or [1] (shared by every token, passed as it is);
- :attr:`ChunkLoss.linear_inputs`: the side inputs its logit gradient is linear in (scales, upstream
  gradients): the engine multiplies them by the fp16 logit-gradient factor once per call;
- :meth:`ChunkLoss.fp16_logit_grad_bound`: a bound on each token's largest logit-gradient element (a row's
  elements summing to at most twice it), from which the engine picks that factor;
- :attr:`ChunkLoss.workspace_copies`: the [C, V] copies (in the softmax dtype) its PyTorch twin works on, for
  the chunk-size rule of backends whose kernels do not work in place;
- :meth:`ChunkLoss.tile_stats_suffice`: whether it can take each row's LSE and target logit from the
  compensated logits GEMM's tile statistics instead of a first pass over the logits;
- :meth:`ChunkLoss.auxiliary_head`: a second, frozen head (:class:`AuxiliaryHead`: a distillation teacher) whose
  logits the engine computes for the same rows, without a gradient, into a second reused buffer, and passes in
  ``side[name]``; on the GPU it runs the head and the loss on blocks of the chunk's rows
  (:data:`lightning_flce.engine.AUXILIARY_BLOCK_ROWS`), so a loss with an auxiliary head sees each block as a
  chunk (its per-row outputs and logit gradient must not depend on the other rows).

The plug-ins so far: the cross-entropy (:mod:`lightning_flce.losses.cross_entropy`), the per-token
log-probabilities and entropy (:mod:`lightning_flce.losses.logprobs`) and the policy losses built on them
(:mod:`lightning_flce.losses.policy`), the distillation losses with their teacher head
(:mod:`lightning_flce.losses.distillation`) and, with no loss and no gradient, each token's top k of a head
(:mod:`lightning_flce.losses.top_k`: what a cached teacher stores).
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

#: The copies of a chunk's logits a PyTorch twin works on by default (the cross-entropy's: the softmax-dtype
#: logits, their exponentials, and a temporary).
DEFAULT_WORKSPACE_COPIES = 3

Rows = Union[slice, Tensor]


class OutputSpec(NamedTuple):
    """One per-token output of a chunk loss.

    ``dtype`` None: the softmax dtype of the call (fp32; fp64 for fp64 GEMMs). ``active`` False: not computed
    this call (the engine returns an empty tensor in its place, and the per-chunk call returns None for it).
    ``gradient_scaled``: its values carry the fp16 logit-gradient factor (they are linear in
    :attr:`ChunkLoss.linear_inputs`, as the cross-entropy's scaled loss rows are); the engine divides it out.
    ``width``: None for one value a token ([N]), else that many ([N, width]: a top k's values or columns).
    ``fill``: the value of the rows that carry no loss (ignored targets), which the chunks never write.
    """

    name: str
    dtype: Optional[torch.dtype] = None
    active: bool = True
    gradient_scaled: bool = False
    width: Optional[int] = None
    fill: float = 0.0

    def shape(self, n_rows: int) -> Tuple[int, ...]:
        """The output's shape for a call of ``n_rows`` tokens (no rows when inactive)."""
        rows = n_rows if self.active else 0
        return (rows,) if self.width is None else (rows, self.width)


class AuxiliaryHead(NamedTuple):
    """A head the engine runs on the chunk's rows beside the main one, without a gradient (a distillation
    teacher's): ``logits = input[rows] @ weight.T (+ bias)`` in ``compute_dtype``, with the call's
    ``logits_precision`` (the wide precisions write fp32 logits, as the main head's; never its 16-bit relative
    logits or tile statistics), passed to the loss as ``side[name]`` ([C, V]; the engine recomputes it for each
    block, so the loss may use it as scratch once it has read it: the Triton JSD kernel does).

    ``input`` is [N, H_aux] (the call's N rows), ``weight`` [V, H_aux] with the main head's V, ``bias`` [V] or
    None. The chunk-size rule counts its buffer (:func:`lightning_flce.engine.chunk_rows`'s
    ``auxiliary_dtype``)."""

    name: str
    input: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    compute_dtype: torch.dtype


class ChunkLoss:
    """A loss the chunk engine runs on each chunk of logits (see the module docstring for the contract)."""

    #: Side inputs the logit gradient is linear in (the engine scales those present for fp16 GEMMs).
    linear_inputs: Tuple[str, ...] = ()
    #: [C, V] softmax-dtype copies the PyTorch twin needs (the chunk-size rule; in-place kernels need none).
    workspace_copies: int = DEFAULT_WORKSPACE_COPIES

    def outputs(self) -> Tuple[OutputSpec, ...]:
        """The per-token outputs, in the order :meth:`__call__` returns them."""
        raise NotImplementedError

    def side_inputs(self) -> Dict[str, Tensor]:
        """The per-token inputs by name: [N] (gathered per chunk) or [1] (shared)."""
        return {}

    def fp16_logit_grad_bound(self) -> Tensor:
        """[1] or [N] (per token exactly when a :attr:`linear_inputs` tensor is [N]): an upper bound on the
        magnitude of any element of a token's logit gradient; the elements of a row sum in magnitude to at most
        twice it. Only called for fp16 GEMMs."""
        raise NotImplementedError

    def scale_logit_gradient(self, factor: float) -> None:
        """Multiply the :attr:`linear_inputs` by ``factor`` (a power of two; the engine divides it out of the
        GEMMs' epilogues and the ``gradient_scaled`` outputs)."""
        if factor == 1.0:
            return
        inputs = self.side_inputs()
        self.set_side_inputs({name: inputs[name] * factor for name in self.linear_inputs if name in inputs})

    def set_side_inputs(self, values: Dict[str, Tensor]) -> None:
        """Replace side inputs by name (used by :meth:`scale_logit_gradient`)."""
        raise NotImplementedError

    def tile_stats_suffice(self) -> bool:
        """Whether the per-chunk call takes ``tile_lse=`` (the compensated logits GEMM's LSE partials and target
        logits) and needs nothing else of a first pass over the logits."""
        return False

    def auxiliary_head(self) -> Optional[AuxiliaryHead]:
        """A frozen second head whose chunk logits the loss reads in ``side[head.name]`` (None: none)."""
        return None

    @property
    def softcap(self) -> float:
        """The softcap the logits GEMM's tile statistics must apply (0.0: none); read with tile statistics."""
        return 0.0

    def __call__(
        self,
        logits: Tensor,
        target: Tensor,
        rows: Rows,
        side: Dict[str, Tensor],
        *,
        compute_grad: bool,
        grad_out: Optional[Tensor],
        tile_lse=None,
    ) -> Sequence[Optional[Tensor]]:
        """One chunk: ``logits`` [C, V], ``target`` [C], ``rows`` the chunk's rows among the call's N (a slice or
        an index tensor), ``side`` the side inputs of those rows. Returns the :meth:`outputs` rows ([C] each,
        None for inactive ones); with ``compute_grad`` writes ``d loss / d logits`` over ``logits`` (``grad_out``
        None) or into ``grad_out`` (which may be :func:`~lightning_flce.kernels.gradient_in_logits_rows` of
        the logits)."""
        raise NotImplementedError


def gather_side_inputs(side: Dict[str, Tensor], per_token: Tuple[str, ...], rows: Rows) -> Dict[str, Tensor]:
    """The side inputs of a chunk's ``rows``: the ``per_token`` ones indexed, the shared ones as they are."""
    if not per_token:
        return side
    chunk = dict(side)
    for name in per_token:
        chunk[name] = side[name][rows]
    return chunk
