"""A chunk loss derived by autograd from a PyTorch function of the chunk's logits: the prototyping path for a new
loss, and the test oracle of the hand-written ones.

A new per-token objective can run on the fused head before it has kernels: write its row loss as a function of
the chunk's logits (in the softmax dtype), its targets and its side inputs, and :class:`AutogradChunkLoss` runs it
on the chunk engine (:func:`lightning_flce.engine.run_chunks`) with everything the engine owns: the rows that carry
a loss, the chunk size, the logits GEMM into one reused buffer, dX rows, dW accumulation, d bias. Per chunk it
differentiates the summed row losses with :func:`torch.autograd.grad` and writes the logit gradient where the
engine expects it. It costs what autograd costs: the function's intermediates, each a [C, V] tensor in the softmax
dtype (declare how many in ``workspace_copies`` so the chunk-size rule accounts for them), and no fp16 GEMMs
unless a gradient bound is given.

The tests run the cross-entropy and the policy losses both ways (``tests/test_autograd_chunk_loss.py``): the
hand-written kernels must match the autograd-derived gradient of the same formula, chunk by chunk.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lightning_flce.chunk_loss import ChunkLoss, OutputSpec, Rows
from lightning_flce.kernels import copy_gradient, softmax_dtype

#: ``row_loss(logits, target, side) -> loss rows [C]`` or ``(loss rows, *extra rows)``: ``logits`` [C, V] in the
#: softmax dtype (a leaf that requires grad), ``target`` [C] in [0, V), ``side`` the chunk's side inputs.
RowLoss = Callable[[Tensor, Tensor, Dict[str, Tensor]], Union[Tensor, Sequence[Tensor]]]

#: The [C, V] copies a typical row loss holds for autograd (the widened logits, the log-softmax, its gradient, and
#: the temporaries of a few elementwise ops); a heavier formula declares more.
DEFAULT_AUTOGRAD_WORKSPACE = 6


class AutogradChunkLoss(ChunkLoss):
    """Outputs ``(loss, *extra)``: each chunk's ``row_loss`` rows (``extra_outputs`` names the extra ones, which
    are returned detached), the logit gradient ``d sum(loss rows) / d logits`` from autograd.

    Args:
        row_loss: the per-row loss (see :data:`RowLoss`).
        side_inputs: per-token ([N]) or shared ([1]) tensors by name, gathered per chunk by the engine.
        extra_outputs: names of the extra per-row outputs ``row_loss`` returns after the loss rows.
        linear_inputs: side inputs the loss (and so its gradient) is linear in, for the fp16 scaling.
        fp16_logit_grad_bound: a function of the side inputs giving each token's bound (see
            :meth:`ChunkLoss.fp16_logit_grad_bound`); without one, fp16 GEMMs are refused.
        workspace_copies: the [C, V] softmax-dtype tensors the formula holds at once (for the chunk-size rule).
    """

    def __init__(
        self,
        row_loss: RowLoss,
        *,
        side_inputs: Optional[Dict[str, Tensor]] = None,
        extra_outputs: Tuple[str, ...] = (),
        linear_inputs: Tuple[str, ...] = (),
        fp16_logit_grad_bound: Optional[Callable[[Dict[str, Tensor]], Tensor]] = None,
        workspace_copies: int = DEFAULT_AUTOGRAD_WORKSPACE,
    ) -> None:
        self.row_loss = row_loss
        self.inputs: Dict[str, Tensor] = dict(side_inputs or {})
        self.extra_outputs = extra_outputs
        self.linear_inputs = linear_inputs
        self.bound = fp16_logit_grad_bound
        self.workspace_copies = workspace_copies

    def outputs(self) -> Tuple[OutputSpec, ...]:
        return (OutputSpec("loss", gradient_scaled=bool(self.linear_inputs)),) + tuple(
            OutputSpec(name) for name in self.extra_outputs
        )

    def side_inputs(self) -> Dict[str, Tensor]:
        return self.inputs

    def set_side_inputs(self, values: Dict[str, Tensor]) -> None:
        self.inputs = {**self.inputs, **values}

    def fp16_logit_grad_bound(self) -> Tensor:
        if self.bound is None:
            raise NotImplementedError(
                "an AutogradChunkLoss without fp16_logit_grad_bound cannot run fp16 GEMMs (the engine scales"
                " the fp16 logit gradient by a bound of its elements); pass the bound, or use bf16 / fp32"
            )
        return self.bound(self.inputs)

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
    ) -> Tuple[Tensor, ...]:
        # The engine runs inside custom ops and backward, where grad mode may be off.
        with torch.enable_grad():
            leaf = logits.detach().to(softmax_dtype(logits.dtype)).requires_grad_(compute_grad)
            result = self.row_loss(leaf, target, side)
            rows_out = (result,) if isinstance(result, Tensor) else tuple(result)
            if len(rows_out) != 1 + len(self.extra_outputs):
                raise ValueError(
                    f"row_loss returned {len(rows_out)} tensors; expected the loss rows and"
                    f" {len(self.extra_outputs)} extra output(s) {self.extra_outputs}"
                )
            loss_rows = rows_out[0]
            if loss_rows.shape != target.shape:
                raise ValueError(
                    f"row_loss must return one value per row, shape {tuple(target.shape)}; got"
                    f" {tuple(loss_rows.shape)}"
                )
            if compute_grad:
                (grad,) = torch.autograd.grad(loss_rows.sum(), leaf)
        if compute_grad:
            copy_gradient(grad, logits if grad_out is None else grad_out)
        return tuple(value.detach() for value in rows_out)
