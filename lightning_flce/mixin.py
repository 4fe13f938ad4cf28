"""LightningModule mixin that computes the LM-head loss with fused linear cross-entropy.

:class:`FLCEMixin` is put together from parts, a module per job: this module has its options (``__init__``), the
LM loss (:meth:`FLCEMixin.flce_loss`) and the hooks that several parts share, which call each part's step in
order; :mod:`lightning_flce.mixin_step` the step normalization (``flce_normalize``) and the hooks only it uses;
:mod:`lightning_flce.mixin_eval` the validation and test metrics; :mod:`lightning_flce.mixin_rl` the RL calls
(:meth:`~lightning_flce.mixin_rl.PolicyCalls.flce_logprobs`, ``flce_policy_loss``); and
:mod:`lightning_flce.mixin_checks` the checks of the options, the head and the strategy.
"""

import inspect
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_flce.deprecation import RENAMED, accepts_renamed
from lightning_flce.eval_metrics import TokenMetrics
from lightning_flce.fsdp import register_fsdp_step_methods
from lightning_flce.head import FLCEHeadLoss
from lightning_flce.head_discovery import head_logits, resolve_head
from lightning_flce.losses.policy import PolicyLossType
from lightning_flce.mixin_checks import (
    ChecksHeadWhenBuilt,
    check_head_when_built,
    check_no_unknown_flce_options,
    check_vocab_parallel_layout,
)
from lightning_flce.mixin_eval import EvalMetricsLogging
from lightning_flce.mixin_rl import NARROW_INT_DTYPES, PolicyCalls
from lightning_flce.mixin_step import StepNormalization
from lightning_flce.normalization import StepNormalizer, UnweightedTermWatch
from lightning_flce.options import (
    NORMALIZE_MODES,
    AccumDtype,
    FLCEOptions,
    ImplName,
    LogitsPrecision,
    NormalizeMode,
)
from lightning_flce.outputs import FLCEOutput
from lightning_flce.per_token import check_per_token, shift_per_token
from lightning_flce.rl.head_calls import policy_loss_module

__all__ = ["NARROW_INT_DTYPES", "FLCEMixin"]

# the record's fields under the mixin's option names (its errors name what the user wrote)
_OPTION_NAMES = {field: f"flce_{field}" for field in FLCEOptions.field_names()}
# the deprecated flce_* names the mixin still takes (deprecation.RENAMED), renamed before __init__ runs
_RENAMED_OPTIONS = ("z_loss", "accum_fp32")


