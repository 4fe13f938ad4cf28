"""The LM-head loss computed inside the head module's own forward call."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Literal, Optional, Union, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flce.adapters import is_peft_lora_head, lora_head_loss
from lightning_flce.deprecation import accepts_renamed, renamed_property
from lightning_flce.functional import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
from lightning_flce.kernels import softmax_dtype
from lightning_flce.kernels.transform_torch import transformed_logits
from lightning_flce.module_calls import forward_bound_to, has_call_hooks
from lightning_flce.options import AccumDtype, FLCEOptions, ImplName, LogitsPrecision, Reduction
from lightning_flce.outputs import FLCEOutput
from lightning_flce.parallel import VocabParallelHead, vocab_parallel_fused_linear_cross_entropy_with_stats

# Wrappers that keep the real module under one attribute and pass their inputs on to it unchanged (FSDP1).
_PASS_THROUGH_WRAPPER_ATTRIBUTES = ("_fsdp_wrapped_module",)
# Activation checkpointing would re-run the head's plain forward in backward, where the loss no longer
# stands in for it; the fused loss keeps no activations anyway.
_CHECKPOINT_WRAPPER_ATTRIBUTE = "_checkpoint_wrapped_module"


class FLCEHeadLoss(nn.Module):
    r"""Cross-entropy of an LM head, computed by ``fused_linear_cross_entropy`` without the [N, V] logits.

    The loss is computed *inside the head module's own forward call*: for that one call the head's
    ``forward`` is bound to the loss, and the head is called as usual (``head(hidden)``). Everything that
    hooks the head's forward therefore runs around the loss and sees the head as it sees a normal call:
    FSDP (1 and 2) unshards the weight, DeepSpeed ZeRO-3 gathers it, PEFT's ``ModulesToSaveWrapper``
    dispatches to the active copy, and user forward (pre-)hooks fire (they see ``(hidden,)`` as input and
    the loss instead of logits as output). ``head.weight``/``head.bias`` are read only inside that call,
    so a sharded weight is never read in its sharded form. (Reading the weight outside that call would see
    a shard; wrapping the head in a loss module would change its ``state_dict`` keys and checkpoints.) A
    bare head, with no wrapper and no hooks, has nothing to run around the loss: the loss is then
    called directly, which ``torch.compile`` can trace.

    The head must compute ``F.linear(hidden, head.weight, head.bias)``: an ``nn.Linear`` that does not
    override ``forward``, or an ``nn.Embedding`` whose weight is used as the output matrix (tied
    embeddings without a separate head module). A :class:`~lightning_flce.parallel.VocabParallelHead`
    (the head sharded over V across a process group) is accepted too: the loss is then its vocab-parallel
    op (:meth:`~lightning_flce.parallel.VocabParallelHead.loss` / ``loss_with_stats``), still inside the
    head's own call, on hidden states and targets that must be the same on every rank of the head's group;
    ``last_logits_shape`` reports the full vocabulary. That op has no class weights and no naive path:
    ``naive=True`` raises ``NotImplementedError`` for such a head; ``impl`` picks its per-chunk softmax.

    Args:
        ignore_index: target value that does not contribute to the loss.
        label_smoothing: label smoothing of the cross-entropy, in ``[0, 1]``.
        lse_square_scale: coefficient of the z-loss ``lse_square_scale * logsumexp(logits) ** 2`` added per
            token (PaLM uses 1e-4).
        accum_dtype: dtype of the head weight gradient's accumulator over chunks: a ``torch.dtype`` or its
            name (``"float32"``, ...), as the op's ``accum_dtype``, except that ``float32`` never narrows an fp64
            weight's fp64 default; None (default) lets the op choose.
        chunk_size: tokens per chunk; ``None`` lets the op choose from its memory budget.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``.
        naive: compute the plain logits and ``F.cross_entropy`` instead (same result, [N, V] memory),
            for comparisons.
        softcap: logit soft-capping ``c * tanh(logits / c)`` of every call that passes none.
        logits_precision: ``"input"``, ``"fp32"``, ``"fp32_compensated"`` or ``"fp32_head"`` (see
            :func:`~lightning_flce.fused_linear_cross_entropy`).

    The options are kept as one :class:`~lightning_flce.options.FLCEOptions` record, ``self.options``
    (:meth:`from_options` takes a record); the attributes of the same names read it. The names are the op's
    (``docs/options.md``); the old ``z_loss`` and ``accum_fp32`` (and ``labels=`` of :meth:`forward`) are
    deprecated aliases that warn.

    Example::

        head_loss = FLCEHeadLoss(ignore_index=-100)
        loss_sum = head_loss(model.lm_head, hidden, target, reduction="sum")

    """

    @accepts_renamed("z_loss", "accum_fp32")
    def __init__(
        self,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        accum_dtype: AccumDtype = None,
        chunk_size: Optional[int] = None,
        impl: ImplName = "auto",
        naive: bool = False,
        softcap: Optional[float] = None,
        logits_precision: LogitsPrecision = "input",
    ) -> None:
        super().__init__()
        # validated once, by the options record (its errors name this module's arguments)
        self.options = FLCEOptions.of(
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale,
            softcap=softcap,
            logits_precision=logits_precision,
            accum_dtype=accum_dtype,
            chunk_size=chunk_size,
            impl=impl,
        )
        self.naive = naive
        #: (tokens, vocab) of the logits of the last call; read inside the head call, so never a shard size.
        self.last_logits_shape: Optional[tuple[int, int]] = None
        self._warned_output_hooks = False

    @classmethod
    def from_options(cls, options: FLCEOptions, *, naive: bool = False) -> FLCEHeadLoss:
        """The head loss of an options record (its ``reduction`` and ``token_weight`` are given per call)."""
        if not isinstance(options, FLCEOptions):
            raise TypeError(f"options must be an FLCEOptions record, got {type(options).__name__}")
        head_loss = cls(naive=naive)
        head_loss.options = options
        return head_loss

    # read-only views of the record, under the names of the constructor's arguments
    @property
    def ignore_index(self) -> int:
        return self.options.ignore_index

    @property
    def label_smoothing(self) -> float:
        return self.options.label_smoothing

    @property
    def lse_square_scale(self) -> float:
        return self.options.lse_square_scale

    @property
    def accum_dtype(self) -> Optional[torch.dtype]:
        return self.options.accum_dtype

    @property
    def chunk_size(self) -> Optional[int]:
        return self.options.chunk_size

    @property
    def impl(self) -> ImplName:
        return self.options.impl

    @property
    def softcap(self) -> Optional[float]:
        return self.options.softcap

    @property
    def logits_precision(self) -> LogitsPrecision:
        return self.options.logits_precision

    # deprecated names (one release)
    z_loss = renamed_property("z_loss")
    accum_fp32 = renamed_property("accum_fp32")

    # The return type follows with_stats, for type checkers (one implementation below).
    @overload
    def forward(
        self,
        head: nn.Module,
        hidden: Tensor,
        target: Tensor,
        *,
        reduction: Reduction = ...,
        with_stats: Literal[False] = ...,
        regularized: bool = ...,
        logit_scale: Optional[float] = ...,
        softcap: Optional[float] = ...,
        token_weight: Optional[Tensor] = ...,
    ) -> Tensor: ...
    @overload
    def forward(
        self,
        head: nn.Module,
        hidden: Tensor,
        target: Tensor,
        *,
        reduction: Reduction = ...,
        with_stats: Literal[True],
        regularized: bool = ...,
        logit_scale: Optional[float] = ...,
        softcap: Optional[float] = ...,
        token_weight: Optional[Tensor] = ...,
    ) -> FLCEOutput: ...
    @overload
    def forward(
        self,
        head: nn.Module,
        hidden: Tensor,
        target: Tensor,
        *,
        reduction: Reduction = ...,
        with_stats: bool,
        regularized: bool = ...,
        logit_scale: Optional[float] = ...,
        softcap: Optional[float] = ...,
        token_weight: Optional[Tensor] = ...,
    ) -> Union[Tensor, FLCEOutput]: ...
    @accepts_renamed("labels")
    def forward(
        self,
        head: nn.Module,
        hidden: Tensor,
        target: Tensor,
        *,
        reduction: Reduction = "mean",
        with_stats: bool = False,
        regularized: bool = True,
        logit_scale: Optional[float] = None,
        softcap: Optional[float] = None,
        token_weight: Optional[Tensor] = None,
    ) -> Union[Tensor, FLCEOutput]:
        """Loss of ``head`` on ``hidden`` [..., H] against ``target`` [...].

        Args:
            head: the LM head module (possibly wrapped by FSDP1 or PEFT's ``ModulesToSaveWrapper``; not by
                activation checkpointing, which would recompute the plain forward in backward).
            hidden: final hidden states.
            target: integer class indices with the leading shape of ``hidden`` (``labels=``: deprecated).
            reduction: ``"mean"``, ``"sum"`` or ``"none"``, as in ``F.cross_entropy``.
            with_stats: return ``FLCEOutput(loss, lse, correct, entropy)`` instead of the loss alone.
            regularized: apply label smoothing and z-loss; ``False`` gives the plain cross-entropy
                (what validation perplexity is computed from).
            logit_scale: logits are multiplied by this factor (Cohere/Granite-style models); applied to
                the hidden states and bias, so no scaled copy of the [V, H] weight is made.
            softcap: logits -> ``softcap * tanh(logits / softcap)``, after ``logit_scale``; None: the
                ``softcap`` option.
            token_weight: optional float weights of the target's shape (no gradient): each token's loss (its
                cross-entropy and z-loss term) is multiplied by its weight; ``"mean"`` still divides by the
                number of non-ignored tokens.

        """
        if hidden.dim() < 2:
            raise ValueError(f"hidden must have shape [..., H], got {tuple(hidden.shape)}")
        if target.shape != hidden.shape[:-1]:
            raise ValueError(
                f"target must have the leading shape of hidden {tuple(hidden.shape[:-1])}, got {tuple(target.shape)}"
            )
        if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
            raise TypeError(f"target must be an integer tensor, got {target.dtype}")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        options = self.options.replace(reduction=reduction)
        if softcap is not None:
            options = options.replace(softcap=softcap)
        if not regularized:  # the plain cross-entropy (validation perplexity)
            options = options.replace(label_smoothing=0.0, lse_square_scale=0.0)
        if token_weight is not None:
            options = options.replace(token_weight=token_weight)
            # here, before any head call: the naive path has no op to check it (class weights: the op's or
            # F.cross_entropy's own check, against the vocabulary this call cannot see outside the head)
            options.replace(class_weight=None).check_tensors(0, target, hidden.device)

        module = unwrap_head(head)
        _check_linear_head(module)
        if isinstance(module, VocabParallelHead):
            _check_vocab_parallel_options(self)
        ran = []

        def loss_as_forward(head_input: Tensor) -> Union[Tensor, tuple[Tensor, ...]]:
            ran.append(True)
            output = self._loss_of(
                module,
                head_input,
                target.long(),
                options=options,
                with_stats=with_stats,
                logit_scale=logit_scale,
            )
            # a plain tuple: hooks that rebuild their outputs (FSDP, ZeRO-3) may not handle NamedTuples
            return tuple(output) if with_stats else output

        if head is module and "forward" not in module.__dict__ and not has_call_hooks(module):
            output = loss_as_forward(hidden)  # nothing to run around it (and torch.compile traces it)
        else:
            if not self._warned_output_hooks:
                self._warn_about_output_hooks(head, module)
            with forward_bound_to(module, loss_as_forward):
                output = head(hidden)
        if not ran:
            raise RuntimeError(
                f"Calling the head {type(head).__name__} did not reach {type(module).__name__}.forward, so the loss"
                " was not computed; pass the module that holds the output weight as the head"
            )
        return FLCEOutput(*output) if with_stats else output

    if TYPE_CHECKING:
        # nn.Module's __call__ returns Any: type checkers read forward's overloads on head_loss(...) instead
        __call__ = forward

    def _warn_about_output_hooks(self, *modules: nn.Module) -> None:
        # Forward hooks that are not torch's or DeepSpeed's own (sharding) ones may rewrite the head's output,
        # which is the loss here: say so once, since a rewritten loss would be silently wrong.
        hooks = [
            getattr(hook, "__qualname__", repr(hook))
            for module in dict.fromkeys(modules)
            for hook in map(_unwrap_partial, module._forward_hooks.values())
            if not (getattr(hook, "__module__", None) or "").startswith(("torch.", "deepspeed."))
        ]
        if hooks:
            self._warned_output_hooks = True
            warnings.warn(
                f"the LM head has forward hooks ({', '.join(hooks)}) that run around the fused loss: they see the"
                " loss, not the logits, as the head's output, and an output they return replaces the loss."
                " (Warned once.)",
                stacklevel=3,
            )

    def _loss_of(
        self,
        module: nn.Module,
        hidden: Tensor,
        target: Tensor,
        *,
        options: FLCEOptions,
        with_stats: bool,
        logit_scale: Optional[float],
    ) -> Union[Tensor, FLCEOutput]:
        if isinstance(module, VocabParallelHead):
            return self._vocab_parallel_loss_of(
                module, hidden, target, options=options, with_stats=with_stats, logit_scale=logit_scale
            )
        if is_peft_lora_head(module):
            # a PEFT LoRA head: the loss of one linear map with the same logits (lightning_flce/adapters.py)
            return lora_head_loss(
                module,
                hidden,
                lambda operands, h: self._loss_of(
                    operands, h, target, options=options, with_stats=with_stats, logit_scale=logit_scale
                ),
            )
        weight = module.weight
        hidden, bias = scaled_head_input(hidden, weight, getattr(module, "bias", None), logit_scale)
        self.last_logits_shape = (hidden.numel() // hidden.shape[-1], weight.shape[0])
        if self.naive:
            return _plain_loss(hidden, weight, target, bias, options=options, with_stats=with_stats)
        op = fused_linear_cross_entropy_with_stats if with_stats else fused_linear_cross_entropy
        return op(hidden, weight, target, bias, **_for_weight(options, weight).as_kwargs())

    def _vocab_parallel_loss_of(
        self,
        module: VocabParallelHead,
        hidden: Tensor,
        target: Tensor,
        *,
        options: FLCEOptions,
        with_stats: bool,
        logit_scale: Optional[float],
    ) -> Union[Tensor, FLCEOutput]:
        """The head's vocab-parallel loss (collectives over ``module.group``; every rank must call it)."""
        if hidden.shape[-1] != module.in_features:
            raise ValueError(
                f"hidden size {hidden.shape[-1]} does not match the vocab-parallel head's in_features"
                f" {module.in_features}"
            )
        self.last_logits_shape = (hidden.numel() // hidden.shape[-1], module.vocab_size)
        options = _for_weight(options, module.weight).as_kwargs()
        if logit_scale is not None:
            hidden = hidden * logit_scale
            if module.bias is not None:
                # the head's loss() reads its own bias; a scaled bias goes to the op directly
                output = vocab_parallel_fused_linear_cross_entropy_with_stats(
                    hidden,
                    module.weight,
                    target,
                    module.bias * logit_scale,
                    group=module.group,
                    vocab_start=module.vocab_start,
                    **options,
                )
                return output if with_stats else output.loss
        if with_stats:
            return module.loss_with_stats(hidden, target, **options)
        return module.loss(hidden, target, **options)


def _for_weight(options: FLCEOptions, weight: Tensor) -> FLCEOptions:
    # a float32 accumulator widens, never narrows: an fp64 weight keeps the op's fp64 accumulator
    if options.accum_dtype == torch.float32 and weight.dtype == torch.float64:
        return options.replace(accum_dtype=None)
    return options


def _check_vocab_parallel_options(head_loss: FLCEHeadLoss) -> None:
    if head_loss.naive:
        raise NotImplementedError(
            "naive=True (flce_naive) is not supported with a VocabParallelHead: the plain logits path needs the"
            " full [V, H] weight on one rank; use naive=False"
        )


def scaled_head_input(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], logit_scale: Optional[float]
) -> tuple[Tensor, Optional[Tensor]]:
    """``hidden`` and ``bias`` times the model's logit scale (``softcap(scale (x W^T + b))`` is the loss of
    ``(scale x) W^T + scale b``: no scaled copy of the [V, H] weight); a clear error when the hidden size is not
    the weight's ``[V, H]``."""
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} does not match the head weight {tuple(weight.shape)} ([V, H])"
        )
    if logit_scale is not None:
        hidden = hidden * logit_scale
        bias = None if bias is None else bias * logit_scale
    return hidden, bias


