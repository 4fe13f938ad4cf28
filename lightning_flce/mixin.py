"""LightningModule mixin that computes the LM-head loss with fused linear cross-entropy."""

import difflib
import functools
import inspect
import math
from typing import Any, Callable, Literal, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import MeanMetric

from lightning_flce.head import FLCEHeadLoss, forward_bound_to, unwrap_head
from lightning_flce.parallel import VocabParallelHead, register_fsdp_step_methods

_NORMALIZE_MODES = ("step", "micro_batch")
_NARROW_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32)


def _check_no_unknown_flce_options(kwargs: dict, later_classes: tuple) -> None:
    """A misspelled ``flce_*`` option would otherwise reach ``LightningModule.__init__`` as an unexpected
    keyword argument of an unrelated class: name it and the option it was likely meant to be. Names that a
    class after the mixin in the MRO takes (its own ``flce_`` argument) pass on to it."""
    known = [name for name in inspect.signature(FLCEMixin.__init__).parameters if name.startswith("flce_")]
    taken_later = {
        name
        for cls in later_classes
        if "__init__" in vars(cls)
        for name in inspect.signature(cls.__init__).parameters
    }
    for name in kwargs:
        if name.startswith("flce_") and name not in taken_later:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {', '.join(known)}"
            raise TypeError(f"FLCEMixin got an unknown option {name!r}{hint}")


class _Float64Mean(MeanMetric):
    """A ``MeanMetric`` whose states stay float64. Lightning's "16-true"/"bf16-true" plugins call
    ``module.to(dtype)``, which torchmetrics (unlike ``.half()``) lets convert metric states: an fp16 sum of
    token losses overflows after a few thousand tokens, a bf16 one rounds."""

    def __init__(self) -> None:
        super().__init__()
        self.set_dtype(torch.float64)

    def _apply(self, fn, *args, **kwargs):
        this = super()._apply(fn, *args, **kwargs)
        if not self._dtype_convert and this.dtype != torch.float64:
            this.set_dtype(torch.float64)
        return this