class FLCEMixin(PolicyCalls, EvalMetricsLogging, StepNormalization, metaclass=ChecksHeadWhenBuilt):
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
            flce_lse_square_scale: 1.0e-4
            flce_normalize: step

    Args:
        flce_head: attribute path of the head module from the LightningModule, e.g. ``"lm_head"`` or
            ``"model.lm_head"``. ``None``: ``get_output_embeddings()`` of the Hugging Face model that is the
            module itself or its only direct child that is one, else ``"lm_head"``. The head is looked up at every
            call (never by parameter name), so tied, resized or PEFT-wrapped heads are found as they are. It is
            checked when the module is built (a typo raises with the closest submodule path), or at fit start
            for a head built in ``configure_model``.
        flce_chunk_size: tokens per chunk; ``None`` lets the op choose from its memory budget.
        flce_ignore_index: label value that does not count.
        flce_label_smoothing: label smoothing of the training loss.
        flce_lse_square_scale: z-loss coefficient (``lse_square_scale * logsumexp(logits) ** 2`` per token)
            of the training loss.
        flce_softcap: logit soft-capping ``c * tanh(logits / c)``. The modules on the path to the head (a
            Hugging Face or LitGPT model, or any module with a ``config``) decide their logit transforms
            themselves: their ``final_logit_softcapping`` (and ``logit_scale``, ``logits_scaling``, ... of
            :data:`~lightning_flce.head_discovery.LOGIT_TRANSFORMS`) is applied to the loss, a transform the
            mixin cannot apply (a tensor scale) is refused, and a different value here is an error.
        flce_accum_dtype: dtype of the head weight gradient's accumulator over chunks, a ``torch.dtype`` or
            its name (``"float32"``, ``"float64"``, ...; ``accum_dtype`` of
            :func:`~lightning_flce.fused_linear_cross_entropy`; ``"float32"`` never narrows an fp64 head);
            None keeps the op's default (one step wider than the GEMM operands when there are several chunks).
        flce_logits_precision: ``"input"``, ``"fp32"``, ``"fp32_compensated"`` or ``"fp32_head"``: the
            precision of each chunk's logits (``logits_precision`` of
            :func:`~lightning_flce.fused_linear_cross_entropy`).
        flce_impl: ``"auto"``, ``"triton"`` or ``"torch"``.
        flce_naive: compute plain logits and ``F.cross_entropy`` instead (same normalization and logging),
            to compare memory and results.
        flce_normalize: ``"step"``: the training loss is the mean over the non-ignored tokens of the whole
            optimizer step, across micro-batches (gradient accumulation) and data-parallel ranks.
            ``"micro_batch"``: the plain mean of each micro-batch (Lightning then averages micro-batches and
            ranks, so micro-batches with few tokens weigh as much as full ones).

    The option names are the op's with the ``flce_`` prefix (``docs/options.md``); ``flce_z_loss`` and
    ``flce_accum_fp32`` (``True``: ``flce_accum_dtype="float32"``) are deprecated aliases that warn.

    How ``"step"`` works: each micro-batch back-propagates the *sum* of its token losses over a divisor ``D``
    (1 unless the gradients are fp16, below), and the mixin counts its non-ignored tokens at the call and adds
    them to the step when Lightning back-propagates the step's loss (``on_before_backward``; a
    ``training_step`` that returns None to skip a batch adds neither its loss nor its tokens). No tensor hook:
    ``torch.compile(model)`` traces a training step without a graph break from the mixin. The arithmetic is
    :class:`~lightning_flce.normalization.StepNormalizer`'s. After the last backward of the step (wrapping the optimizer closure in :meth:`optimizer_step`, or
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
      methods), ``on_train_batch_start`` and ``on_before_backward`` (a micro-batch's tokens join the step
      there), ``on_validation_epoch_end`` / ``on_test_epoch_end`` (they log and reset ``val/*`` /
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

    Reinforcement learning (``docs/rl.md``): :meth:`flce_logprobs` (per-token log-probabilities and entropy) and
    :meth:`flce_policy_loss` (GRPO, DAPO, Dr. GRPO, ...) on the same head; the policy loss's options are
    ``flce_loss_type``, ``flce_epsilon_low``, ``flce_epsilon_high``, ``flce_beta``, ``flce_entropy_coef``,
    ``flce_temperature`` and ``flce_max_completion_length`` (the function's names), and ``"step"`` normalizes it
    as its loss type over the step (tokens, sequences, or sequences x length in place of the tokens).

    :meth:`flce_loss` returns a tensor whose *value* is the micro-batch mean and whose gradient (``"step"``)
    is that of the token sum over ``D``. A micro-batch whose labels are all ignored gives 0 with the graph
    connected, so every rank runs the same backward (no DDP hang).

    Logs ``train/loss`` (mean over the tokens of the optimizer step, all ranks; per step and per epoch, so the
    loggers get ``train/loss_step`` and ``train/loss_epoch``), and ``val/loss``, ``val/perplexity``,
    ``val/token_accuracy`` (``test/...`` under ``trainer.test``) from torchmetrics ``MeanMetric`` weighted by
    token counts. Several validation (or test) dataloaders get one set each, under Lightning's keys
    ``val/loss/dataloader_idx_N``, ...; the steps then need Lightning's ``dataloader_idx`` argument. ``val/loss``
    is shown in the progress bar, and after each validation (not the sanity check) and at the end of fit a
    rank-zero line sums the metrics up (``lightning.pytorch``'s logger, level INFO). Validation uses the plain
    cross-entropy (no label smoothing, no z-loss) so perplexity keeps its meaning; ``token_weight`` weights it
    too. Inference keeps the model's normal logits path (:meth:`flce_logits` gives the logits with the same
    scale/softcap as the loss).

    ``torch.compile(model)`` (Lightning compiles ``training_step``, ``validation_step``, ...): the mixin adds
    no graph break to the training step nor to the validation step (the metrics add plain tensor sums in the
    step and update their torchmetrics means once per dataloader at epoch end).

    After each call, ``self.flce_last_logits_shape = (N, V)`` (tokens of the call, ignored ones included, and
    the head's rows) and ``self.flce_last_logits_bytes = N * V * 4`` (one float32 copy of those logits; 0 with
    ``flce_naive=True``, which builds them) describe the call's head;
    :class:`~lightning_flce.callbacks.FLCEMemoryCallback` turns the shape and the precision into what the unfused
    head would have added to the peak (about three such copies).

    """

    @accepts_renamed(*_RENAMED_OPTIONS, prefix="flce_")
    def __init__(
        self,
        *args: Any,
        flce_head: Optional[str] = None,
        flce_chunk_size: Optional[int] = None,
        flce_ignore_index: int = -100,
        flce_label_smoothing: float = 0.0,
        flce_lse_square_scale: float = 0.0,
        flce_softcap: Optional[float] = None,
        flce_accum_dtype: AccumDtype = None,
        flce_logits_precision: LogitsPrecision = "input",
        flce_impl: ImplName = "auto",
        flce_naive: bool = False,
        flce_normalize: NormalizeMode = "step",
        flce_loss_type: PolicyLossType = "grpo",
        flce_epsilon_low: float = 0.2,
        flce_epsilon_high: float = 0.2,
        flce_beta: float = 0.0,
        flce_entropy_coef: float = 0.0,
        flce_temperature: float = 1.0,
        flce_max_completion_length: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        mro = type(self).__mro__
        known = [
            name for name in inspect.signature(FLCEMixin.__init__).parameters if name.startswith("flce_")
        ]
        # a misspelled deprecated name is suggested as the new one
        aliases = {f"flce_{old}": f"flce_{RENAMED[old].new}" for old in _RENAMED_OPTIONS}
        check_no_unknown_flce_options(kwargs, known, aliases, mro[mro.index(FLCEMixin) + 1 :])
        super().__init__(*args, **kwargs)
        if flce_normalize not in NORMALIZE_MODES:
            raise ValueError(f"flce_normalize must be one of {NORMALIZE_MODES}, got {flce_normalize!r}")
        # the loss options: one record, validated once, its errors naming the flce_* options
        options = FLCEOptions.named(
            _OPTION_NAMES,
            ignore_index=flce_ignore_index,
            label_smoothing=flce_label_smoothing,
            lse_square_scale=flce_lse_square_scale,
            softcap=flce_softcap,
            logits_precision=flce_logits_precision,
            accum_dtype=flce_accum_dtype,
            chunk_size=flce_chunk_size,
            impl=flce_impl,
        )
        self.flce_head = flce_head
        self.flce_head_loss = FLCEHeadLoss.from_options(options, naive=flce_naive)
        #: the policy loss's options (flce_policy_loss; the op's names with the flce_ prefix), as its module
        self.flce_policy = policy_loss_module(
            options,
            loss_type=flce_loss_type,
            epsilon_low=flce_epsilon_low,
            epsilon_high=flce_epsilon_high,
            beta=flce_beta,
            entropy_coef=flce_entropy_coef,
            temperature=flce_temperature,
            max_completion_length=flce_max_completion_length,
        )
        #: the arithmetic of flce_normalize (token totals of the optimizer step, fp16 divisor, gradient scale)
        self.flce_step_normalizer = StepNormalizer(flce_normalize)
        self._flce_unweighted_term_watch = UnweightedTermWatch()
        #: token-weighted val/test metrics, one set per dataloader
        self.flce_eval_metrics = TokenMetrics()
        self._flce_eval_stage: Optional[str] = None  # the stage whose metrics are not logged yet
        #: the metrics logged at the end of the last validation (``{"val/loss": ..., ...}``)
        self.flce_last_eval_metrics: dict[str, float] = {}
        self.flce_last_logits_shape: Optional[tuple[int, int]] = None
        self.flce_last_logits_bytes: Optional[int] = None
        self.flce_last_num_tokens: Optional[Tensor] = None
        self._flce_last_loss_weight: Optional[Tensor] = None
        self._flce_policy_metrics: dict[str, Tensor] = {}  # to log at the micro-batch's backward

    # read-only views of the options record (one copy, in flce_head_loss.options)
    @property
    def flce_options(self) -> FLCEOptions:
        """The loss options as one :class:`~lightning_flce.options.FLCEOptions` record."""
        return self.flce_head_loss.options

    @property
    def flce_ignore_index(self) -> int:
        return self.flce_options.ignore_index

    @property
    def flce_softcap(self) -> Optional[float]:
        return self.flce_options.softcap

    @property
    def flce_naive(self) -> bool:
        return self.flce_head_loss.naive

    # ------------------------------------------------------------------ loss

    @accepts_renamed("labels")
    def flce_loss(
        self, hidden: Tensor, target: Tensor, *, shift: bool = False, token_weight: Optional[Tensor] = None
    ) -> Tensor:
        """LM loss of ``hidden`` [..., H] against ``target`` [...], without the logits.

        Args:
            hidden: final hidden states (after the last norm).
            target: target token ids (the labels), same leading shape as ``hidden``; ``flce_ignore_index`` is
                ignored. (``labels=``: deprecated.)
            shift: ``target`` holds the input ids (Hugging Face convention): position t is scored against
                label t + 1, the last position of each sequence is ignored.
            token_weight: optional float weights of the target's shape (no gradient; shifted with it when
                ``shift``): each token's loss (its cross-entropy with label smoothing, and its z-loss term) is
                multiplied by its weight. The means stay over the non-ignored tokens, unweighted (so under
                ``"step"`` the weighted token sum is divided by the step's token count).

        Returns:
            The mean over the non-ignored tokens (0 if there are none). During ``fit`` with
            ``flce_normalize="step"`` its gradient is that of the token sum over ``D``; the mixin normalizes
            the gradients at the optimizer step (see the class docstring).

        """
        if not isinstance(hidden, Tensor) or not isinstance(target, Tensor):
            raise TypeError(
                f"flce_loss takes the final hidden states and the target as tensors, got {type(hidden).__name__}"
                f" and {type(target).__name__} (a model output tuple? pass its hidden-state tensor)"
            )
        if token_weight is not None:
            # checked before the shift, which would keep a wrong shape but hide whose shape it was
            check_per_token("token_weight", token_weight, target, device=hidden.device)
        if target.dtype in NARROW_INT_DTYPES:
            target = target.long()
        if shift:
            # shift the labels rather than the hidden states: no copy of the [B, T, H] activations
            target = F.pad(target[..., 1:], (0, 1), value=self.flce_ignore_index)
            token_weight = shift_per_token("token_weight", token_weight)
        stage = self._flce_stage()
        head = resolve_head(self, self.flce_head, self.flce_softcap)
        evaluating = stage in ("val", "test")
        output = self.flce_head_loss(
            head.module,
            hidden,
            target,
            reduction="sum",
            with_stats=evaluating,
            regularized=not evaluating,
            logit_scale=head.logit_scale,
            softcap=head.softcap,
            token_weight=token_weight,
        )
        if isinstance(output, FLCEOutput):  # evaluating: with the statistics
            loss_sum, correct = output.loss, output.correct
        else:
            loss_sum, correct = output, None
        num_tokens = (target != self.flce_ignore_index).sum()
        num_logits = self.flce_head_loss.last_logits_shape
        assert num_logits is not None  # every call of the head loss sets it
        self.flce_last_logits_shape = num_logits
        # the naive path builds the logits it reports: nothing avoided
        self.flce_last_logits_bytes = 0 if self.flce_naive else num_logits[0] * num_logits[1] * 4
        self.flce_last_num_tokens = num_tokens

        if stage != "train":
            self._flce_last_loss_weight = torch.ones((), device=num_tokens.device)
            if correct is not None:
                self._flce_add_eval(stage, loss_sum, correct, num_tokens)
            return loss_sum / num_tokens.clamp(min=1)
        return self._flce_count_for_step(loss_sum, num_tokens, capacity=target.numel())

    def flce_logits(self, hidden: Tensor) -> Tensor:
        """Logits of the head on ``hidden`` with the loss's logit scale and softcap (inference path)."""
        return head_logits(resolve_head(self, self.flce_head, self.flce_softcap), hidden)

    # ----------------------------------------------------------------- hooks
    # (the hooks several parts use, calling each part's step in order; a part's own hooks are in its module)

    def on_fit_start(self) -> None:
        # FSDP2 unshards parameters only around forward(); the loss runs in the step methods.
        register_fsdp_step_methods(self)
        self._flce_start_fit_normalization()
        self._flce_check_vocab_parallel_layout()
        self._flce_add_normalize_callback()
        super().on_fit_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        self._flce_start_micro_batch()
        self._flce_policy_metrics = {}
        return super().on_train_batch_start(batch, batch_idx)

    def on_before_backward(self, loss: Tensor) -> None:
        self._flce_commit_micro_batch(loss)
        self._flce_log_policy_metrics()
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

    # --------------------------------------------------------------- checks

    def _flce_check_head_when_built(self) -> None:
        check_head_when_built(self)

    def _flce_check_vocab_parallel_layout(self) -> None:
        """Checks the head and the strategy at fit start (:func:`~lightning_flce.mixin_checks.check_vocab_parallel_layout`)."""
        check_vocab_parallel_layout(self, self.trainer)