def unwrap_head(head: nn.Module) -> nn.Module:
    """The module that holds the output weight: unwraps FSDP1 units and PEFT ``ModulesToSaveWrapper`` (to
    the active adapter's copy, or the original module when adapters are off).

    Raises:
        ValueError: if the head is wrapped for activation checkpointing.
    """
    module = head
    while True:
        if hasattr(module, _CHECKPOINT_WRAPPER_ATTRIBUTE):
            raise ValueError(
                "The LM head is wrapped for activation checkpointing, which would recompute its plain forward"
                " in backward; leave the head out of the checkpointing policy (the fused loss stores no logits)"
            )
        if _is_modules_to_save_wrapper(module):
            module = _active_module_to_save(module)
            continue
        inner = None
        # a loop, not next(generator, default): torch 2.4's Dynamo cannot trace the latter
        for name in _PASS_THROUGH_WRAPPER_ATTRIBUTES:
            if hasattr(module, name):
                inner = getattr(module, name)
                break
        if isinstance(inner, nn.Module):
            module = inner
            continue
        return module


def _is_modules_to_save_wrapper(module: nn.Module) -> bool:
    # PEFT is an optional dependency, so the wrapper is recognised by its attributes.
    return isinstance(getattr(module, "modules_to_save", None), (nn.ModuleDict, Mapping)) and isinstance(
        getattr(module, "original_module", None), nn.Module
    )


