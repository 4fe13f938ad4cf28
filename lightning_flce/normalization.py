"""The arithmetic of ``flce_normalize="step"``: the LM loss as the token mean of a whole optimizer step.

:class:`StepNormalizer` keeps the step's totals (loss sum, token count, micro-batches), the fp16 divisor and
the gradient scale; :class:`UnweightedTermWatch` finds a loss term that the rescaling would silently weight
~1 / tokens. Both are plain classes, tested without a Trainer; :class:`~lightning_flce.mixin.FLCEMixin` wires
them to Lightning's hooks (as Lightning's ``ThroughputMonitor`` hands its arithmetic to ``Throughput``):

.. code-block:: python

    normalizer = StepNormalizer("step")
    normalizer.start_fit(fp16_gradients=False)
    for micro_batch in step:
        loss_sum, tokens = ...  # token sum of the loss, non-ignored tokens
        normalizer.count(loss_sum, tokens)  # at forward
        normalizer.loss_to_backward(loss_sum, tokens).backward()
        normalizer.commit(global_step)  # the micro-batch was back-propagated
    finished = normalizer.finish(world_size=1, accumulation=len(step))
    scale_gradients(params, finished.grad_scale)

Counting at forward and committing at backward (rather than a tensor hook that fires in backward) keeps
the forward free of hooks, so ``torch.compile`` traces a training step without a graph break, while a
``training_step`` that returns None (a skipped batch) still adds neither loss nor tokens.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_flce.options import NORMALIZE_MODES


def power_of_two_at_least(value: float) -> float:
    return 2.0 ** math.ceil(math.log2(max(value, 1.0)))


class FinishedStep(NamedTuple):
    """An optimizer step's totals over its micro-batches and ranks."""

    #: token mean of the step's loss (0 without tokens)
    mean_loss: float
    #: the step's non-ignored tokens
    num_tokens: float
    #: factor for every gradient of the step (``"step"``), None under ``"micro_batch"``
    grad_scale: Optional[float]


