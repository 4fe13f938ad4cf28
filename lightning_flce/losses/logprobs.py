"""Per-token log-probabilities and entropy as a chunk loss: outputs ``log p(target)`` and (on request) the entropy
``H`` of ``softmax(softcap(logits) / T)``, and, given per-token upstream gradients ``g = dL/d log p`` and
``h = dL/dH``, the logit gradient of ``L``.

Per chunk: the backend's row-statistics kernel (one read of the logits: LSE, log p, H), then
:meth:`LogProbsChunkLoss.row_terms` (g and h per row, from the side inputs; a subclass may compute them from
log p and H: a per-token loss whose gradient is then known in the same pass), then the backend's gradient kernel
(a second read, the gradient written in place). The backward of :func:`~lightning_flce.rl.logprobs.fused_linear_logprobs`
runs it with the upstream gradients as side inputs (the chunks recomputed, as for ``reduction="none"``).
"""

from __future__ import annotations

import math
import types
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.chunk_loss import ChunkLoss, OutputSpec
from lightning_flce.kernels.logprobs_torch import WORKSPACE_COPIES


class LogProbsChunkLoss(ChunkLoss):
    """Outputs (logprobs, entropy); side inputs ``inv_temperature`` (1 / T, [1] or [N]) and, for a gradient,
    ``grad_logprobs`` and ``grad_entropy`` ([1] or [N]; ``grad_entropy`` only with an entropy term).

    ``kernels``: a backend's module (its ``logprob_row_stats`` and ``logprob_grad``); ``with_entropy``: compute
    the entropy (output, and its term in the gradient when ``grad_entropy`` is given); ``vocab``: for the fp16
    bound.
    """

    linear_inputs = ("grad_logprobs", "grad_entropy")
    workspace_copies = WORKSPACE_COPIES

    def __init__(
        self,
        kernels: types.ModuleType,
        *,
        inv_temperature: Tensor,
        softcap: float,
        with_entropy: bool,
        vocab: int,
        grad_logprobs: Optional[Tensor] = None,
        grad_entropy: Optional[Tensor] = None,
    ) -> None:
        self.kernels = kernels
        self.softcap_value = softcap
        self.with_entropy = with_entropy
        self.vocab = vocab
        self.inputs: Dict[str, Tensor] = {"inv_temperature": inv_temperature}
        if grad_logprobs is not None:
            self.inputs["grad_logprobs"] = grad_logprobs
        if grad_entropy is not None:
            self.inputs["grad_entropy"] = grad_entropy

    def outputs(self) -> Tuple[OutputSpec, ...]:
        return (OutputSpec("logprobs"), OutputSpec("entropy", active=self.with_entropy))

    def side_inputs(self) -> Dict[str, Tensor]:
        return self.inputs

    def set_side_inputs(self, values: Dict[str, Tensor]) -> None:
        self.inputs = {**self.inputs, **values}

    def fp16_logit_grad_bound(self) -> Tensor:
        """``(|g| + |h| (1/e + log V)) / T`` per token: ``|g (δ - p_j)| <= |g|`` summing to ``2 |g|`` over a row,
        ``|h p_j (log p_j + H)| <= |h| (1/e + H)`` summing to ``2 |h| H``, ``H <= log V``; the softcap's factor
        is at most 1."""
        bound = self.inputs["grad_logprobs"].abs()
        if "grad_entropy" in self.inputs:
            bound = bound + self.inputs["grad_entropy"].abs() * (1.0 / math.e + math.log(max(self.vocab, 2)))
        bound = bound * self.inputs["inv_temperature"]
        # rows that carry no loss may hold any temperature (padding); a valid one that is not finite raises in the
        # same host sync
        return torch.where(torch.isfinite(bound), bound, 0.0)

    def row_terms(
        self, logprobs: Tensor, entropy: Optional[Tensor], side: Dict[str, Tensor], compute_grad: bool
    ) -> Tuple[Optional[Tensor], Optional[Tensor], Tuple[Tensor, ...]]:
        """From the rows' statistics: ``(g, h, extra outputs)`` (``h`` None: no entropy term; g, h None without
        ``compute_grad``). Here g and h are the upstream gradients; a per-token loss of (log p, H) computes them
        (and its loss rows, as extra outputs after (logprobs, entropy))."""
        if not compute_grad:
            return None, None, ()
        return side["grad_logprobs"], side.get("grad_entropy") if self.with_entropy else None, ()

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
    ) -> Tuple[Optional[Tensor], ...]:
        inv_temperature = side["inv_temperature"]
        logprobs, lse, entropy = self.kernels.logprob_row_stats(
            logits,
            target,
            inv_temperature=inv_temperature,
            softcap=self.softcap_value,
            with_entropy=self.with_entropy,
        )
        grad_logprobs, grad_entropy, extra = self.row_terms(logprobs, entropy, side, compute_grad)
        if compute_grad:
            self.kernels.logprob_grad(
                logits,
                target,
                lse=lse,
                entropy=entropy,
                grad_logprobs=grad_logprobs,
                grad_entropy=grad_entropy,
                inv_temperature=inv_temperature,
                softcap=self.softcap_value,
                grad_out=grad_out,
            )
        return (logprobs, entropy, *extra)