def _active_module_to_save(wrapper: nn.Module) -> nn.Module:
    if getattr(wrapper, "disable_adapters", False):
        return wrapper.original_module
    active = getattr(wrapper, "active_adapters", None)
    if active is None:
        active = getattr(wrapper, "active_adapter", None)
    if isinstance(active, str):
        active = [active]
    active = list(active or [])
    if not active or any(name not in wrapper.modules_to_save for name in active):
        return wrapper.original_module
    if len(active) > 1:
        raise ValueError(f"The head has several active PEFT adapters {active}; FLCE needs exactly one")
    return wrapper.modules_to_save[active[0]]


def _check_linear_head(module: nn.Module) -> None:
    if is_peft_lora_head(module):  # raises for the PEFT layers the fused loss cannot compute
        return
    is_linear = isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
    if not (is_linear or isinstance(module, (nn.Embedding, VocabParallelHead))):
        raise TypeError(
            "The LM head must compute F.linear(hidden, head.weight, head.bias): an nn.Linear that keeps"
            " nn.Linear.forward, an nn.Embedding used as the tied output matrix, or a"
            f" lightning_flce.parallel.VocabParallelHead; got {type(module).__name__}"
        )


def _unwrap_partial(function: Callable) -> Callable:
    while isinstance(function, functools.partial):
        function = function.func
    return function