class StepNormalizer:
    """Token totals of an optimizer step over micro-batches (gradient accumulation) and data-parallel ranks,
    and the factor that turns the back-propagated token sums into the gradient of the step's token mean.

    Each micro-batch back-propagates the sum of its token losses over a divisor ``D`` (1 unless the gradients
    are fp16). After the step's last backward, the gradients are multiplied by
    ``accumulation * world_size * D / tokens_of_step``: Lightning divides each micro-batch loss by
    ``accumulation`` and DDP/FSDP average over ``world_size`` ranks, which the factor undoes.

    fp16 gradients: a token sum would overflow, so ``D`` is the smallest power of two at least the tokens per
    micro-batch: first the ranks' mean label count of their first micro-batch (:meth:`agree_first_divisor`),
    then, after each step, the step's mean tokens per micro-batch where that is larger (``D`` never falls).
    A power of two changes no rounding.

    Args:
        mode: ``"step"`` (rescale at the optimizer step) or ``"micro_batch"`` (only totals for logging).
    """

    def __init__(self, mode: str = "step") -> None:
        if mode not in NORMALIZE_MODES:
            raise ValueError(f"mode must be one of {NORMALIZE_MODES}, got {mode!r}")
        self.mode = mode
        #: ``D``; None until agreed over the ranks (fp16 gradients, first micro-batch)
        self.grad_divisor: Optional[float] = 1.0
        self._pending: Optional[Tensor] = None  # counted at forward, not back-propagated yet
        self._totals: Optional[Tensor] = None  # [loss sum, tokens, micro-batches] of the step in progress
        self._step: Optional[int] = None  # the global step those totals belong to
        self._pending_unit = "tokens"  # what the pending counts count
        self._unit = "tokens"  # what the step's totals count

    @property
    def rescales(self) -> bool:
        """Whether the gradients are rescaled at the optimizer step (``"step"``)."""
        return self.mode == "step"

    def start_fit(self, fp16_gradients: bool) -> None:
        """Forgets any totals; fp16 gradients: ``D`` is agreed afresh at the first micro-batch."""
        self._pending = self._totals = self._step = None
        self.grad_divisor = None if fp16_gradients and self.rescales else 1.0

    @property
    def needs_divisor(self) -> bool:
        return self.grad_divisor is None

    def agree_first_divisor(
        self, num_labels: int, mean_over_ranks: Optional[Callable[[Tensor], Tensor]] = None
    ) -> None:
        """Sets ``D`` from this rank's label count (ignored labels included) of its first micro-batch, averaged
        over the ranks by ``mean_over_ranks`` (a collective: every rank must call it at the same point)."""
        size = torch.tensor(float(num_labels), dtype=torch.float64)
        if mean_over_ranks is not None:
            size = mean_over_ranks(size)
        self.grad_divisor = power_of_two_at_least(float(size))

    def loss_to_backward(self, loss_sum: Tensor, num_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(loss, weight): the loss's value is the micro-batch mean; under ``"step"`` its gradient is the token
        sum's over ``D``, and ``weight`` (tokens / ``D``; 1 under ``"micro_batch"``) makes another micro-batch mean
        count per token like it."""
        mean = loss_sum / num_tokens.clamp(min=1)
        if not self.rescales:
            return mean, torch.ones((), device=num_tokens.device)
        divisor = self.grad_divisor if self.grad_divisor is not None else 1.0
        return mean.detach() + (loss_sum - loss_sum.detach()) / divisor, num_tokens.float() / divisor

    def count(self, loss_sum: Tensor, num_tokens: Tensor, unit: str = "tokens") -> None:
        """Counts a micro-batch's loss sum and tokens; they join the step at :meth:`commit`.

        ``num_tokens`` is the micro-batch's share of the step's normalizer, in ``unit``: the cross-entropy's
        tokens, or a policy loss's (:func:`~lightning_flce.rl.policy_normalizer`: tokens, sequences, or
        sequences times the completion length). The losses of one step must count in one unit.

        Raises:
            ValueError: a unit other than the one the micro-batch's earlier calls counted in (against the step's
                earlier micro-batches: at :meth:`commit`).
        """
        # the unit is compared here only within a micro-batch: a compiled training step reads no state that
        # differs between micro-batches (that would recompile it)
        if self._pending is not None:
            _check_same_unit(self._pending_unit, unit)
        self._pending_unit = unit
        totals = torch.stack(
            [loss_sum.detach().double(), num_tokens.double(), num_tokens.new_ones((), dtype=torch.float64)]
        )
        self._pending = totals if self._pending is None else self._pending + totals

    def discard_pending(self) -> None:
        """Forgets what was counted but never back-propagated (a skipped batch)."""
        self._pending = None

    def commit(self, step: int) -> None:
        """The counted micro-batches were back-propagated: they join optimizer step ``step``."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.add(pending, step, self._pending_unit)

    def add(self, totals: Tensor, step: int, unit: str = "tokens") -> None:
        """Adds ``[loss sum, tokens, micro-batches]`` (the tokens counted in ``unit``) to optimizer step ``step``'s
        totals.

        Raises:
            RuntimeError: under ``"step"``, when an earlier step's totals were never finished (its gradients
                were not normalized).
            ValueError: ``unit`` is not the unit of the step's totals.
        """
        if self._totals is not None and self._step != step:
            if self.rescales:
                raise RuntimeError(
                    "The optimizer stepped without FLCEMixin normalizing the gradients of the step: an override of"
                    " `optimizer_step` or `on_before_optimizer_step` must call super() (one of the two is enough)"
                )
            self._totals = None
        if self._totals is None:
            self._totals, self._step, self._unit = totals, step, unit
        else:
            _check_same_unit(self._unit, unit)
            self._totals = self._totals + totals

    def finish(
        self,
        *,
        world_size: int = 1,
        accumulation: int = 1,
        fp16_gradients: bool = False,
        sum_over_ranks: Optional[Callable[[Tensor], Tensor]] = None,
    ) -> Optional[FinishedStep]:
        """The step's totals, summed over the ranks by ``sum_over_ranks`` (a collective), and its gradient scale;
        None if nothing was added since the last call (then the gradients are normalized already).

        Args:
            world_size: ranks whose gradients the strategy averages.
            accumulation: micro-batches whose losses Lightning divided by their number
                (``accumulate_grad_batches``; 1 in manual optimization).
            fp16_gradients: raise ``D`` to the step's tokens per micro-batch for the next step.
        """
        totals, self._totals = self._totals, None
        if totals is None:
            return None
        if sum_over_ranks is not None:
            totals = sum_over_ranks(totals)
        loss_sum, num_tokens, micro_batches = totals.tolist()
        mean_loss = loss_sum / max(num_tokens, 1.0)
        if not self.rescales:
            return FinishedStep(mean_loss, num_tokens, None)
        divisor = self.grad_divisor if self.grad_divisor is not None else 1.0
        scale = accumulation * world_size * divisor / max(num_tokens, 1.0)
        if fp16_gradients:
            # the totals are the same on every rank, so is the next step's divisor
            per_micro_batch = power_of_two_at_least(num_tokens / max(micro_batches, 1.0))
            self.grad_divisor = max(divisor, per_micro_batch)
        return FinishedStep(mean_loss, num_tokens, scale)


