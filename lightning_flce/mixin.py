"""LightningModule mixin that computes the LM-head loss with fused linear cross-entropy."""

import abc
import difflib
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, TypeVar, Union, cast

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torchmetrics import MeanMetric

from lightning_flce.console import rank_zero_info_line
from lightning_flce.deprecation import RENAMED, accepts_renamed
from lightning_flce.eval_metrics import TokenMetrics
from lightning_flce.fsdp import register_fsdp_step_methods
from lightning_flce.head import FLCEHeadLoss, unwrap_head
from lightning_flce.head_discovery import HeadNotFoundError, head_logits, resolve_head
from lightning_flce.losses.policy import PolicyLossType
from lightning_flce.normalization import NORMALIZE_MODES, StepNormalizer, UnweightedTermWatch, scale_gradients
from lightning_flce.options import AccumDtype, FLCEOptions, ImplName, LogitsPrecision
from lightning_flce.outputs import FLCEOutput
from lightning_flce.parallel import VocabParallelHead
from lightning_flce.rl import LogProbsOutput, PolicyLossOutput, policy_normalizer
from lightning_flce.rl.head_calls import head_logprobs, head_policy_loss, policy_loss_module, shift_per_token

# the record's fields under the mixin's option names (its errors name what the user wrote)
_OPTION_NAMES = {field: f"flce_{field}" for field in FLCEOptions.field_names()}
# the deprecated flce_* names the mixin still takes (deprecation.RENAMED), renamed before __init__ runs
_RENAMED_OPTIONS = ("z_loss", "accum_fp32")
NARROW_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32)


def _check_no_unknown_flce_options(kwargs: dict, later_classes: tuple) -> None:
    """A misspelled ``flce_*`` option would otherwise reach ``LightningModule.__init__`` as an unexpected
    keyword argument of an unrelated class: name it and the option it was likely meant to be. Names that a
    class after the mixin in the MRO takes (its own ``flce_`` argument) pass on to it."""
    known = [name for name in inspect.signature(FLCEMixin.__init__).parameters if name.startswith("flce_")]
    # a misspelled deprecated name is suggested as the new one
    aliases = {f"flce_{old}": f"flce_{RENAMED[old].new}" for old in _RENAMED_OPTIONS}
    taken_later = {
        name
        for cls in later_classes
        if "__init__" in vars(cls)
        for name in inspect.signature(cls.__init__).parameters
    }
    for name in kwargs:
        if name.startswith("flce_") and name not in taken_later:
            close = difflib.get_close_matches(name, [*known, *aliases], n=1, cutoff=0.75)
            hint = (
                f"; did you mean {aliases.get(close[0], close[0])!r}?"
                if close
                else f"; the options are {', '.join(known)}"
            )
            raise TypeError(f"FLCEMixin got an unknown option {name!r}{hint}")


