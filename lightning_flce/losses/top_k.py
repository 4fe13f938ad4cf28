"""Each token's k largest logits of a head and their columns, as a chunk plug-in with no loss and no gradient: what
a teacher's top-k cache stores (:func:`lightning_flce.fused_linear_top_k`, read back by
:func:`lightning_flce.fused_linear_distillation_from_top_k`).

Per chunk: ``torch.topk`` over the chunk's logits as the GEMM wrote them (the softcap is increasing, so the columns
are those of the transformed logits; ties between equal 16-bit logits go to either column), the k values
transformed in the softmax dtype, and with ``with_lse`` each row's log-sum-exp of the transformed logits from the
backend's row-statistics kernel (the log-probabilities op's first pass: one more read of the chunk). The front ends
subtract it (log-probabilities), after merging the shards' top k and log-sum-exps in the vocab-parallel one.
"""

from __future__ import annotations

import types
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.chunk_loss import ChunkLoss, OutputSpec
from lightning_flce.kernels import softmax_dtype
from lightning_flce.kernels.logprobs_torch import WORKSPACE_COPIES
from lightning_flce.kernels.transform_torch import transformed_logits


class TopKChunkLoss(ChunkLoss):
    """Outputs ``values`` ([N, k], the softmax dtype: the transformed logits; -inf at rows that carry no loss) and
    ``indices`` ([N, k] int64, 0 there), each row's in descending order, and ``lse`` ([N], the softmax dtype: each
    row's log-sum-exp of the transformed logits, computed only ``with_lse``; 0 at rows that carry no loss, so that
    ``values - lse`` stays -inf there).

    ``kernels``: a backend's module (its ``logprob_row_stats``, for the log-sum-exp); ``softcap``: 0.0 for none;
    ``unit_scale``: a [1] tensor of 1 in the softmax dtype on the logits' device, the row statistics' inverse
    temperature (made once a call: the cache holds the teacher's values without a temperature).
    """

    workspace_copies = WORKSPACE_COPIES  # the twin's row statistics (torch.topk reads the logits in place)

    def __init__(
        self, kernels: types.ModuleType, *, k: int, softcap: float, with_lse: bool, unit_scale: Tensor
    ) -> None:
        self.kernels = kernels
        self.k = k
        self.softcap_value = softcap
        self.with_lse = with_lse
        self.inputs = {"inv_temperature": unit_scale}

    def side_inputs(self) -> Dict[str, Tensor]:
        return self.inputs

    def outputs(self) -> Tuple[OutputSpec, ...]:
        return (
            OutputSpec("values", width=self.k, fill=float("-inf")),
            OutputSpec("indices", torch.int64, width=self.k),
            OutputSpec("lse", active=self.with_lse),
        )

    def __call__(
        self,
        logits: Tensor,
        target: Tensor,
        rows,
        side: Dict[str, Tensor],
        *,
        compute_grad: bool,
        grad_out: Optional[Tensor],
        tile_lse=None,
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        if compute_grad:
            raise RuntimeError("a head's top k has no gradient")
        top, indices = torch.topk(logits, self.k, dim=1)
        values, _ = transformed_logits(top.to(softmax_dtype(logits.dtype)), self.softcap_value)
        if not self.with_lse:
            return values, indices, None
        _, lse, _ = self.kernels.logprob_row_stats(
            logits,
            target,
            inv_temperature=side["inv_temperature"],
            softcap=self.softcap_value,
            with_entropy=False,
        )
        return values, indices, lse.to(values.dtype)
