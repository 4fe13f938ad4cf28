"""DistillationModule: a student LM trained on a frozen teacher's vocabulary distribution, with both LM heads
fused (:func:`~lightning_flce.fused_linear_distillation`): neither model's ``[N, V]`` logits exist.

The student is any model :class:`~lightning_flce.mixin.FLCEMixin` can train (TinyGPT, HFCausalLM,
LitGPTCausalLM): the module takes its final hidden states (its ``hidden_states`` method) and finds its LM head and
logit transforms (softcap, logit scale) as the mixin does. The teacher is another such model, a Hugging Face
causal LM, or a Lightning checkpoint of one (the main job's ``last.ckpt``); it is frozen, kept in eval mode, run
under ``no_grad`` and optionally in its own dtype. What the module adds to the loss op is the Lightning side:
the teacher's life cycle, the targets, the loss as the token mean of the whole optimizer step (``normalize``,
FLCEMixin's step normalization), the logging and the checkpoint.

.. code-block:: python

    from lightning_flce import DistillationModule
    from lightning_flce.models import TinyGPT

    module = DistillationModule(
        student=TinyGPT(d_model=64, n_layers=1),
        teacher_checkpoint="lightning_logs/default/tinygpt/checkpoints/last.ckpt",
        divergence="forward_kl",
        temperature=2.0,
    )
    L.Trainer(max_steps=300).fit(module, datamodule)

The bundled config ``distill`` (``lightning-flce fit --config distill``) does this on the CPU; ``docs/distill.md``
says when to use which divergence.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
import warnings
from typing import Any, NamedTuple, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor, nn

from lightning_flce.adapters import is_peft_lora_head
from lightning_flce.callbacks.checkpoint_identity import IDENTITY_KEY
from lightning_flce.callbacks.memory_model import head_compute_dtype
from lightning_flce.console import metrics_summary, rank_zero_info_line
from lightning_flce.data.dataset import check_label_format
from lightning_flce.distill.top_k import TEACHER_TOP_K_KEYS
from lightning_flce.fsdp import (
    fsdp2_unit_of,
    fully_shard_lm,
    is_fsdp2_module,
    register_fsdp_method,
    register_fsdp_step_methods,
)
from lightning_flce.head import unwrap_head
from lightning_flce.head_calls import run_in_head
from lightning_flce.head_discovery import ResolvedHead, is_hf_model, resolve_head
from lightning_flce.losses.distillation import DIVERGENCES, Divergence
from lightning_flce.mixin import NARROW_INT_DTYPES
from lightning_flce.mixin_checks import check_vocab_parallel_strategy
from lightning_flce.mixin_step import StepNormalization
from lightning_flce.models.gpt import adamw_with_warmup_cosine
from lightning_flce.models.hf import HFCausalLM
from lightning_flce.module_calls import forward_bound_to, has_call_hooks
from lightning_flce.normalization import StepNormalizer, UnweightedTermWatch
from lightning_flce.options import NORMALIZE_MODES, AccumDtype, FLCEOptions, LogitsPrecision, NormalizeMode
from lightning_flce.outputs import FLCEOutput
from lightning_flce.parallel import (
    VocabParallelHead,
    vocab_parallel_fused_linear_cross_entropy_with_stats,
    vocab_parallel_fused_linear_distillation,
    vocab_parallel_fused_linear_distillation_from_top_k,
)

__all__ = [
    "TEACHER_TOP_K_KEYS",
    "DistillationModule",
    "TeacherTopK",
    "final_hidden_states",
]

TEACHER_PREFIX = "teacher."
# the LightningModule of a checkpoint that does not record its class (LastStepCheckpoint records it)
_DEFAULT_TEACHER_CLASS = "lightning_flce.models.gpt.TinyGPT"
# order of an evaluation dataloader's sums: the loss, the divergence, the student's cross-entropy, correct tokens,
# tokens, batches
_EVAL_SUMS = ("loss", "divergence", "student_ce", "correct", "tokens", "batches")
# who runs the fused losses inside the heads' calls (run_in_head's errors)
_HEADS = "DistillationModule's heads"


class TeacherTopK(NamedTuple):
    """A cached teacher's top k for each position of a batch: its columns and its logits (or log-probabilities)
    there, [B, T, K] each (:func:`~lightning_flce.fused_linear_distillation_from_top_k`)."""

    indices: Tensor
    logits: Tensor


def model_lm_head(model: nn.Module) -> ResolvedHead:
    """The LM head of ``model`` found as :class:`~lightning_flce.mixin.FLCEMixin` finds it (its ``flce_head``
    and ``flce_softcap`` where it has them, else ``get_output_embeddings()`` or ``lm_head``), with the logit
    transforms the model declares."""
    return resolve_head(model, getattr(model, "flce_head", None), getattr(model, "flce_softcap", None))


def _weight_holder(head: nn.Module) -> nn.Module:
    """The module that holds an (unwrapped) LM head's output weight: the head, or a PEFT LoRA head's base layer."""
    return head.base_layer if is_peft_lora_head(head) else head


def _head_rows(model: nn.Module) -> int:
    """The vocabulary of ``model``'s LM head from the module's own sizes (a sharded weight's shape is a shard's)."""
    module = _weight_holder(unwrap_head(model_lm_head(model).module))
    if isinstance(module, VocabParallelHead):
        return module.vocab_size
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings
    raise TypeError(
        f"DistillationModule needs an LM head that computes F.linear(hidden, head.weight, head.bias) (an nn.Linear,"
        f" an nn.Embedding used as the tied output matrix, or a PEFT LoRA Linear) on {type(model).__name__}, got"
        f" {type(module).__name__}"
    )


def final_hidden_states(
    model: nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor] = None
) -> Tensor:
    """The hidden states [B, T, H] that ``model``'s LM head reads: its ``hidden_states`` method (TinyGPT,
    HFCausalLM, LitGPTCausalLM; given the attention mask where it takes one), or the decoder of a Hugging Face
    causal LM (run inside the model's own call where hooks, such as FSDP2's, wrap it)."""
    hidden_states = getattr(model, "hidden_states", None)
    if callable(hidden_states):
        if attention_mask is not None and "attention_mask" in inspect.signature(hidden_states).parameters:
            return hidden_states(input_ids, attention_mask=attention_mask)
        return hidden_states(input_ids)
    if is_hf_model(model):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model

        def decoder_hidden_states(*_: Any) -> Tensor:
            output = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        if not has_call_hooks(model):
            return decoder_hidden_states()
        # Inside the model's own call, so that what hooks it runs around the decoder: FSDP2 unshards the model's own
        # unit there (its embeddings and final norm, when the user sharded the layers and then the model).
        with forward_bound_to(model, decoder_hidden_states):
            return model(input_ids)
    raise TypeError(
        f"{type(model).__name__} has no `hidden_states(input_ids)` method and is no Hugging Face causal LM: the"
        " distillation loss needs the hidden states its LM head reads"
    )


def shard_models_fsdp2(root: pl.LightningModule, models: Sequence[Optional[nn.Module]]) -> None:
    """A ``configure_model`` under Lightning's ``ModelParallelStrategy`` (FSDP2) for a module that holds language
    models (a distillation's student and teacher, a cache's teacher): each model sharded by its own
    ``configure_model`` (a LightningModule's, as TinyGPT's: every block, an untied head, then the model) on the
    root's device mesh, then ``root`` as the root unit. A model without a ``configure_model`` of its own stays in
    the root unit. A no-op without a device mesh; models already sharded are left as they are."""
    if root.device_mesh is None:
        return
    if not is_fsdp2_module(root):
        for model in models:
            if isinstance(model, pl.LightningModule) and is_overridden(
                "configure_model", model, pl.LightningModule
            ):
                # Lightning gives the mesh to the root module only; the models' configure_model reads it there
                model._device_mesh = root.device_mesh
                model.configure_model()
    fully_shard_lm(root, root.device_mesh["data_parallel"])  # (the root; already sharded: left as it is)


def keep_heads_unsharded(
    root: nn.Module, models: Sequence[Optional[nn.Module]]
) -> list[tuple[nn.Module, nn.Module]]:
    """FSDP2 unshards a unit's parameters around ``forward`` only. So ``root``'s step methods and each model's
    ``hidden_states`` (what a fused head calls instead of ``forward``) are registered as forward methods. And a
    head that is not a unit of its own (tied to the embeddings, or left in its model's unit) has its weight in a
    unit that would reshard it when ``hidden_states`` returns, before the fused op reads it: that unit keeps its
    parameters unsharded after forward, as a root unit does, until the caller reshards it. Returns those
    ``(unit, model)`` pairs; none where nothing is sharded. Idempotent."""
    if not any(map(is_fsdp2_module, root.modules())):
        return []
    register_fsdp_step_methods(root)
    units: list[tuple[nn.Module, nn.Module]] = []
    for model in models:
        if model is None:
            continue
        register_fsdp_method(model, "hidden_states")
        head = unwrap_head(model_lm_head(model).module)
        unit = fsdp2_unit_of(root, _weight_holder(head).weight)
        if unit is None or unit is root or unit is head:  # the root: unsharded for the whole step
            continue
        if not hasattr(unit, "set_reshard_after_forward"):
            raise NotImplementedError(
                f"the {type(model).__name__}'s LM head is in the FSDP2 unit {type(unit).__name__}, not a unit of"
                " its own: with this torch's FSDP2 that unit cannot keep it unsharded for the loss (no"
                " set_reshard_after_forward); update torch, or shard the (untied) head as a unit of its own"
            )
        unit.set_reshard_after_forward(False, recurse=False)
        units.append((unit, model))
    return units


def _fused_distillation(*args: Any, **kwargs: Any) -> Tensor:
    """The loss op (imported at the call: the op does not depend on this module)."""
    from lightning_flce import fused_linear_distillation

    return fused_linear_distillation(*args, **kwargs)


def _fused_distillation_from_top_k(*args: Any, **kwargs: Any) -> Tensor:
    """The loss op for a cached teacher (imported at the call, as :func:`_fused_distillation`)."""
    from lightning_flce import fused_linear_distillation_from_top_k

    return fused_linear_distillation_from_top_k(*args, **kwargs)


def _strategy_loads_the_module(trainer: Optional[pl.Trainer]) -> bool:
    """Whether ``trainer``'s strategy loads a checkpoint's weights into the module in its own ``load_checkpoint``
    (FSDP1, FSDP2, DeepSpeed), before the module's ``on_load_checkpoint`` runs."""
    strategy = getattr(trainer, "strategy", None)
    return strategy is not None and type(strategy).load_checkpoint is not Strategy.load_checkpoint


def _frozen(tensor: Tensor) -> Tensor:
    """The frozen teacher head's ``tensor`` detached where it requires grad: a sharding wrapper may hand it over as a
    view that does (FSDP1's unsharded views of a flat parameter that also holds trainable ones, with
    ``use_orig_params``), which the op would refuse as a teacher that needs a gradient."""
    return tensor.detach() if tensor.requires_grad else tensor


def vocab_parallel_lm_head(model: nn.Module) -> Optional[VocabParallelHead]:
    """``model``'s LM head (found as :func:`model_lm_head` finds it) where it is a
    :class:`~lightning_flce.parallel.VocabParallelHead` (a tensor-parallel model's), else None."""
    head = unwrap_head(model_lm_head(model).module)
    return head if isinstance(head, VocabParallelHead) else None


def _vocab_parallel_head(student: nn.Module, teacher: Optional[nn.Module]) -> Optional[VocabParallelHead]:
    """The student's LM head when it is a :class:`~lightning_flce.parallel.VocabParallelHead` (a teacher model's
    must then be one with the same group and rows; a cached teacher has none), else None (and the teacher's must
    not be one); a clear error otherwise."""
    head = vocab_parallel_lm_head(student)
    if teacher is None:
        return head
    teacher_head = vocab_parallel_lm_head(teacher)
    if (teacher_head is None) != (head is None):
        which = "student's" if head is not None else "teacher's"
        raise ValueError(
            f"only the {which} LM head is a VocabParallelHead: shard both heads over the vocabulary alike (the same"
            " rows of the shared tokenizer on each rank, e.g. VocabParallelHead.from_linear(head, group=tp_group)"
            " on both models) or neither"
        )
    if head is None or teacher_head is None:
        return None
    layout = (head.vocab_size, head.vocab_start, head.weight.shape[0])
    teacher_layout = (teacher_head.vocab_size, teacher_head.vocab_start, teacher_head.weight.shape[0])
    if teacher_head.group is not head.group or layout != teacher_layout:
        raise ValueError(
            "the student's and the teacher's VocabParallelHeads must be sharded alike: the same group and, on each"
            f" rank, the same rows; got (vocabulary, first row, rows) {layout} for the student and {teacher_layout}"
            " for the teacher"
        )
    return head


def _cached_top_k(batch: dict[str, Tensor], positions: tuple[int, ...]) -> TeacherTopK:
    """The batch's cached teacher top k (``TEACHER_TOP_K_KEYS``), [B, T, K] each over the ``input_ids`` positions
    ``positions``; a clear error when the keys are missing or their shapes disagree."""
    missing = [key for key in TEACHER_TOP_K_KEYS if key not in batch]
    if missing:
        raise KeyError(
            f"cached_teacher=True needs the teacher's top k in every batch: missing {missing} (both [B, T, K]:"
            " the columns and the teacher's logits or log-probabilities there, aligned with input_ids)"
        )
    indices, logits = (batch[key] for key in TEACHER_TOP_K_KEYS)
    for key, value in zip(TEACHER_TOP_K_KEYS, (indices, logits)):
        if value.dim() != len(positions) + 1 or tuple(value.shape[:-1]) != positions:
            raise ValueError(
                f"the batch's {key} must be [*input_ids.shape, K] = [{', '.join(map(str, positions))}, K], got"
                f" {tuple(value.shape)}"
            )
    return TeacherTopK(indices, logits.detach())


class DistillationModule(StepNormalization, pl.LightningModule):
    r"""Trains ``student`` to match a frozen teacher's next-token distribution, with the fused linear
    distillation loss on both LM heads (:func:`~lightning_flce.fused_linear_distillation`).

    Each token's loss is ``(1 - hard_weight) · divergence + hard_weight · CE``: the divergence between the
    teacher's and the student's softmaxes of their (softcapped, scaled) logits over ``temperature``, and the
    student's cross-entropy on the batch's labels (no temperature). Tokens whose label is the student's
    ``flce_ignore_index`` (or whose ``attention_mask`` is 0) carry no loss. ``temperature_squared=True``
    multiplies the divergence term by ``T²`` (Hinton et al.: the soft term's gradients shrink as ``1 / T²``, so the
    factor keeps its weight against the cross-entropy when the temperature changes); off by default, as in the op.

    Batches are the student's: ``{"input_ids", "labels"}`` with labels already shifted (TinyGPT, LitGPT; data
    ``label_format: shifted``), or in the Hugging Face convention (the student is an :class:`HFCausalLM` or a
    Hugging Face model; ``label_format: hf``, labels default to ``input_ids`` and are shifted here). Both
    models read the same ``input_ids``: they must share the tokenizer, and their vocabularies must match.

    **The teacher** is frozen (``requires_grad=False``), in eval mode (also after Lightning's ``train()`` calls),
    run under ``torch.no_grad()``; with ``teacher_dtype`` its parameters are cast to that dtype (again at the start
    of fit, validation and test, after a ``"*-true"`` precision converted the module) and it runs outside
    autocast. It is left out of the optimizer and out of the checkpoint: ``on_save_checkpoint`` drops its weights
    (a checkpoint holds the student, as it would without distillation) and ``on_load_checkpoint`` puts this
    module's teacher back, so resuming (``--ckpt_path last``) and ``load_from_checkpoint`` rebuild the teacher
    from ``teacher`` / ``teacher_checkpoint`` as given.

    **A cached teacher** (``cached_teacher=True``): no teacher model runs; each batch carries the teacher's top k
    per position, ``teacher_top_k_indices`` (integer columns) and ``teacher_top_k_logits`` (its logits or
    log-probabilities there; -inf pads a position with fewer entries), both ``[B, T, K]`` and aligned with
    ``input_ids`` (position t's entries are the teacher's distribution of the token after t, as its logits at t
    are). The divergence is over each position's K columns, both distributions renormalized there
    (:func:`~lightning_flce.fused_linear_distillation_from_top_k`); the cross-entropy stays over the whole
    vocabulary.

    **Normalization** (``normalize``, as :class:`~lightning_flce.mixin.FLCEMixin`'s ``flce_normalize``, whose
    wiring it is: :class:`~lightning_flce.mixin_step.StepNormalization`): under ``"step"`` the training loss is
    the mean over the tokens that carry a loss of the whole optimizer step, across the micro-batches of gradient
    accumulation and the DDP ranks. Each micro-batch back-propagates its token sum (over a power of two ``D``
    with fp16 gradients), and after the step's last backward one ``all_reduce`` sums the step's loss and
    tokens over the ranks and the student's gradients are multiplied by
    ``accumulate_grad_batches * world_size * D / tokens_of_step``. So overrides of ``on_fit_start``,
    ``on_train_batch_start``, ``on_before_backward`` and of ``optimizer_step`` / ``on_before_optimizer_step``
    must call ``super()``, another term added to the training step's loss is rescaled with it, and DeepSpeed
    needs ``"micro_batch"``. Under ``"micro_batch"`` the loss is each micro-batch's token mean; Lightning
    averages micro-batches and DDP ranks, so a micro-batch with few tokens weighs as much as a full one (with
    unpadded batches of one length both modes agree). The student's own ``flce_normalize`` is not used.

    **Logged**: ``train/loss`` (the token mean of the optimizer step over its micro-batches and ranks, in both
    modes; per step and epoch, in the progress bar); at the end of each validation
    ``val/loss`` (the training loss's formula), ``val/divergence``, ``val/student_ce`` (the student's plain
    cross-entropy on the labels), ``val/perplexity`` (its exp) and ``val/token_accuracy``, token-weighted over
    the whole validation and all ranks, and a console line with them; with several validation dataloaders one set
    each, under Lightning's names (``val/loss/dataloader_idx_N``, ...). ``trainer.test`` logs the same as
    ``test/*``.

    **Sharded** (FSDP2, Lightning's ``ModelParallelStrategy``): :meth:`configure_model` shards the student and the
    teacher, each by its own ``configure_model`` (TinyGPT's: every block, an untied head, then the model), and
    this module as the root. Both heads are read only inside their own calls (``docs/distill.md``, "Sharded
    training"), so hooks around a head (FSDP2's unsharding, ZeRO-3's gathering, PEFT) run around the loss, and a
    PEFT LoRA head is computed exactly. FSDP1 (``FSDPStrategy``) and DeepSpeed ZeRO-3 (``normalize="micro_batch"``)
    need nothing more; their checkpoints keep the teacher (they load it before ``on_load_checkpoint``).

    **Memory**: after each loss call ``flce_last_logits_shape = (N, V)`` and ``flce_last_teacher_logits_shape``
    report the student's and the teacher's avoided logits to
    :class:`~lightning_flce.callbacks.FLCEMemoryCallback` (which adds the teacher's logits and softmax to the
    unfused figure).

    Args:
        student: the model to train (an :class:`~lightning_flce.mixin.FLCEMixin` model, e.g. ``TinyGPT``). Not
            saved in the hyper-parameters (the CLI's config records it): pass it again to ``load_from_checkpoint``.
        teacher: the teacher as a module (a TinyGPT, an HFCausalLM, an ``AutoModelForCausalLM``), or
        teacher_checkpoint: the path of a Lightning checkpoint of the teacher (e.g. the main job's
            ``last.ckpt``); its class is the one ``LastStepCheckpoint`` recorded, else TinyGPT.
        cached_teacher: the batches carry the teacher's top k (``TEACHER_TOP_K_KEYS``; "A cached teacher"
            above) and no teacher model runs. Exactly one of ``teacher``, ``teacher_checkpoint`` and this.
        teacher_dtype: ``"bfloat16"``, ``"float32"``, ... (a ``torch`` dtype's name): the teacher's parameters
            in that dtype and its body run outside autocast. None: the teacher follows the Trainer's precision.
            (Under mixed precision the loss's two head GEMMs run in the autocast dtype, as ``nn.Linear``'s would.)
            A strategy that overrides it (FSDP1 and DeepSpeed convert a ``"*-true"`` module they wrap) is refused at
            the first loss with a clear error; FSDP2 keeps it.
        divergence: ``"forward_kl"`` (KL(teacher ‖ student)), ``"reverse_kl"`` (KL(student ‖ teacher)) or
            ``"jsd"`` (generalized Jensen-Shannon with ``beta``).
        beta: the teacher's weight in JSD's mixture (0: forward KL, 1: reverse KL).
        temperature: divides both models' logits before their softmaxes (not the cross-entropy's).
        temperature_squared: multiply the divergence term by ``temperature ** 2``.
        hard_weight: weight of the student's cross-entropy on the labels, in [0, 1].
        top_k: the divergence over the teacher's ``top_k`` most likely tokens, both distributions renormalized
            there; None: the whole vocabulary (a cached teacher's K is its own: None).
        chunk_size: tokens per chunk of the fused loss; None: the op chooses. (The student's own ``flce_*`` loss
            options are not used, but for ``flce_head``, ``flce_softcap`` and ``flce_ignore_index``.)
        normalize: ``"step"``: the training loss is the token mean of the whole optimizer step (micro-batches
            and ranks); ``"micro_batch"``: each micro-batch's token mean (see Normalization above).
        logits_precision: the precision of both heads' chunk logits (``"input"``, ``"fp32"``, ...).
        accum_dtype: the student's head-weight gradient accumulator over chunks (``"float32"``, ``"bfloat16"``,
            ...; ``accum_dtype`` of :func:`~lightning_flce.fused_linear_distillation`). None: the op chooses (fp32
            for 16-bit GEMMs); the weight's own dtype saves its [V, H] fp32 accumulator.
        vocab_size: the data's vocabulary (``lightning-flce`` links the tokenizer's size to it), at most either
            head's rows: the loss (and the validation's student CE) runs over the first ``vocab_size`` rows of both
            heads, so heads padded to different row counts for one tokenizer distill (Qwen2.5-7B's head has 152064
            rows, 0.5B's 151936, for 151665 tokens); rows past it get no gradient. None: the two heads must have the
            same rows, all of them used.
        lr: peak learning rate of AdamW (the student's parameters).
        weight_decay: AdamW weight decay of the matrices; biases and norms get none.
        warmup_steps: linear warmup steps, then cosine decay to 10% of ``lr``.

    .. code-block:: yaml

        model:
          class_path: lightning_flce.models.DistillationModule
          init_args:
            student:
              class_path: lightning_flce.models.TinyGPT
              init_args: {d_model: 64, n_layers: 1}
            teacher_checkpoint: lightning_logs/default/tinygpt/checkpoints/last.ckpt
            divergence: forward_kl
            temperature: 2.0
    """

    _flce_normalize_option = "normalize"  # (StepNormalization's error messages)

    def __init__(
        self,
        student: nn.Module,
        teacher: Optional[nn.Module] = None,
        teacher_checkpoint: Optional[str] = None,
        teacher_dtype: Optional[str] = None,
        cached_teacher: bool = False,
        divergence: Divergence = "jsd",
        beta: float = 0.5,
        temperature: float = 1.0,
        temperature_squared: bool = False,
        hard_weight: float = 0.0,
        top_k: Optional[int] = None,
        chunk_size: Optional[int] = None,
        logits_precision: LogitsPrecision = "input",
        accum_dtype: AccumDtype = None,
        normalize: NormalizeMode = "step",
        vocab_size: Optional[int] = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
    ) -> None:
        super().__init__()
        _check_loss_options(divergence, beta, temperature, hard_weight, top_k)
        FLCEOptions.of(accum_dtype=accum_dtype)  # a dtype's name: checked now, not at the first step
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
        if (teacher is not None) + (teacher_checkpoint is not None) + bool(cached_teacher) != 1:
            raise ValueError(
                "DistillationModule takes exactly one of `teacher` (a module), `teacher_checkpoint` (the path"
                " of a Lightning checkpoint, e.g. the main job's last.ckpt) and `cached_teacher=True` (the"
                f" batches carry the teacher's top k: {', '.join(TEACHER_TOP_K_KEYS)})"
            )
        if cached_teacher and (teacher_dtype is not None or top_k is not None):
            raise ValueError(
                "cached_teacher=True runs no teacher model: teacher_dtype must be None, and top_k None (the"
                " cache's K is the top k)"
            )
        self.save_hyperparameters(ignore=["student", "teacher"])
        self.student = student  # registered first: its [V, H] head is the module's first (FLCEMemoryCallback)
        if teacher is None and teacher_checkpoint is not None:
            teacher = load_teacher_checkpoint(str(teacher_checkpoint))
        self.teacher_dtype = None if teacher_dtype is None else dtype_named(teacher_dtype)
        if teacher is not None:
            teacher.requires_grad_(False)
            teacher.eval()
            if self.teacher_dtype is not None:
                teacher.to(self.teacher_dtype)
        #: the frozen teacher model (None with ``cached_teacher``: the batches carry its top k)
        self.teacher: Optional[nn.Module] = teacher
        self.ignore_index = int(getattr(student, "flce_ignore_index", -100))
        self.label_format = "hf" if isinstance(student, HFCausalLM) or is_hf_model(student) else "shifted"
        self._check_vocabularies(vocab_size)
        self.flce_last_logits_shape: Optional[tuple[int, int]] = None
        self.flce_last_logits_bytes: Optional[int] = None
        self.flce_last_teacher_logits_shape: Optional[tuple[int, int]] = None
        self.flce_teacher_compute_dtype: Optional[torch.dtype] = None
        #: the arithmetic of ``normalize`` (token totals of the optimizer step, fp16 divisor, gradient scale)
        self.flce_step_normalizer = StepNormalizer(normalize)
        self._flce_unweighted_term_watch = UnweightedTermWatch()
        self._flce_last_loss_weight: Optional[Tensor] = None
        #: the metrics logged at the end of the last validation (``{"val/loss": ..., ...}``)
        self.last_val_metrics: dict[str, float] = {}
        # [dataloaders, _EVAL_SUMS] float64 token sums of the evaluation in progress
        self._eval_sums: Optional[Tensor] = None
        # FSDP2 units kept unsharded after forward for a head not in a unit of its own, and whether each is the
        # teacher's (_prepare_fsdp2)
        self._fsdp_head_units: list[tuple[nn.Module, bool]] = []

    # ------------------------------------------------------------- the teacher

    def train(self, mode: bool = True) -> DistillationModule:
        """Lightning puts the module in train mode before each training epoch: the teacher stays in eval
        mode (no dropout, running statistics unchanged)."""
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()
        return self

    def _keep_teacher_dtype(self) -> None:
        # a "*-true" precision converted the whole module (teacher included) after __init__
        if self.teacher is not None and self.teacher_dtype is not None:
            self.teacher.to(self.teacher_dtype)

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (FSDP2): the student and the teacher each sharded by its own
        ``configure_model``, then this module as the root unit (:func:`shard_models_fsdp2`), and the methods the
        loss calls instead of ``forward`` registered with FSDP2 (:meth:`_prepare_fsdp2`). A no-op without a device
        mesh, and for a module already sharded (``configure_model`` runs again for ``trainer.validate`` after
        ``fit``)."""
        shard_models_fsdp2(self, (self.student, self.teacher))
        self._prepare_fsdp2()

    def _prepare_fsdp2(self) -> None:
        """The step methods and each model's ``hidden_states`` registered with FSDP2, and the units that hold a
        head (not a unit of its own) kept unsharded after forward (:func:`keep_heads_unsharded`; the student's
        until its backward, the teacher's until the loss has run: :meth:`_reshard_head_units`). No-ops for
        modules that are not sharded, and when called again."""
        units = keep_heads_unsharded(self, (self.student, self.teacher))
        self._fsdp_head_units = [(unit, model is self.teacher) for unit, model in units]

    def _reshard_head_units(self, *, teacher_only: bool) -> None:
        """Frees the unsharded parameters that :meth:`_prepare_fsdp2` kept for the loss, once it has run: the
        teacher's at once (it needs none in backward; FSDP2 would reshard them only at the end of the student's
        backward), and after a validation step (no backward) the student's."""
        for unit, is_teacher in self._fsdp_head_units:
            if is_teacher or not teacher_only:
                unit.reshard()

    def on_fit_start(self) -> None:
        self._prepare_fsdp2()
        self._keep_teacher_dtype()
        if self._trainer is not None:
            check_vocab_parallel_strategy(
                unwrap_head(model_lm_head(self.student).module), self._trainer, "DistillationModule"
            )
        if self._trainer is not None:  # (the hook may be called alone, to cast the teacher back)
            self._flce_start_fit_normalization()
            self._flce_add_normalize_callback()
        if self.teacher is None:
            return
        # Lightning warns at the start of training when modules are in eval mode: the teacher's are, by design.
        # Silenced for exactly their count (a student module left in eval mode changes the count and still warns).
        teacher_modules = sum(1 for _ in self.teacher.modules())
        warnings.filterwarnings(
            "ignore",
            message=re.escape(f"Found {teacher_modules} module(s) in eval mode at the start of training."),
            category=PossibleUserWarning,
        )

    def on_validation_start(self) -> None:
        self._prepare_fsdp2()
        self._keep_teacher_dtype()

    def on_test_start(self) -> None:
        self._prepare_fsdp2()
        self._keep_teacher_dtype()

    @torch.no_grad()
    def teacher_hidden_states(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """The teacher's final hidden states, without gradient, in ``teacher_dtype`` outside autocast when set."""
        if self.teacher is None:
            raise RuntimeError(
                "this DistillationModule has a cached teacher (cached_teacher=True): no teacher model"
            )
        if self.teacher_dtype is None:
            return final_hidden_states(self.teacher, input_ids, attention_mask)
        with torch.autocast(input_ids.device.type, enabled=False):
            return final_hidden_states(self.teacher, input_ids, attention_mask)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Leaves the teacher's weights out: it is rebuilt from ``teacher`` / ``teacher_checkpoint``. Not where the
        strategy loads a checkpoint into the module itself (its own ``load_checkpoint``: FSDP1's ``FSDPStrategy``,
        FSDP2's ``ModelParallelStrategy``, sharded or full; DeepSpeed keeps its own files anyway): that strict load
        runs before :meth:`on_load_checkpoint` could put the teacher back and fails on its missing keys, so there the
        teacher is kept (and loaded back unchanged: it is frozen)."""
        state = checkpoint.get("state_dict")
        if state is None or _strategy_loads_the_module(self._trainer):
            return
        for name in [name for name in state if name.startswith(TEACHER_PREFIX)]:
            del state[name]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Puts this module's teacher into the checkpoint's weights, so that strict loading (and the resume
        check of ``LastStepCheckpoint``) finds every parameter and the teacher stays as built."""
        state = checkpoint.get("state_dict")
        if state is not None and self.teacher is not None:
            for name, value in self.teacher.state_dict().items():
                state.setdefault(TEACHER_PREFIX + name, value)

    # ----------------------------------------------------------------- steps

    def setup(self, stage: str) -> None:
        check_label_format(self, self.label_format)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        student_hidden, teacher_side, target = self._forward_both(batch)
        # d · D + w · CE as one call of the op, which mixes (1 - h) · D + h · CE: (d + w) times h = w / (d + w)
        divergence_weight, ce_weight = self.loss_weights
        total = divergence_weight + ce_weight
        loss_sum = total * self._loss_sum(student_hidden, teacher_side, target, ce_weight / total)
        num_tokens = (target != self.ignore_index).sum()
        if self._flce_stage() != "train":  # called outside fit: the plain micro-batch mean, nothing to join
            return loss_sum / num_tokens.clamp(min=1)
        # the micro-batch mean (0 with the graph connected when no token counts), joined to the optimizer step;
        # "step": its gradient is the token sum's over D, rescaled at the optimizer step (which logs train/loss)
        return self._flce_count_for_step(loss_sum, num_tokens, capacity=target.numel())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        self._flce_start_micro_batch()
        return super().on_train_batch_start(batch, batch_idx)

    def on_before_backward(self, loss: Tensor) -> None:
        self._flce_commit_micro_batch(loss)
        super().on_before_backward(loss)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._add_eval_batch(batch, dataloader_idx)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._add_eval_batch(batch, dataloader_idx)

    def on_validation_epoch_start(self) -> None:
        self._start_eval(len(self.trainer.num_val_batches))

    def on_test_epoch_start(self) -> None:
        self._start_eval(len(self.trainer.num_test_batches))

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _start_eval(self, num_dataloaders: int) -> None:
        # one row of sums per dataloader, made here so that every rank reduces the same shape
        self._eval_sums = torch.zeros(
            max(num_dataloaders, 1), len(_EVAL_SUMS), dtype=torch.float64, device=self.device
        )

    def _add_eval_batch(self, batch: dict[str, Tensor], dataloader_idx: int) -> None:
        """An evaluation batch's token sums (``_EVAL_SUMS``) into its dataloader's row."""
        student_hidden, teacher_side, target = self._forward_both(batch)
        divergence = self._loss_sum(student_hidden, teacher_side, target, 0.0)
        ce, correct = self._student_cross_entropy(student_hidden, target)
        self._reshard_head_units(teacher_only=False)
        divergence_weight, ce_weight = self.loss_weights
        loss = divergence_weight * divergence + ce_weight * ce
        num_tokens = (target != self.ignore_index).sum()
        batches = num_tokens.new_ones(())
        sums = torch.stack([value.double() for value in (loss, divergence, ce, correct, num_tokens, batches)])
        rows = self._eval_sums
        # rows is None (or short) without the epoch-start hook (overridden without super())
        if rows is None or dataloader_idx >= rows.shape[0]:
            grown = torch.zeros(dataloader_idx + 1, len(_EVAL_SUMS), dtype=torch.float64, device=sums.device)
            if rows is not None:
                grown[: rows.shape[0]] = rows
            self._eval_sums = rows = grown
        rows[dataloader_idx] += sums

    def _log_eval(self, prefix: str) -> None:
        """Logs ``{prefix}/loss``, ``/divergence``, ``/student_ce``, ``/token_accuracy`` and ``/perplexity``, token
        means over the evaluation and the ranks (``.../dataloader_idx_N`` for each of several dataloaders, as
        Lightning names metrics logged in their steps), and a console line."""
        sums, self._eval_sums = self._eval_sums, None
        if sums is None:
            return
        if self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        metrics: dict[str, float] = {}
        for dataloader_idx, row in enumerate(sums.tolist()):
            totals = dict(zip(_EVAL_SUMS, row))
            if not totals["batches"]:  # a dataloader without batches on any rank logs nothing
                continue
            tokens = max(totals["tokens"], 1.0)
            means = {
                "loss": totals["loss"] / tokens,
                "divergence": totals["divergence"] / tokens,
                "student_ce": totals["student_ce"] / tokens,
                "token_accuracy": totals["correct"] / tokens,
            }
            means["perplexity"] = math.exp(min(means["student_ce"], 700.0))
            suffix = f"/dataloader_idx_{dataloader_idx}" if sums.shape[0] > 1 else ""
            metrics.update({f"{prefix}/{name}{suffix}": value for name, value in means.items()})
        for name, value in metrics.items():
            # equal on every rank (summed above): Lightning's sync then averages equal values
            self.log(
                name,
                value,
                prog_bar=name.startswith(f"{prefix}/loss"),
                sync_dist=True,
                add_dataloader_idx=False,  # named above (the epoch's end is outside any dataloader)
            )
        if not metrics or self.trainer.sanity_checking:
            return
        if prefix == "val":
            self.last_val_metrics = metrics
        rank_zero_info_line(
            f"Distillation {prefix} (epoch {self.trainer.current_epoch}, step {self.trainer.global_step}): "
            + metrics_summary(metrics),
            self.trainer,
        )

    def on_fit_end(self) -> None:
        if self.last_val_metrics:
            rank_zero_info_line(
                f"Distillation: last validation: {metrics_summary(self.last_val_metrics)}", self.trainer
            )

    def configure_optimizers(self) -> OptimizerLRScheduler:
        # the teacher's parameters do not require grad: AdamW gets the student's only
        return adamw_with_warmup_cosine(
            self,
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
            warmup_steps=self.hparams.warmup_steps,
        )

    def forward(self, input_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """The student's logits (inference path)."""
        return self.student(input_ids, *args, **kwargs)

    # --------------------------------------------------------------- helpers

    @property
    def flce_loss_options(self) -> FLCEOptions:
        """The fused loss's options that set its memory (``logits_precision``, ``accum_dtype``, ``chunk_size``), for
        ``FLCEMemoryCallback``'s estimate (the student's own ``flce_*`` options are not used)."""
        hp = self.hparams
        return FLCEOptions.of(
            logits_precision=hp.logits_precision, accum_dtype=hp.accum_dtype, chunk_size=hp.chunk_size
        )

    @property
    def loss_weights(self) -> tuple[float, float]:
        """The weights of the divergence and of the cross-entropy in each token's loss: ``1 - hard_weight``
        (times ``temperature ** 2`` with ``temperature_squared``) and ``hard_weight``."""
        hp = self.hparams
        divergence_weight = 1.0 - hp.hard_weight
        if hp.temperature_squared:
            divergence_weight *= hp.temperature**2
        return divergence_weight, float(hp.hard_weight)

    def _forward_both(self, batch: dict[str, Tensor]) -> tuple[Tensor, Union[Tensor, TeacherTopK], Tensor]:
        """The student's hidden states of the batch, the teacher's (or its cached top k), and the target of each
        position."""
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        target = batch.get("labels", input_ids if self.label_format == "hf" else None)
        if target is None:
            raise KeyError(
                "the batch has no `labels` (label_format 'shifted': the token after each position)"
            )
        if target.dtype in NARROW_INT_DTYPES:  # ignore_index (-100) must fit
            target = target.long()
        if attention_mask is not None:
            target = target.masked_fill(attention_mask == 0, self.ignore_index)
        if self.label_format == "hf":  # position t predicts label t + 1; the last position has none
            target = F.pad(target[..., 1:], (0, 1), value=self.ignore_index)
        teacher_side: Union[Tensor, TeacherTopK]
        if self.teacher is None:
            teacher_side = _cached_top_k(batch, tuple(input_ids.shape))
        else:
            teacher_side = self.teacher_hidden_states(input_ids, attention_mask)
        student_hidden = final_hidden_states(self.student, input_ids, attention_mask)
        return student_hidden, teacher_side, target

    def _loss_sum(
        self,
        student_hidden: Tensor,
        teacher_side: Union[Tensor, TeacherTopK],
        target: Tensor,
        hard_weight: float,
    ) -> Tensor:
        """The token sum of the loss (``hard_weight`` 0: of the divergence) over the tokens that carry one.

        The op runs inside the student head's own call and, with a teacher model, inside the teacher head's call
        nested in it (:func:`~lightning_flce.head_calls.run_in_head`): whatever hooks either head (FSDP2's
        unsharding, ZeRO-3's gathering, PEFT) runs around it, and each head's logit scale multiplies its hidden
        states and bias."""
        hp = self.hparams
        student_head = model_lm_head(self.student)
        sharded = _vocab_parallel_head(self.student, self.teacher)
        if sharded is not None and hp.vocab_size not in (None, sharded.vocab_size):
            raise NotImplementedError(
                "VocabParallelHeads distill over their whole vocabulary: a vocab_size below the heads'"
                f" {sharded.vocab_size} rows is not supported with them"
            )
        # the options both front ends of the op take: the student's softcap and the module's loss options
        shared: dict[str, Any] = dict(
            divergence=hp.divergence,
            beta=hp.beta,
            temperature=hp.temperature,
            hard_weight=hard_weight,
            ignore_index=self.ignore_index,
            reduction="sum",
            vocab_size=hp.vocab_size,
            student_softcap=student_head.softcap,
            logits_precision=hp.logits_precision,
            accum_dtype=hp.accum_dtype,
            chunk_size=hp.chunk_size,
        )
        # the vocab-parallel front ends': every row of the sharded heads (a smaller vocab_size is refused above)
        sharded_options = {key: value for key, value in shared.items() if key != "vocab_size"}

        def student_loss(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
            rows = weight.shape[0] if hp.vocab_size is None else hp.vocab_size  # the loss's logits
            self.flce_last_logits_shape = (target.numel(), rows)
            self.flce_last_logits_bytes = target.numel() * rows * 4
            if isinstance(teacher_side, TeacherTopK):  # no teacher head: no teacher logits to avoid
                self.flce_last_teacher_logits_shape = None
                self.flce_teacher_compute_dtype = None
                if sharded is not None:  # this rank's rows of the student's head
                    return vocab_parallel_fused_linear_distillation_from_top_k(
                        hidden,
                        weight,
                        teacher_side.indices,
                        teacher_side.logits,
                        target,
                        student_bias_shard=bias,
                        group=sharded.group,
                        vocab_start=sharded.vocab_start,
                        **sharded_options,
                    )
                return _fused_distillation_from_top_k(
                    hidden,
                    weight,
                    teacher_side.indices,
                    teacher_side.logits,
                    target,
                    student_bias=bias,
                    **shared,
                )
            assert self.teacher is not None  # a tensor of hidden states comes from the teacher model
            teacher_head = model_lm_head(self.teacher)
            losses: list[Tensor] = []

            def teacher_loss(
                teacher_hidden: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor]
            ) -> Tensor:
                self._check_teacher_dtype(teacher_weight)
                self.flce_last_teacher_logits_shape = (target.numel(), rows)
                # the teacher head's GEMM dtype: the autocast dtype under mixed precision (the op's rule), else its own
                precision = getattr(self._trainer, "precision", None)
                self.flce_teacher_compute_dtype = head_compute_dtype(precision, teacher_weight.dtype)
                teacher_bias = None if teacher_bias is None else _frozen(teacher_bias)
                if sharded is not None:  # both heads' rows of this rank: the vocab-parallel op
                    loss_of_heads = functools.partial(
                        vocab_parallel_fused_linear_distillation,
                        student_bias_shard=bias,
                        teacher_bias_shard=teacher_bias,
                        group=sharded.group,
                        vocab_start=sharded.vocab_start,
                        top_k=hp.top_k,
                        **sharded_options,
                    )
                else:
                    loss_of_heads = functools.partial(
                        _fused_distillation,
                        student_bias=bias,
                        teacher_bias=teacher_bias,
                        top_k=hp.top_k,
                        **shared,
                    )
                losses.append(
                    loss_of_heads(
                        hidden,
                        weight,
                        teacher_hidden,
                        _frozen(teacher_weight),
                        target,
                        teacher_softcap=teacher_head.softcap,
                    )
                )
                # The loss leaves through the student head's call: the teacher head's hooks get no tensor that
                # needs a gradient (FSDP2 would gather the frozen teacher head again in backward for it).
                return losses[-1].detach()

            run_in_head(teacher_head, teacher_side, teacher_loss, caller=_HEADS, vocab_parallel=True)
            return losses[-1]

        loss = run_in_head(student_head, student_hidden, student_loss, caller=_HEADS, vocab_parallel=True)
        self._reshard_head_units(teacher_only=True)
        return loss

    def _check_teacher_dtype(self, teacher_weight: Tensor) -> None:
        """Refuses a ``teacher_dtype`` the strategy did not keep: FSDP1 and DeepSpeed convert the whole module to a
        ``"*-true"`` precision's dtype when they wrap it and manage the parameters from then on, so the cast back
        (:meth:`_keep_teacher_dtype`) does not reach what the teacher computes with."""
        if self.teacher_dtype is None or teacher_weight.dtype == self.teacher_dtype:
            return
        strategy = type(self._trainer.strategy).__name__ if self._trainer is not None else "the strategy"
        raise RuntimeError(
            f"teacher_dtype={str(self.teacher_dtype).removeprefix('torch.')} was not kept: the teacher's head"
            f" reached the loss in {str(teacher_weight.dtype).removeprefix('torch.')} under {strategy}. A strategy"
            " that converts the module's parameters when it wraps it and manages them from then on (FSDP1 and"
            " DeepSpeed, for '*-true' precisions), or a mixed-precision policy that casts them, overrides it."
            " Leave teacher_dtype unset there (the teacher follows the Trainer's precision: 'bf16-true' for bf16"
            " weights), or shard with FSDP2 (ModelParallelStrategy), which keeps it"
        )

    def _student_cross_entropy(self, hidden: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """The student's plain cross-entropy (token sum) and its correct tokens, fused, inside its head's call."""
        from lightning_flce.distill.functional import vocab_rows
        from lightning_flce.functional import fused_linear_cross_entropy_with_stats

        head = model_lm_head(self.student)
        sharded = _vocab_parallel_head(self.student, self.teacher)
        options: dict[str, Any] = dict(
            ignore_index=self.ignore_index,
            reduction="sum",
            softcap=head.softcap,
            logits_precision=self.hparams.logits_precision,
            chunk_size=self.hparams.chunk_size,
        )

        def cross_entropy(h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Any:
            if sharded is not None:  # this rank's rows
                return vocab_parallel_fused_linear_cross_entropy_with_stats(
                    h, weight, target, bias, group=sharded.group, vocab_start=sharded.vocab_start, **options
                )
            weight, bias = vocab_rows(weight, bias, self.hparams.vocab_size)  # the loss's rows
            return fused_linear_cross_entropy_with_stats(h, weight, target, bias, **options)

        output = FLCEOutput(*run_in_head(head, hidden, cross_entropy, caller=_HEADS, vocab_parallel=True))
        return output.loss, output.correct.sum()

    def _check_vocabularies(self, vocab_size: Optional[int]) -> None:
        student_rows = _head_rows(self.student)
        teacher_rows = student_rows if self.teacher is None else _head_rows(self.teacher)
        if vocab_size is None and student_rows != teacher_rows:
            raise ValueError(
                f"the student's LM head has {student_rows} rows and the teacher's {teacher_rows}: distillation"
                " needs one vocabulary (the same tokenizer). Heads padded to different row counts for one tokenizer"
                " (Qwen2.5-7B's 152064 rows, 0.5B's 151936): pass vocab_size (the tokenizer's size; the CLI links"
                " the data's) to distill over the rows they share"
            )
        if vocab_size is not None and vocab_size > min(student_rows, teacher_rows):
            raise ValueError(
                f"the data's vocabulary has {vocab_size} tokens but the student's LM head has {student_rows} rows and"
                f" the teacher's {teacher_rows}: use the tokenizer the teacher was trained with"
                " (data.init_args.vocab_size)"
            )


def load_teacher_checkpoint(path: str) -> pl.LightningModule:
    """The LightningModule saved in the checkpoint at ``path`` (its class as ``LastStepCheckpoint`` recorded it,
    else TinyGPT), on the CPU; a clear error when the file is missing."""
    import os

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no teacher checkpoint at {path!r}: run `lightning-flce fit --config default` first (it writes"
            " lightning_logs/default/tinygpt/checkpoints/last.ckpt), or pass"
            " --model.init_args.teacher_checkpoint=PATH"
        )
    checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    class_path = (checkpoint.get(IDENTITY_KEY) or {}).get("class", _DEFAULT_TEACHER_CLASS)
    module_name, _, class_name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls.load_from_checkpoint(path, map_location="cpu")


def _check_loss_options(
    divergence: str, beta: float, temperature: float, hard_weight: float, top_k: Optional[int]
) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0.0 <= hard_weight <= 1.0:
        raise ValueError(f"hard_weight must be in [0, 1], got {hard_weight}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")


def dtype_named(name: Union[str, torch.dtype], argument: str = "teacher_dtype") -> torch.dtype:
    """The floating-point dtype ``name`` (a dtype, or its name: ``"bfloat16"``, ``"torch.float16"``); a clear
    error naming ``argument`` otherwise."""
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{argument} must name a floating-point torch dtype (e.g. 'bfloat16'), got {name!r}")
    return dtype