class _NormalizeBeforeCallbacks(Callback):
    """Manual optimization: the mixin's step normalization, ahead of every other callback's hook."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Optimizer) -> None:
        if isinstance(pl_module, FLCEMixin):
            pl_module.flce_normalize_gradients()


_Module = TypeVar("_Module")


class _ChecksHeadWhenBuilt(abc.ABCMeta):
    """Checks ``flce_head`` once the module is built: the mixin's ``__init__`` runs before the subclass's
    ``__init__`` creates the head, so the check runs when the outermost ``__init__`` has returned. (A wrapper
    of ``__init__`` would hide the subclasses' arguments from ``save_hyperparameters``, which reads the frames
    of the ``__init__`` chain.) An ``ABCMeta``, so that a module may also derive from an ``abc.ABC`` base (a
    class's metaclass must derive from each of its bases' metaclasses)."""

    def __call__(cls: type[_Module], *args: Any, **kwargs: Any) -> _Module:
        module = cast(_Module, type.__call__(cls, *args, **kwargs))
        if isinstance(module, FLCEMixin):
            module._flce_check_head_when_built()
        return module


if TYPE_CHECKING:
    # for type checkers the mixin is a LightningModule: its hooks override LightningModule's (and are checked
    # against them), and the Lightning API it calls on self is typed. At run time it is a plain mixin that
    # goes before LightningModule in the bases.
    from lightning.pytorch import LightningModule as _MixinBase
else:
    _MixinBase = object


class FLCEMixin(_MixinBase, metaclass=_ChecksHeadWhenBuilt):
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
        flce_normalize: Literal["step", "micro_batch"] = "step",
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
        _check_no_unknown_flce_options(kwargs, mro[mro.index(FLCEMixin) + 1 :])
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

    @property
    def flce_normalize(self) -> str:
        return self.flce_step_normalizer.mode

    @property
    def flce_eval_loss(self) -> MeanMetric:
        """The token-weighted mean loss of the (first) evaluation dataloader."""
        return cast(MeanMetric, self.flce_eval_metrics.loaders["0"].loss)

    @property
    def flce_eval_accuracy(self) -> MeanMetric:
        return cast(MeanMetric, self.flce_eval_metrics.loaders["0"].accuracy)

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
            if not isinstance(token_weight, Tensor):
                raise TypeError(f"token_weight must be a tensor or None, got {type(token_weight).__name__}")
            if token_weight.shape != target.shape:
                raise ValueError(
                    f"token_weight must have the target's shape {tuple(target.shape)}, got {tuple(token_weight.shape)}"
                )
        if target.dtype in NARROW_INT_DTYPES:  # ignore_index (-100) does not fit uint8, say
            target = target.long()
        if shift:
            # shift the labels rather than the hidden states: no copy of the [B, T, H] activations
            target = F.pad(target[..., 1:], (0, 1), value=self.flce_ignore_index)
            if token_weight is not None:
                token_weight = F.pad(token_weight[..., 1:], (0, 1), value=0)
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

        normalizer = self.flce_step_normalizer
        if stage != "train":
            self._flce_last_loss_weight = torch.ones((), device=num_tokens.device)
            if correct is not None:
                self.flce_eval_metrics.add(self._flce_dataloader_idx(), loss_sum, correct.sum(), num_tokens)
                self._flce_eval_stage = stage
            return loss_sum / num_tokens.clamp(min=1)
        if normalizer.needs_divisor:
            normalizer.agree_first_divisor(target.numel(), self._flce_mean_over_ranks(num_tokens.device))
        normalizer.count(loss_sum, num_tokens)
        if not loss_sum.requires_grad:  # nothing to back-propagate: counted now
            normalizer.commit(self.trainer.global_step)
        loss, self._flce_last_loss_weight = normalizer.loss_to_backward(loss_sum, num_tokens)
        if normalizer.rescales:
            self._flce_unweighted_term_watch.record(loss)
        return loss

    @property
    def flce_last_loss_weight(self) -> Optional[Tensor]:
        """Weight that makes another loss term (a micro-batch mean) count per token like the last ``flce_loss``
        output: its tokens over ``D`` under ``flce_normalize="step"`` in training, else 1 (a 0-d tensor; None
        before the first call). See the class docstring."""
        self._flce_unweighted_term_watch.mark_weight_read()
        return self._flce_last_loss_weight

    def flce_logits(self, hidden: Tensor) -> Tensor:
        """Logits of the head on ``hidden`` with the loss's logit scale and softcap (inference path)."""
        return head_logits(resolve_head(self, self.flce_head, self.flce_softcap), hidden)

    # -------------------------------------------------------------------- RL

    def flce_logprobs(
        self,
        hidden: Tensor,
        target: Tensor,
        *,
        shift: bool = False,
        temperature: Union[float, Tensor, None] = None,
        return_entropy: bool = False,
    ) -> LogProbsOutput:
        """Each token's log-probability of ``target`` under the head, and on request its entropy
        (:func:`~lightning_flce.fused_linear_logprobs`), both differentiable, without the logits.

        The head is found as :meth:`flce_loss` finds it, with the model's logit scale and softcap; the
        ``flce_ignore_index``, ``flce_logits_precision``, ``flce_chunk_size`` and ``flce_impl`` options apply.
        Under ``torch.no_grad()`` it is the reference or old-policy pass (one GEMM per chunk). A loss built on
        it is not normalized by the mixin (a step without :meth:`flce_loss` / :meth:`flce_policy_loss` calls
        keeps Lightning's plain averaging).

        Args:
            hidden: final hidden states [..., H].
            target: token ids [...] (``flce_ignore_index``: 0 and no gradient).
            shift: ``target`` holds the input ids: position t is scored against token t + 1 (the last position
                ignored); a per-token ``temperature`` is shifted with it.
            temperature: a positive float or a tensor of the target's shape dividing the softcapped logits;
                None: ``flce_temperature``.
            return_entropy: also compute each token's entropy.

        Returns:
            :class:`~lightning_flce.LogProbsOutput` (``.logprobs``, ``.entropy``) in the target's shape.
        """
        target = self._flce_rl_target(hidden, target, shift)
        if shift and isinstance(temperature, Tensor):
            temperature = shift_per_token(temperature, 1.0)
        policy = self.flce_policy.options
        return head_logprobs(
            self._flce_rl_head(),
            hidden,
            target,
            temperature=policy["temperature"] if temperature is None else temperature,
            return_entropy=return_entropy,
            **{name: policy[name] for name in ("ignore_index", "logits_precision", "chunk_size", "impl")},
        )

    def flce_policy_loss(
        self,
        hidden: Tensor,
        target: Tensor,
        *,
        advantages: Tensor,
        old_logprobs: Optional[Tensor] = None,
        ref_logprobs: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        token_weight: Optional[Tensor] = None,
        temperature: Optional[Tensor] = None,
        return_entropy: bool = False,
        shift: bool = False,
    ) -> PolicyLossOutput:
        """The clipped policy-gradient loss of the head (:func:`~lightning_flce.fused_linear_policy_loss`) with
        the mixin's options ``flce_loss_type``, ``flce_epsilon_low`` / ``flce_epsilon_high``, ``flce_beta``,
        ``flce_entropy_coef``, ``flce_temperature`` and ``flce_max_completion_length``, the head found as
        :meth:`flce_loss` finds it.

        Under ``flce_normalize="step"`` the loss is normalized as its loss type over the whole optimizer step
        (micro-batches and data-parallel ranks), as if the step's sequences were one call: ``"grpo"`` divides
        the sum of the sequences' masked means by the step's sequences, ``"bnpo"``/``"dapo"``/``"cispo"``/
        ``"ppo"`` the masked token sum by the step's masked tokens, ``"dr_grpo"`` by the step's sequences times
        ``flce_max_completion_length`` (default T). The mechanism is :meth:`flce_loss`'s (see the class
        docstring), with the loss type's count in place of the tokens; one step's calls must share one loss
        type's normalizer (and not mix with :meth:`flce_loss`).

        In training, logs the metrics as ``train/policy/<name>`` (this micro-batch's masked means; the last call's
        of the micro-batch, when it is back-propagated: ``on_before_backward`` must call ``super()``).

        Args:
            hidden: [B, T, H] hidden states predicting ``target``.
            target: [B, T] the sampled tokens.
            advantages: [B] or [B, T]; old_logprobs, ref_logprobs, mask, token_weight: [B, T] (see the function).
            temperature: a [B, T] tensor (per token, as the sampler) replacing ``flce_temperature`` for this call.
            return_entropy: compute each token's entropy (and ``entropy_mean``) without an entropy term (it is
                computed anyway when ``flce_entropy_coef`` is not 0).
            shift: ``target`` holds the input ids (position t is scored against t + 1): the [B, T] tensors are
                shifted with it (the last position leaves the mask) and the returned log-probabilities are the
                predicting positions'.

        Returns:
            :class:`~lightning_flce.PolicyLossOutput` whose ``loss`` value is the micro-batch's own normalized
            loss; in training under ``"step"`` its gradient is the micro-batch's share of the step's loss (the
            mixin rescales the gradients at the optimizer step).
        """
        target = self._flce_rl_target(hidden, target, shift)
        if shift:
            advantages = cast(Tensor, shift_per_token(advantages, 0.0))
            old_logprobs, ref_logprobs, token_weight = (
                shift_per_token(value, 0.0) for value in (old_logprobs, ref_logprobs, token_weight)
            )
            temperature = shift_per_token(temperature, 1.0)
            if mask is None:
                mask = torch.ones_like(target, dtype=torch.bool)
            mask = shift_per_token(mask, 0)
        output = head_policy_loss(
            self._flce_rl_head(),
            hidden,
            target,
            self.flce_policy,
            temperature=temperature,
            return_entropy=return_entropy,
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            mask=mask,
            token_weight=token_weight,
        )
        stage = self._flce_stage()
        if stage != "train":
            return output
        counted = target != self.flce_ignore_index
        if mask is not None:
            counted = counted & (mask != 0)
        options = self.flce_policy.options
        count, unit = policy_normalizer(
            options["loss_type"], counted.to(output.loss.dtype), options["max_completion_length"]
        )
        normalizer = self.flce_step_normalizer
        if normalizer.needs_divisor:  # fp16 gradients: D from the most this micro-batch could count
            capacity = target.numel() if unit == "completion tokens" else int(count)
            normalizer.agree_first_divisor(capacity, self._flce_mean_over_ranks(count.device))
        loss_sum = output.loss * count
        normalizer.count(loss_sum, count, unit)
        if not loss_sum.requires_grad:
            normalizer.commit(self.trainer.global_step)
        loss, self._flce_last_loss_weight = normalizer.loss_to_backward(loss_sum, count)
        if normalizer.rescales:
            self._flce_unweighted_term_watch.record(loss)
        # logged when the micro-batch is back-propagated (on_before_backward): self.log in a compiled step breaks it
        self._flce_policy_metrics = output.metrics
        return output._replace(loss=loss)

    def _flce_rl_target(self, hidden: Tensor, target: Tensor, shift: bool) -> Tensor:
        if not isinstance(hidden, Tensor) or not isinstance(target, Tensor):
            raise TypeError(
                f"the RL calls take the final hidden states and the target as tensors, got {type(hidden).__name__}"
                f" and {type(target).__name__}"
            )
        if target.dtype in NARROW_INT_DTYPES:
            target = target.long()
        if shift:
            target = F.pad(target[..., 1:], (0, 1), value=self.flce_ignore_index)
        return target

    def _flce_rl_head(self):
        if self.flce_naive:
            raise NotImplementedError("flce_naive=True has no RL path: the RL calls always use the fused ops")
        return resolve_head(self, self.flce_head, self.flce_softcap)

    # ----------------------------------------------------------------- hooks

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Union[Optimizer, LightningOptimizer],
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
        gradient_clip_val: Optional[Union[int, float]] = None,
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
        # fp16 gradients: D is agreed afresh at the first training call (this fit's ranks and batches may differ)
        self.flce_step_normalizer.start_fit(fp16_gradients=self._flce_fp16_gradients())
        if self.flce_normalize == "step" and "DeepSpeed" in type(self.trainer.strategy).__name__:
            raise ValueError(
                "flce_normalize='step' rescales param.grad, which DeepSpeed keeps in its own partitioned"
                " buffers; use flce_normalize='micro_batch' with DeepSpeed"
            )
        self._flce_check_vocab_parallel_layout()
        if not self.automatic_optimization:
            # Lightning calls callbacks' on_before_optimizer_step before the module's: normalize ahead of them
            callbacks = self.trainer.callbacks  # type: ignore[attr-defined]  # (set by Lightning's connector)
            if not any(isinstance(callback, _NormalizeBeforeCallbacks) for callback in callbacks):
                callbacks.insert(0, _NormalizeBeforeCallbacks())
        super().on_fit_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        # what a skipped batch (training_step returned None) counted is never back-propagated: forget it
        self.flce_step_normalizer.discard_pending()
        self._flce_policy_metrics = {}
        self._flce_unweighted_term_watch.reset()
        return super().on_train_batch_start(batch, batch_idx)

    def on_before_backward(self, loss: Tensor) -> None:
        # the micro-batch's flce_loss calls are back-propagated now: their tokens join the optimizer step
        self.flce_step_normalizer.commit(self.trainer.global_step)
        metrics, self._flce_policy_metrics = self._flce_policy_metrics, {}
        for (
            name,
            value,
        ) in metrics.items():  # the last flce_policy_loss call's: per step, so no batch size to weigh
            self.log(f"train/policy/{name}", value, on_step=True, on_epoch=False, batch_size=1)
        # "step" rescales every gradient at the optimizer step for the LM loss's token sum, so a term added to
        # flce_loss's output without flce_last_loss_weight is silently weighted ~1 / tokens: warn once.
        if self._flce_unweighted_term_watch.should_warn(loss):
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

    def on_validation_epoch_start(self) -> None:
        self._flce_start_eval_epoch(len(self.trainer.num_val_batches))
        super().on_validation_epoch_start()

    def on_test_epoch_start(self) -> None:
        self._flce_start_eval_epoch(len(self.trainer.num_test_batches))
        super().on_test_epoch_start()

    def on_validation_epoch_end(self) -> None:
        self._flce_log_eval("val")
        super().on_validation_epoch_end()

    def on_test_epoch_end(self) -> None:
        self._flce_log_eval("test")
        super().on_test_epoch_end()

    def on_fit_end(self) -> None:
        if self.flce_last_eval_metrics:
            rank_zero_info_line(
                f"FLCEMixin: last validation: {_summary(self.flce_last_eval_metrics)}", self._trainer
            )
        super().on_fit_end()

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

    def _flce_check_head_when_built(self) -> None:
        """Resolves the head as soon as the module is built, so a mistyped ``flce_head`` (with a close match),
        a head that is not a module or a logit transform that cannot be applied fails at construction, not at
        fit. A head that does not exist yet is checked at fit start instead: no ``flce_head`` and no head found,
        an owner on the path that is still None, or a first attribute missing from a module that builds its
        layers in ``configure_model`` or ``setup`` (unless a submodule's name is close to the path)."""
        try:
            resolve_head(self, self.flce_head, self.flce_softcap)
        except HeadNotFoundError as err:
            owner_built_later = err.parent_missing or (
                err.parent_path == "" and err.suggestion is None and _builds_layers_lazily(type(self))
            )
            if not owner_built_later:
                raise
        except AttributeError:
            if self.flce_head is not None:
                raise

    def _flce_check_vocab_parallel_layout(self) -> None:
        """Checks the head (its errors raise at fit start, after ``configure_model``) and raises for the
        strategies that cannot train a vocab-parallel head (see the class docstring)."""
        module = unwrap_head(resolve_head(self, self.flce_head, self.flce_softcap).module)
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

    def _flce_dataloader_idx(self) -> Optional[int]:
        """The evaluation dataloader of the batch in progress; None when there is only one."""
        results = getattr(self._trainer, "_results", None)
        return getattr(results, "dataloader_idx", None)

    def _flce_fp16_gradients(self) -> bool:
        return str(getattr(self.trainer, "precision", "")) in ("16-mixed", "16-true")

    def _flce_mean_over_ranks(self, device: torch.device) -> Optional[Callable[[Tensor], Tensor]]:
        trainer = self.trainer
        if trainer.world_size == 1:
            return None
        return lambda size: trainer.strategy.reduce(size.to(device), reduce_op="mean")

    def _flce_closure_then_normalize(
        self, closure: Callable[[], Any], optimizer: Union[Optimizer, LightningOptimizer]
    ) -> Any:
        result = closure()
        self._flce_finish_step(optimizer)
        return result

    def flce_normalize_gradients(self) -> None:
        """Manual optimization: normalize the step's gradients now (see the class docstring); a no-op once done.
        Call it after the step's last ``manual_backward``, before reading gradients in ``training_step``."""
        self._flce_finish_step(None)

    def _flce_finish_step(self, optimizer: Union[Optimizer, LightningOptimizer, None]) -> None:
        """Sums the step's loss and tokens over ranks, logs ``train/loss`` and (``"step"``) rescales the grads:
        those of ``optimizer`` under automatic optimization (its only optimizer), else of every parameter
        (manual optimization may step several optimizers, and normalizes at the first)."""
        trainer = self.trainer
        # With a VocabParallelHead inside a DP x TP world, each token is counted once per TP rank here, and
        # world_size includes the TP ranks too: the TP factor cancels in the scale and the logged mean.
        # With one single-device Trainer per TP rank, world_size is 1 and the local count is the step's count.
        finished = self.flce_step_normalizer.finish(
            world_size=trainer.world_size,
            accumulation=trainer.accumulate_grad_batches if self.automatic_optimization else 1,
            fp16_gradients=self._flce_fp16_gradients(),
            sum_over_ranks=(
                (lambda totals: trainer.strategy.reduce(totals, reduce_op="sum"))
                if trainer.world_size > 1
                else None
            ),
        )
        if finished is None:
            return
        if finished.grad_scale is not None:
            if self.automatic_optimization and optimizer is not None:
                if isinstance(optimizer, LightningOptimizer):
                    optimizer = optimizer.optimizer
                params = [p for group in optimizer.param_groups for p in group["params"]]
            else:
                params = list(self.parameters())
            scale_gradients(params, finished.grad_scale)
        self.log(
            "train/loss",
            finished.mean_loss,
            on_step=True,
            on_epoch=True,
            prog_bar=True,
            batch_size=max(int(finished.num_tokens), 1),
            # the value is global already: Lightning's sync averages equal values (and does not warn)
            sync_dist=True,
        )

    def _flce_start_eval_epoch(self, num_dataloaders: int) -> None:
        stage, self._flce_eval_stage = self._flce_eval_stage, None
        metrics = self.flce_eval_metrics
        if stage is not None and metrics.pending:
            rank_zero_warn(
                f"FLCEMixin: the {stage} metrics of an earlier evaluation were never logged; an overridden"
                " on_validation_epoch_end / on_test_epoch_end must call super() (it logs and resets them). They"
                " now mix evaluations."
            )
        # the sums the steps add to (made here, so that a compiled step finds them and does not recompile)
        metrics.start([None] if num_dataloaders <= 1 else range(num_dataloaders), self.device)

    def _flce_log_eval(self, prefix: str) -> None:
        """Logs ``{prefix}/loss``, ``/perplexity`` and ``/token_accuracy`` (``.../dataloader_idx_N`` for each of
        several dataloaders, as Lightning names metrics logged in their steps), and a one-line summary."""
        self._flce_eval_stage = None
        metrics: dict[str, Tensor] = {}
        for dataloader_idx, means in self.flce_eval_metrics.compute().items():
            suffix = "" if dataloader_idx is None else f"/dataloader_idx_{dataloader_idx}"
            metrics.update({f"{prefix}/{name}{suffix}": value for name, value in means.items()})
        if not metrics:
            return
        trainer = self._trainer
        for name, value in metrics.items():
            self.log(
                name,
                value,
                prog_bar=name.startswith(f"{prefix}/loss"),
                sync_dist=True,  # torchmetrics synced them: equal on every rank, as above
                add_dataloader_idx=False,  # named above (epoch end is outside any dataloader)
            )
        if trainer is not None and trainer.sanity_checking:
            return
        values = {name: float(value) for name, value in metrics.items()}
        if prefix == "val":
            self.flce_last_eval_metrics = values
        where = "" if trainer is None else f" (epoch {trainer.current_epoch}, step {trainer.global_step})"
        rank_zero_info_line(f"FLCEMixin {prefix}{where}: {_summary(values)}", trainer)


def _builds_layers_lazily(cls: type) -> bool:
    """Whether a class of the module overrides Lightning's ``configure_model`` or ``setup`` (where layers may be
    built after ``__init__``)."""
    for hook in ("configure_model", "setup"):
        owner = next((klass for klass in cls.__mro__ if hook in vars(klass)), None)
        if owner is not None and not owner.__module__.startswith(("lightning.", "pytorch_lightning.")):
            return True
    return False


def _summary(metrics: dict[str, float]) -> str:
    """``loss 5.1300, perplexity 169.0, token accuracy 0.2310`` (per dataloader: ``[dataloader 1] ...``)."""
    groups: dict[str, list] = {}
    for name, value in metrics.items():
        stem, _, loader = name.partition("/dataloader_idx_")
        label = stem.split("/", 1)[1].replace("_", " ")
        text = f"{label} {value:.4f}" if label != "perplexity" else f"{label} {value:.4g}"
        groups.setdefault(loader, []).append(text)
    return "; ".join(
        (f"[dataloader {loader}] " if loader else "") + ", ".join(texts) for loader, texts in groups.items()
    )