def _check_same_unit(earlier: str, unit: str) -> None:
    if unit != earlier:
        raise ValueError(
            f"one optimizer step counted its losses in {earlier!r} and now in {unit!r}: under"
            " flce_normalize='step' the losses of a step must share one normalizer (flce_loss counts tokens,"
            " flce_policy_loss its loss type's normalizer); use flce_normalize='micro_batch' to mix them"
        )


def scale_gradients(params, scale: float) -> None:
    """Multiplies the gradients of ``params`` (those that have one) by ``scale``, in one foreach kernel."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)


# Scalar arithmetic a loss goes through between flce_loss and backward (Lightning divides by
# accumulate_grad_batches; users scale or add flce_loss outputs, e.g. two heads).
_ARITHMETIC_NODES = frozenset(
    {"AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "NegBackward0"}
)


class UnweightedTermWatch:
    """Finds, once, a back-propagated loss with terms besides the LM loss that were not multiplied by the
    LM loss's weight (under ``"step"`` such a term is silently weighted ~1 / tokens).

    :meth:`record` each LM loss of a micro-batch, :meth:`mark_weight_read` when the step reads the weight,
    and ask :meth:`should_warn` with the loss about to be back-propagated (it then forgets the micro-batch).
    """

    #: LM losses remembered per micro-batch (bounded: hooks overridden without super() never clear them)
    MAX_NODES = 16

    def __init__(self) -> None:
        self.warned = False
        self._nodes: list = []
        self._weight_read = False

    def record(self, loss: Tensor) -> None:
        # a compiled graph cannot be walked (and reading grad_fn there would break it)
        if self.warned or torch.compiler.is_compiling() or loss.grad_fn is None:
            return
        self._nodes = [*self._nodes[-(self.MAX_NODES - 1) :], loss.grad_fn]

    def mark_weight_read(self) -> None:
        self._weight_read = True

    def reset(self) -> None:
        """Forgets the micro-batch (at its start: a skipped backward leaves its nodes behind)."""
        self._nodes, self._weight_read = [], False

    def should_warn(self, loss: Tensor) -> bool:
        """Whether to warn about ``loss`` (True at most once); forgets the micro-batch."""
        nodes, weight_read = self._nodes, self._weight_read
        self.reset()
        if self.warned or not nodes or weight_read or not has_other_terms(loss, nodes):
            return False
        self.warned = True
        return True


def has_other_terms(loss: Tensor, lm_loss_nodes: list) -> bool:
    """Whether ``loss``'s graph, followed through arithmetic only, reaches one of ``lm_loss_nodes`` (the
    ``grad_fn`` of the LM losses) and something else but constants. A graph the walk cannot see into (a
    compiled region, say) counts as no: the warning is for the plain case, never a false alarm."""
    found_lm_loss = found_other = False
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if any(node is lm_node for lm_node in lm_loss_nodes):
            found_lm_loss = True
        elif type(node).__name__ in _ARITHMETIC_NODES:
            stack.extend(next_node for next_node, _ in node.next_functions)
        else:
            found_other = True
    return found_lm_loss and found_other