def _plain_loss(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    *,
    options: FLCEOptions,
    with_stats: bool,
) -> Union[Tensor, FLCEOutput]:
    """The reference path: materialises the [N, V] logits in the op's softmax dtype (fp32; fp64 for fp64)."""
    if options.logits_precision == "input":
        logits = F.linear(hidden, weight, bias)
    else:  # fp32 logits (any fp32 precision; fp32 sums, not compensated): the GEMM widened (outside
        # autocast, which would narrow it again)
        wide = torch.promote_types(hidden.dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.to(wide), weight.to(wide), None if bias is None else bias.to(wide))
    logits = logits.to(softmax_dtype(logits.dtype)).flatten(0, -2)
    logits, _ = transformed_logits(logits, options.softcap)
    token_shape = target.shape
    target = target.flatten()
    ignore_index = options.ignore_index
    valid = target != ignore_index
    per_token = F.cross_entropy(
        logits,
        target,
        weight=options.class_weight,
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=options.label_smoothing,
    )
    lse = torch.logsumexp(logits, dim=-1)
    if options.lse_square_scale:
        per_token = per_token + options.lse_square_scale * lse.square() * valid
    if options.token_weight is not None:
        per_token = per_token * options.token_weight.flatten().to(per_token.dtype)
    reduction = options.reduction
    if reduction == "none":
        loss = per_token.view(token_shape)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        # F.cross_entropy's denominator (the class weights of the targets, else their count), never the token
        # weights; the sum stays connected to the graph when every token is ignored (0 / 1 instead of 0 / 0)
        if options.class_weight is None:
            denominator = valid.sum().clamp(min=1)
        else:
            denominator = (options.class_weight[torch.where(valid, target, 0)] * valid).sum()
            denominator = torch.where(valid.any(), denominator, torch.ones_like(denominator))
        loss = per_token.sum() / denominator
    if not with_stats:
        return loss
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
        correct = (logits.argmax(-1) == target) & valid
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        stats = (torch.where(valid, lse, zero), correct, torch.where(valid, entropy, zero))
        return FLCEOutput(loss, *(stat.view(token_shape) for stat in stats))