class _NormalizeBeforeCallbacks(Callback):
    """Manual optimization: the mixin's step normalization, ahead of every other callback's hook."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Optimizer) -> None:
        if isinstance(pl_module, FLCEMixin):
            pl_module.flce_normalize_gradients()


class FLCEMixin:
    r"""Computes the LM loss of a ``LightningModule`` from its final hidden states and its LM head with
    fused linear cross-entropy, so the [N, V] logits never exist in the training or validation loss.

    Put it before ``LightningModule`` in the bases and call :meth:`flce_loss` in the steps:

    .. code-block:: python

        class MyLM(FLCEMixin, L.LightningModule):
            def __init__(self, vocab_size: int = 32000, d_model: int = 512, **kwargs):
                super().__init__(**kwargs)  # the flce_* options go to the mixin
                self.save_hyperparameters()
                self.backbone = Backbone(vocab_size, d_model)
                self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

            def training_step(self, batch, batch_idx):
                return self.flce_loss(self.backbone(batch["input_ids"]), batch["labels"])

            def validation_step(self, batch, batch_idx):
                self.flce_loss(self.backbone(batch["input_ids"]), batch["labels"])

    The options are keyword arguments of ``__init__`` (the mixin takes them out and passes the rest on), so
    ``LightningCLI`` lists them under ``model.init_args`` and ``save_hyperparameters`` records them:

    .. code-block:: yaml

        model:
          class_path: my_package.MyLM
          init_args:
            d_model: 512
            flce_chunk_size: 4096
            flce_z_loss: 1.0e-4
            flce_normalize: step

    Args:
        flce_head: attribute path of the head module from the LightningModule, e.g. ``"lm_head"`` or
            ``"model.lm_head"``. ``None``: ``get_output_embeddings()`` of the Hugging Face model that is the
            module itself or its only direct child that is one, else ``"lm_head"``. The head is looked up at every
            call (never by parameter name), so tied, resized or PEFT-wrapped heads are found as they are.
        flce_chunk_size: tokens per chunk; ``None`` lets the op choose from its memory budget.
        flce_ignore_index: label value that does not count.
        flce_label_smoothing: label smoothing of the training loss.
        flce_z_loss: z-loss coefficient (``lse_square_scale``) of the training loss.
        flce_softcap: logit soft-capping ``c * tanh(logits / c)``. For a Hugging Face head,
            ``config.final_logit_softcapping`` is used; setting a different value here is an error.
        flce_accum_fp32: always accumulate the head weight gradient over chunks in float32
            (``accum_dtype=torch.float32``); ``False`` keeps the op's default (one step wider than the
            GEMM operands when there are several chunks, see :func:`~lightning_flce.fused_linear_cross_entropy`).
        flce_impl: ``"auto"``, ``"triton"`` or ``"torch"``.
        flce_naive: compute plain logits and ``F.cross_entropy`` instead (same normalization and logging),
            to compare memory and results.
        flce_normalize: ``"step"``: the training loss is the mean over the non-ignored tokens of the whole
            optimizer step, across micro-batches (gradient accumulation) and data-parallel ranks.
            ``"micro_batch"``: the plain mean of each micro-batch (Lightning then averages micro-batches and
            ranks, so micro-batches with few tokens weigh as much as full ones).

    How ``"step"`` works: each micro-batch back-propagates the *sum* of its token losses over a divisor ``D``
    (1 unless the gradients are fp16, below), and the mixin counts its non-ignored tokens when that sum is
    back-propagated (a ``training_step`` that returns None to skip a batch adds neither its loss nor its
    tokens). After the last backward of the step (wrapping the optimizer closure in :meth:`optimizer_step`, or
    in :meth:`on_before_optimizer_step` if that override is bypassed; before gradient clipping either way) one
    ``all_reduce`` sums the step's loss, token and micro-batch counts over the ranks, and the gradients of the
    optimizer's parameters are multiplied by ``accumulate_grad_batches * world_size * D / tokens_of_step``
    (Lightning divides each micro-batch loss by ``accumulate_grad_batches`` and DDP/FSDP average over ranks).
    Consequences:

    - Every gradient of the optimizer is rescaled, so return the ``flce_loss`` of the training step as the
      loss. Another loss term added to it is rescaled too: multiply it (a micro-batch mean) by
      ``self.flce_last_loss_weight`` (a 0-d tensor: the tokens of the last ``flce_loss`` call over ``D``; 1
      under ``"micro_batch"``) to weight it per token like the LM loss. The mixin warns once when the
      back-propagated loss has other terms and the step did not read ``flce_last_loss_weight``.
    - fp16 gradients (``precision="16-mixed"`` or ``"16-true"``): a token sum would overflow fp16 (a
      ``GradScaler`` started at Lightning's 2^16 would skip up to ``log2(tokens / accumulate_grad_batches)``
      steps while it backs off; ``16-true`` has no scaler). So ``D`` is the smallest power of two at least the
      tokens per micro-batch, the same on every rank, which keeps the back-propagated gradients at most a mean
      loss's size:

      - first, the ranks' mean label count (ignored labels included) of their first training micro-batch, by
        one ``all_reduce`` inside that :meth:`flce_loss` call: every rank must make that call at the same point;
      - after each step, the step's mean tokens per micro-batch where that is larger. ``D`` never falls, so a
        short last batch of an epoch does not make the next full step overflow; a step whose micro-batches
        outgrow ``D`` can overflow once.

      Being a power of two, ``D`` changes no rounding: the final fp32 gradients equal those of ``D = 1``.
    - Overridden hooks the mixin uses must call ``super()``: ``on_fit_start`` (step totals, FSDP2 step
      methods), ``on_validation_epoch_end`` / ``on_test_epoch_end`` (they log and reset ``val/*`` /
      ``test/*``; the mixin warns when an epoch's metrics were never logged).
    - If you override ``optimizer_step`` and ``on_before_optimizer_step``, call ``super()`` in one of them;
      the next training step raises otherwise. Callbacks' ``on_before_optimizer_step`` run after the
      rescaling unless ``optimizer_step`` is overridden.
    - Needs the gradients in ``param.grad`` (single device, DDP, FSDP); with DeepSpeed use ``"micro_batch"``.
    - In manual optimization call ``self.manual_backward(self.flce_loss(...))`` without dividing by the
      number of accumulated micro-batches. The gradients of *every* parameter are normalized at the first of:
      ``self.clip_gradients(...)``, the first ``optimizer.step()`` of the step (ahead of the callbacks'
      ``on_before_optimizer_step``: the mixin adds a callback at the front of the list at fit start), or
      :meth:`flce_normalize_gradients` (call it before reading gradients in ``training_step``).

    Vocab-parallel head: the head (found as above) may be a :class:`~lightning_flce.parallel.VocabParallelHead`,
    whose ``[V, H]`` weight is sharded over V across its process group (the *TP group*). The loss is then its
    vocab-parallel op, inside the head's own call; every rank of the TP group must feed the same hidden states
    and labels (the op checks the labels and raises on every rank otherwise), and :meth:`flce_logits` gathers
    the full logits (``head.gather_logits``, no gradient). ``flce_naive=True`` raises.
    Supported layouts:

    - *pure head-TP, data replicated* (tested): one process per TP rank, each with a single-device strategy
      (``Trainer(accelerator=..., devices=1)``) and the process group initialized by the user; the TP group
      is the whole world and ``trainer.world_size == 1``, so the step's token count is the local one (every
      rank holds the same tokens; nothing is multiplied by the TP size). The body's gradient is already the
      full one on every rank (the op all-reduces dX), the head's is this rank's rows; no strategy reduction.
    - *DP x TP* (tested on 4 CPU processes, ``tests/test_dp_tp_cpu.py``): a strategy whose world is
      ``dp * tp`` ranks and that reduces gradients over the data-parallel ranks only
      (``ModelParallelStrategy`` with the head built on ``device_mesh["tensor_parallel"]`` and ``fully_shard``
      on ``device_mesh["data_parallel"]``). The step totals are then summed over the whole world, which
      counts each token ``tp`` times, and the scale is
      ``accumulate_grad_batches * world_size * D / that sum`` = ``accumulate_grad_batches * dp * D / tokens``:
      the TP factor cancels, which is what an average over the ``dp`` data-parallel ranks needs.
    - Refused (``ValueError`` at the start of fit): ``DDPStrategy``, ``DeepSpeedStrategy`` and
      ``FSDPStrategy`` with a head group of more than one rank. They reduce every gradient over the whole
      world, which would average the head shards of different vocabulary rows (and assume different data
      per rank). Also refused: a world size that is not a multiple of the TP size.

    :meth:`flce_loss` returns a tensor whose *value* is the micro-batch mean and whose gradient (``"step"``)
    is that of the token sum over ``D``. A micro-batch whose labels are all ignored gives 0 with the graph
    connected, so every rank runs the same backward (no DDP hang).

    Logs ``train/loss`` (mean over the tokens of the optimizer step, all ranks; per step and per epoch, so the
    loggers get ``train/loss_step`` and ``train/loss_epoch``), and ``val/loss``, ``val/perplexity``,
    ``val/token_accuracy`` (``test/...`` under ``trainer.test``) from torchmetrics ``MeanMetric`` weighted by
    token counts; several validation dataloaders are pooled into one value of each. Validation uses the plain
    cross-entropy (no label smoothing, no z-loss) so perplexity keeps its meaning. Inference keeps the model's normal logits path
    (:meth:`flce_logits` gives the logits with the same scale/softcap as the loss).

    After each call, ``self.flce_last_logits_shape = (N, V)`` (tokens of the call, ignored ones included, and
    the head's rows) and ``self.flce_last_logits_bytes = N * V * 4`` describe the float32 logits the loss did
    not materialise (:class:`~lightning_flce.callbacks.FLCEMemoryCallback` logs them); with
    ``flce_naive=True`` the bytes are 0, since that path builds them.

    """

    def __init__(
        self,
        *args: Any,
        flce_head: Optional[str] = None,
        flce_chunk_size: Optional[int] = None,
        flce_ignore_index: int = -100,
        flce_label_smoothing: float = 0.0,
        flce_z_loss: float = 0.0,
        flce_softcap: Optional[float] = None,
        flce_accum_fp32: bool = False,
        flce_impl: Literal["auto", "triton", "torch"] = "auto",
        flce_naive: bool = False,
        flce_normalize: Literal["step", "micro_batch"] = "step",
        **kwargs: Any,
    ) -> None:
        mro = type(self).__mro__
        _check_no_unknown_flce_options(kwargs, mro[mro.index(FLCEMixin) + 1 :])
        super().__init__(*args, **kwargs)
        if flce_normalize not in _NORMALIZE_MODES:
            raise ValueError(f"flce_normalize must be one of {_NORMALIZE_MODES}, got {flce_normalize!r}")
        if flce_softcap is not None and not 0.0 < flce_softcap < math.inf:
            raise ValueError(f"flce_softcap must be finite and > 0, or None, got {flce_softcap}")
        self.flce_head = flce_head
        self.flce_ignore_index = flce_ignore_index
        self.flce_softcap = flce_softcap
        self.flce_naive = flce_naive
        self.flce_normalize = flce_normalize
        try:
            self.flce_head_loss = FLCEHeadLoss(
                ignore_index=flce_ignore_index,
                label_smoothing=flce_label_smoothing,
                z_loss=flce_z_loss,
                accum_fp32=flce_accum_fp32,
                chunk_size=flce_chunk_size,
                impl=flce_impl,
                naive=flce_naive,
            )
        except ValueError as error:  # FLCEHeadLoss names its arguments without the mixin's prefix
            raise ValueError(f"flce_{error}") from None
        # token-weighted means; their states are not persistent, so checkpoints do not change
        self.flce_eval_loss = _Float64Mean()
        self.flce_eval_accuracy = _Float64Mean()
        # which evaluation the unlogged metric updates are from (see _flce_check_eval_logged)
        self._flce_eval_pending: Optional[tuple] = None
        self.flce_last_logits_shape: Optional[tuple[int, int]] = None
        self.flce_last_logits_bytes: Optional[int] = None
        self.flce_last_num_tokens: Optional[Tensor] = None
        self._flce_last_loss_weight: Optional[Tensor] = None
        # "step": the autograd nodes of this micro-batch's flce_loss outputs, and whether the step read
        # flce_last_loss_weight (see on_before_backward)
        self._flce_loss_nodes: list = []
        self._flce_loss_weight_read = False
        self._flce_warned_unweighted_term = False
        # [loss sum, token count, micro-batches] of the optimizer step in progress, and its global step
        self._flce_step_totals: Optional[Tensor] = None
        # "step": the power of two the micro-batches' token sums are divided by (D in the class docstring);
        # None until agreed over the ranks (fp16 gradients)
        self._flce_grad_divisor: Optional[float] = 1.0
        self._flce_step_index: Optional[int] = None

    # ------------------------------------------------------------------ loss

    def flce_loss(self, hidden: Tensor, labels: Tensor, *, shift: bool = False) -> Tensor:
        """LM loss of ``hidden`` [..., H] against ``labels`` [...], without the logits.

        Args:
            hidden: final hidden states (after the last norm).
            labels: target token ids, same leading shape as ``hidden``; ``flce_ignore_index`` is ignored.
            shift: ``labels`` are the input ids (Hugging Face convention): position t is scored against
                label t + 1, the last position of each sequence is ignored.

        Returns:
            The mean over the non-ignored tokens (0 if there are none). During ``fit`` with
            ``flce_normalize="step"`` its gradient is that of the token sum over ``D``; the mixin normalizes
            the gradients at the optimizer step (see the class docstring).

        """
        if not isinstance(hidden, Tensor) or not isinstance(labels, Tensor):
            raise TypeError(
                f"flce_loss takes the final hidden states and the labels as tensors, got {type(hidden).__name__}"
                f" and {type(labels).__name__} (a model output tuple? pass its hidden-state tensor)"
            )
        if labels.dtype in _NARROW_INT_DTYPES:  # ignore_index (-100) does not fit uint8, say
            labels = labels.long()
        if shift:
            # shift the labels rather than the hidden states: no copy of the [B, T, H] activations
            labels = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=self.flce_ignore_index)
        stage = self._flce_stage()
        head, logit_scale, softcap = self._flce_resolve_head()
        evaluating = stage in ("val", "test")
        output = self.flce_head_loss(
            head,
            hidden,
            labels,
            reduction="sum",
            with_stats=evaluating,
            regularized=not evaluating,
            logit_scale=logit_scale,
            softcap=softcap,
        )
        loss_sum = output.loss if evaluating else output
        num_tokens = (labels != self.flce_ignore_index).sum()
        num_logits = self.flce_head_loss.last_logits_shape
        self.flce_last_logits_shape = num_logits
        # the naive path builds the logits it reports: nothing avoided
        self.flce_last_logits_bytes = 0 if self.flce_naive else num_logits[0] * num_logits[1] * 4
        self.flce_last_num_tokens = num_tokens
        step_normalized = stage == "train" and self.flce_normalize == "step"
        if not step_normalized:
            self._flce_last_loss_weight = torch.ones((), device=num_tokens.device)
        mean = loss_sum / num_tokens.clamp(min=1)

        if evaluating:
            self._flce_check_eval_logged(stage)
            weight = num_tokens.to(torch.float32)
            self.flce_eval_loss.update(mean.detach().float(), weight)
            self.flce_eval_accuracy.update(output.correct.sum() / num_tokens.clamp(min=1), weight)
            return mean
        if stage != "train":
            return mean
        if step_normalized and self._flce_grad_divisor is None:
            self._flce_grad_divisor = self._flce_first_grad_divisor(labels.numel(), num_tokens.device)
        totals = torch.stack(
            [loss_sum.detach().double(), num_tokens.double(), num_tokens.new_ones((), dtype=torch.float64)]
        )
        if loss_sum.requires_grad:
            # counted when back-propagated: a training_step that returns None (a skipped batch) adds nothing
            loss_sum.register_hook(functools.partial(self._flce_count_backward, totals))
        else:
            self._flce_add_to_step(totals)
        if step_normalized:
            divisor = self._flce_grad_divisor
            self._flce_last_loss_weight = num_tokens.float() / divisor
            # value: the micro-batch mean; gradient: the token sum's / divisor (normalized at the optimizer step)
            loss = mean.detach() + (loss_sum - loss_sum.detach()) / divisor
            watch = not self._flce_warned_unweighted_term and not torch.compiler.is_compiling()
            if watch and loss.grad_fn is not None:
                # bounded: hooks overridden without super() never clear the list
                self._flce_loss_nodes = [*self._flce_loss_nodes[-15:], loss.grad_fn]
            return loss
        return mean

    @property
    def flce_last_loss_weight(self) -> Optional[Tensor]:
        """Weight that makes another loss term (a micro-batch mean) count per token like the last ``flce_loss``
        output: its tokens over ``D`` under ``flce_normalize="step"`` in training, else 1 (a 0-d tensor; None
        before the first call). See the class docstring."""
        self._flce_loss_weight_read = True
        return self._flce_last_loss_weight

    def flce_logits(self, hidden: Tensor) -> Tensor:
        """Logits of the head on ``hidden`` with the loss's logit scale and softcap (inference path)."""
        head, logit_scale, softcap = self._flce_resolve_head()
        module = unwrap_head(head)
        if isinstance(module, VocabParallelHead):
            # its own call gives this rank's columns only: all-gather the full [..., V]
            logits = module.gather_logits(hidden)
        elif isinstance(module, nn.Embedding):
            # the output matrix of a tied head: called (hooks gather a sharded weight) with a linear forward
            with forward_bound_to(module, lambda h: F.linear(h, module.weight)):
                logits = head(hidden)
        else:
            logits = head(hidden)
        if logit_scale is not None:
            logits = logits * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return logits

    # ----------------------------------------------------------------- hooks

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Optimizer,
        optimizer_closure: Optional[Callable[[], Any]] = None,
    ) -> None:
        """Normalizes the gradients right after the closure (the last backward of the step), so callbacks,
        ``on_before_optimizer_step`` and gradient clipping all see the normalized gradients."""
        if optimizer_closure is not None:
            optimizer_closure = functools.partial(
                self._flce_closure_then_normalize, optimizer_closure, optimizer
            )
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        # a no-op when optimizer_step (or, in manual optimization, the callback added at fit start) normalized
        self._flce_finish_step(optimizer)
        super().on_before_optimizer_step(optimizer)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clips the normalized gradients: in manual optimization it normalizes first (automatic optimization
        has normalized by then, or the next training step raises for the override that skipped it)."""
        if not self.automatic_optimization:
            self._flce_finish_step(optimizer)
        super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_fit_start(self) -> None:
        # FSDP2 unshards parameters only around forward(); the loss runs in the step methods.
        register_fsdp_step_methods(self)
        self._flce_step_totals = None
        self._flce_step_index = None
        # fp16 gradients: agreed afresh at the first training call (this fit's ranks and batches may differ)
        self._flce_grad_divisor = None if self._flce_fp16_gradients() else 1.0
        if self.flce_normalize == "step" and "DeepSpeed" in type(self.trainer.strategy).__name__:
            raise ValueError(
                "flce_normalize='step' rescales param.grad, which DeepSpeed keeps in its own partitioned"
                " buffers; use flce_normalize='micro_batch' with DeepSpeed"
            )
        self._flce_check_vocab_parallel_layout()
        if not self.automatic_optimization:
            # Lightning calls callbacks' on_before_optimizer_step before the module's: normalize ahead of them
            callbacks = self.trainer.callbacks
            if not any(isinstance(callback, _NormalizeBeforeCallbacks) for callback in callbacks):
                callbacks.insert(0, _NormalizeBeforeCallbacks())
        super().on_fit_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        self._flce_loss_nodes = []  # a skipped backward leaves its nodes (and their graph) behind
        self._flce_loss_weight_read = False
        return super().on_train_batch_start(batch, batch_idx)

    def on_before_backward(self, loss: Tensor) -> None:
        # "step" rescales every gradient at the optimizer step for the LM loss's token sum, so a term added to
        # flce_loss's output without flce_last_loss_weight is silently weighted ~1 / tokens: warn once.
        nodes, self._flce_loss_nodes = self._flce_loss_nodes, []
        weight_read, self._flce_loss_weight_read = self._flce_loss_weight_read, False
        if (
            nodes
            and not weight_read
            and not self._flce_warned_unweighted_term
            and _has_other_terms(loss, nodes)
        ):
            self._flce_warned_unweighted_term = True
            rank_zero_warn(
                "FLCEMixin: the loss back-propagated in this training step has terms besides flce_loss's output."
                " With flce_normalize='step' every gradient is rescaled at the optimizer step for the LM loss's"
                " token sum, so another term (a micro-batch mean) keeps its weight only when multiplied by"
                " self.flce_last_loss_weight, e.g. `return self.flce_loss(hidden, labels) + aux *"
                " self.flce_last_loss_weight`; or use flce_normalize='micro_batch'. (Warned once.)"
            )
        super().on_before_backward(loss)

    def on_validation_start(self) -> None:
        register_fsdp_step_methods(self)
        super().on_validation_start()

    def on_test_start(self) -> None:
        register_fsdp_step_methods(self)
        super().on_test_start()

    def on_predict_start(self) -> None:
        register_fsdp_step_methods(self)
        super().on_predict_start()

    def on_validation_epoch_end(self) -> None:
        self._flce_log_eval("val")
        super().on_validation_epoch_end()

    def on_test_epoch_end(self) -> None:
        self._flce_log_eval("test")
        super().on_test_epoch_end()

    # --------------------------------------------------------------- helpers

    def _flce_stage(self) -> Optional[str]:
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return None
        if trainer.training:
            return "train"
        if trainer.sanity_checking or trainer.validating:
            return "val"
        if trainer.testing:
            return "test"
        return None

    def _flce_resolve_head(self) -> tuple[nn.Module, Optional[float], Optional[float]]:
        """(head module, logit scale, softcap), resolved at each call."""
        hf_model = self._flce_hf_model()
        if self.flce_head is not None:
            head = self
            for name in self.flce_head.split("."):
                if not hasattr(head, name):
                    raise AttributeError(
                        f"flce_head={self.flce_head!r}: {type(head).__name__} has no attribute {name!r}"
                    )
                head = getattr(head, name)
        elif hf_model is not None:
            head = hf_model.get_output_embeddings()
            if head is None:
                raise AttributeError(
                    f"{type(hf_model).__name__}.get_output_embeddings() returned None; set flce_head"
                )
        else:
            head = getattr(self, "lm_head", None)
            if head is None:
                raise AttributeError(
                    f"{type(self).__name__} has no `lm_head`; set flce_head to the attribute path of the LM head"
                )
        if not isinstance(head, nn.Module):
            raise TypeError(f"The LM head must be an nn.Module, got {type(head).__name__}")
        if hf_model is None or head is not hf_model.get_output_embeddings():
            return head, None, self.flce_softcap
        return head, *self._flce_hf_logit_transform(hf_model)

    def _flce_check_vocab_parallel_layout(self) -> None:
        """Raises for the strategies that cannot train a vocab-parallel head (see the class docstring)."""
        try:
            module = unwrap_head(self._flce_resolve_head()[0])
        except (AttributeError, TypeError, ValueError):
            return  # no usable head yet: flce_loss raises its own error when it is called
        if not isinstance(module, VocabParallelHead):
            return
        import torch.distributed as dist

        tp_size = dist.get_world_size(module.group)
        if tp_size == 1:
            return
        strategy = self.trainer.strategy
        world_reducing = {"DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy"}
        found = world_reducing.intersection(cls.__name__ for cls in type(strategy).__mro__)
        if found:
            raise ValueError(
                f"FLCEMixin: the head is a VocabParallelHead sharded over {tp_size} ranks, but {type(strategy).__name__}"
                f" ({sorted(found)[0]}) reduces every gradient over the whole world, which would average head shards"
                " of different vocabulary rows. Run one single-device Trainer per TP rank (data replicated), or a"
                " strategy that reduces gradients over the data-parallel ranks only (ModelParallelStrategy)"
            )
        world_size = self.trainer.world_size
        if world_size > 1 and world_size % tp_size:
            raise ValueError(
                f"FLCEMixin: the trainer's world size {world_size} is not a multiple of the VocabParallelHead's"
                f" group size {tp_size}; the head's group must be a tensor-parallel group inside the world"
            )

    def _flce_hf_model(self) -> Optional[nn.Module]:
        """The Hugging Face model that is this module or its only direct child with an LM head."""

        def is_hf_model(module: Any) -> bool:
            return callable(getattr(module, "get_output_embeddings", None)) and hasattr(module, "config")

        if is_hf_model(self):
            return self
        found = [child for child in self.children() if is_hf_model(child)]
        return found[0] if len(found) == 1 else None

    def _flce_hf_logit_transform(self, hf_model: nn.Module) -> tuple[Optional[float], Optional[float]]:
        """(logit scale, softcap) that the Hugging Face model applies after its LM head."""
        config = hf_model.config
        softcap = getattr(config, "final_logit_softcapping", None)
        if self.flce_softcap is not None and self.flce_softcap != softcap:
            raise ValueError(
                f"flce_softcap={self.flce_softcap} differs from the model's config.final_logit_softcapping={softcap};"
                " set the softcap in the model config so that inference applies it too"
            )
        scale = getattr(hf_model, "logit_scale", None)  # Cohere: logits * logit_scale
        if isinstance(scale, Tensor):
            raise NotImplementedError(
                f"{type(hf_model).__name__} has a tensor logit_scale (per-vocab or learned); FLCE supports scalars"
            )
        logits_scaling = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
        if logits_scaling is not None:
            scale = (1.0 if scale is None else scale) / logits_scaling
        return (None if scale is None or scale == 1.0 else float(scale)), softcap

    def _flce_fp16_gradients(self) -> bool:
        return str(getattr(self.trainer, "precision", "")) in ("16-mixed", "16-true")

    def _flce_first_grad_divisor(self, labels: int, device: torch.device) -> float:
        """fp16: the divisor of a fit's first step, from the ranks' mean size of their first micro-batch."""
        size = torch.tensor(float(labels), dtype=torch.float64, device=device)
        trainer = self.trainer
        if trainer.world_size > 1:
            size = trainer.strategy.reduce(size, reduce_op="mean")
        return _power_of_two_at_least(size.item())

    def _flce_count_backward(self, totals: Tensor, grad: Tensor) -> None:
        self._flce_add_to_step(totals)

    def _flce_add_to_step(self, totals: Tensor) -> None:
        """Adds a micro-batch's [loss sum, token count, 1] to the optimizer step's."""
        step = self.trainer.global_step
        if self._flce_step_totals is not None and self._flce_step_index != step:
            if self.flce_normalize == "step":
                raise RuntimeError(
                    "The optimizer stepped without FLCEMixin normalizing the gradients of the step: an override of"
                    " `optimizer_step` or `on_before_optimizer_step` must call super() (one of the two is enough)"
                )
            self._flce_step_totals = None
        if self._flce_step_totals is None:
            self._flce_step_totals, self._flce_step_index = totals, step
        else:
            self._flce_step_totals = self._flce_step_totals + totals

    def _flce_closure_then_normalize(self, closure: Callable[[], Any], optimizer: Optimizer) -> Any:
        result = closure()
        self._flce_finish_step(optimizer)
        return result

    def flce_normalize_gradients(self) -> None:
        """Manual optimization: normalize the step's gradients now (see the class docstring); a no-op once done.
        Call it after the step's last ``manual_backward``, before reading gradients in ``training_step``."""
        self._flce_finish_step(None)

    def _flce_finish_step(self, optimizer: Optional[Optimizer]) -> None:
        """Sums the step's loss and tokens over ranks, logs ``train/loss`` and (``"step"``) rescales the grads:
        those of ``optimizer`` under automatic optimization (its only optimizer), else of every parameter
        (manual optimization may step several optimizers, and normalizes at the first)."""
        totals = self._flce_step_totals
        if totals is None:
            return
        self._flce_step_totals = None
        trainer = self.trainer
        # With a VocabParallelHead inside a DP x TP world, each token is counted once per TP rank here, and
        # world_size (below) includes the TP ranks too: the TP factor cancels in the scale and the logged mean.
        # With one single-device Trainer per TP rank, world_size is 1 and the local count is the step's count.
        if trainer.world_size > 1:
            totals = trainer.strategy.reduce(totals, reduce_op="sum")
        loss_sum, num_tokens, micro_batches = totals.tolist()
        if self.flce_normalize == "step":
            accumulation = trainer.accumulate_grad_batches if self.automatic_optimization else 1
            scale = accumulation * trainer.world_size * self._flce_grad_divisor / max(num_tokens, 1.0)
            if self._flce_fp16_gradients():
                # these totals are the same on every rank, so is the next step's divisor
                per_micro_batch = _power_of_two_at_least(num_tokens / max(micro_batches, 1.0))
                self._flce_grad_divisor = max(self._flce_grad_divisor, per_micro_batch)
            if self.automatic_optimization and optimizer is not None:
                params = [p for group in optimizer.param_groups for p in group["params"]]
            else:
                params = list(self.parameters())
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
        self.log(
            "train/loss",
            loss_sum / max(num_tokens, 1.0),
            on_step=True,
            on_epoch=True,
            prog_bar=True,
            batch_size=max(int(num_tokens), 1),
            # the value is global already: Lightning's sync averages equal values (and does not warn)
            sync_dist=True,
        )

    def _flce_check_eval_logged(self, stage: str) -> None:
        # which evaluation this update belongs to: stage, trainer (a token object kept alive here, so a new
        # trainer at a reused address still differs), epoch, step
        trainer = self._trainer
        token = None
        if trainer is not None:
            token = trainer.__dict__.setdefault("_flce_eval_token", object())
        key = (stage, token, getattr(trainer, "current_epoch", None), getattr(trainer, "global_step", None))
        pending = self._flce_eval_pending
        if pending is not None and pending != key:
            rank_zero_warn(
                f"FLCEMixin: the {pending[0]} metrics of an earlier evaluation were never logged; an overridden"
                " on_validation_epoch_end / on_test_epoch_end must call super() (it logs and resets them). They"
                " now mix evaluations."
            )
        self._flce_eval_pending = key

    def _flce_log_eval(self, prefix: str) -> None:
        self._flce_eval_pending = None
        if self.flce_eval_loss.update_count == 0:
            return
        loss = self.flce_eval_loss.compute()
        accuracy = self.flce_eval_accuracy.compute()
        self.flce_eval_loss.reset()
        self.flce_eval_accuracy.reset()
        self.log_dict(
            {
                f"{prefix}/loss": loss,
                f"{prefix}/perplexity": torch.exp(loss),
                f"{prefix}/token_accuracy": accuracy,
            },
            prog_bar=False,
            sync_dist=True,  # torchmetrics synced them: equal on every rank, as above
        )


def _power_of_two_at_least(value: float) -> float:
    return 2.0 ** math.ceil(math.log2(max(value, 1.0)))


# Scalar arithmetic a loss goes through between flce_loss and backward (Lightning divides by
# accumulate_grad_batches; users scale or add flce_loss outputs, e.g. two heads).
_ARITHMETIC_NODES = frozenset(
    {"AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "NegBackward0"}
)


def _has_other_terms(loss: Tensor, flce_nodes: list) -> bool:
    """Whether ``loss``'s graph, followed through arithmetic only, reaches one of ``flce_nodes`` (the ``grad_fn``
    of this micro-batch's ``flce_loss`` outputs) and something else but constants. A graph the walk cannot see
    into (a compiled region, say) counts as no: the warning is for the plain case, never a false alarm."""
    found_flce = found_other = False
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if any(node is flce_node for flce_node in flce_nodes):
            found_flce = True
        elif type(node).__name__ in _ARITHMETIC_NODES:
            stack.extend(next_node for next_node, _ in node.next_functions)
        else:
            found_other = True
    return found_flce and found_other
