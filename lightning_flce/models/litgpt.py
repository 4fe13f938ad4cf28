"""LitGPTCausalLM: a LitGPT ``GPT`` trained with :class:`~lightning_flce.mixin.FLCEMixin`.

LitGPT's ``GPT.forward`` embeds, runs the blocks and ``transformer.ln_f``, then applies ``lm_head`` and the
softcap of ``config.final_logit_softcapping``. :func:`litgpt_hidden_states` runs that forward as it is, with
``lm_head`` replaced for the call by a module that keeps its input (the final hidden states) and returns an
empty tensor, so nothing of the forward is copied here and no logits are built; the mixin then computes the
loss inside the real head's own call, with the config's softcap.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn

from lightning_flce.data.dataset import check_label_format
from lightning_flce.mixin import FLCEMixin
from lightning_flce.models.gpt import adamw_with_warmup_cosine


class _HeadInputCapture(nn.Module):
    """Stands in for ``lm_head`` during one ``GPT.forward``: keeps its input, returns an empty tensor (the
    softcap that ``GPT.forward`` applies to it costs nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[Tensor] = []

    def forward(self, hidden: Tensor) -> Tensor:
        self.inputs.append(hidden)
        return hidden[..., :0]


def litgpt_hidden_states(gpt: nn.Module, idx: Tensor, **forward_kwargs: Any) -> Tensor:
    """Final hidden states [B, T, n_embd] of a LitGPT ``GPT`` (the input of its ``lm_head``): ``gpt(idx,
    **forward_kwargs)`` with ``lm_head`` swapped, for that call, for a module that keeps its input. The real
    head is not called, so its hooks (an FSDP unit's unshard, say) run only around the loss."""
    head = gpt.lm_head
    capture = _HeadInputCapture()
    gpt.lm_head = capture
    try:
        gpt(idx, **forward_kwargs)
    finally:
        gpt.lm_head = head
    if len(capture.inputs) != 1:
        raise RuntimeError(
            f"{type(gpt).__name__}.forward called lm_head {len(capture.inputs)} times (lm_head_chunk_size?);"
            " litgpt_hidden_states needs one call on the final hidden states"
        )
    return capture.inputs[0]


class LitGPTCausalLM(FLCEMixin, pl.LightningModule):
    r"""A LitGPT ``GPT`` whose training and validation loss is computed from its final hidden states
    (:func:`litgpt_hidden_states`) and its ``lm_head`` by :class:`FLCEMixin`, without the logits.
    ``config.final_logit_softcapping`` is applied to the loss as ``GPT.forward`` applies it to the logits
    (``flce_softcap`` is taken from the config; a different value is an error). The softmax runs over the
    head's ``padded_vocab_size`` rows, as LitGPT's own loss on its logits does. ``forward`` gives the model's
    logits (softcapped), for inference.

    Needs ``litgpt``, whose pins conflict with ``transformers`` 5: ``pip install --no-deps litgpt`` plus
    ``pip install "lightning-flce[litgpt]"`` (the few packages ``import litgpt`` needs); see docs/adapters.md.

    Batches: ``{"input_ids", "labels"}``; ``label_format="shifted"`` (the bundled data module's default, and
    LitGPT's pre-training convention): ``labels[t]`` is the target of position ``t``; ``"hf"``: labels are the
    input ids (LitGPT's fine-tuning convention), shifted here. Labels equal to ``flce_ignore_index`` are
    ignored.

    Args:
        config: keyword arguments of ``litgpt.Config`` (``{"n_layer": 2, "n_embd": 64, "n_head": 4,
            "vocab_size": 8192, ...}``), or, with ``name``, the fields that override that named config. A
            model with random weights is built (LitGPT's ``_init_weights``; no download).
        name: a LitGPT config name for ``litgpt.Config.from_name`` (``"pythia-14m"``, ...).
        model: a ``GPT`` instance to train as it is (loaded, LoRA-free), instead of ``config``/``name``. It is
            not saved in the hyperparameters: pass it again to ``load_from_checkpoint``.
        vocab_size: overrides the config's ``vocab_size`` (``FLCELightningCLI`` links it to the data module's
            tokenizer; LitGPT pads the head to ``padding_multiple``). With ``model`` it must not exceed the
            head's rows.
        tie_embeddings: share the token embedding with the head, as LitGPT's pre-training option of that name
            does (``transformer.wte.weight = lm_head.weight``).
        label_format: ``"shifted"`` or ``"hf"`` (see above).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay of the matrices; biases and norms get none.
        warmup_steps: linear warmup steps, then cosine decay to 10% of ``lr``.
        \**kwargs: the ``flce_*`` options of :class:`FLCEMixin`.

    Example:

    .. code-block:: python

        model = LitGPTCausalLM(config={"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 256,
                                       "vocab_size": 8192, "final_logit_softcapping": 30.0})
        L.Trainer(max_steps=100).fit(model, datamodule)

    """

    def __init__(
        self,
        config: Optional[dict[str, Any]] = None,
        name: Optional[str] = None,
        model: Optional[nn.Module] = None,
        vocab_size: Optional[int] = None,
        tie_embeddings: bool = False,
        label_format: Literal["shifted", "hf"] = "shifted",
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(name for name in kwargs if not name.startswith("flce_"))
        if unknown:
            own = [
                n
                for n in inspect.signature(LitGPTCausalLM.__init__).parameters
                if n not in ("self", "kwargs")
            ]
            raise TypeError(
                f"LitGPTCausalLM got unexpected keyword arguments {unknown}: it takes {', '.join(own)} and the"
                " flce_* options; litgpt.Config fields go in `config`"
            )
        if kwargs.get("flce_head") is None:  # None also when LightningCLI passes the mixin's default
            kwargs["flce_head"] = "model.lm_head"
        super().__init__(**kwargs)
        if model is not None and (config is not None or name is not None):
            raise ValueError("Pass either `model` (a litgpt GPT instance) or `config`/`name`, not both")
        if model is None and config is None and name is None:
            raise ValueError("Pass `config` (litgpt.Config fields), `name` (a litgpt config name) or `model`")
        if label_format not in ("shifted", "hf"):
            raise ValueError(f"label_format must be 'shifted' or 'hf', got {label_format!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.save_hyperparameters(ignore=["model"])
        if model is None:
            try:
                from litgpt import GPT, Config
            except ImportError as err:
                raise ImportError(
                    "LitGPTCausalLM needs litgpt: pip install --no-deps litgpt && pip install 'lightning-flce[litgpt]'"
                ) from err
            config = dict(config or {})
            if vocab_size is not None:
                config["vocab_size"] = vocab_size
            litgpt_config = Config.from_name(name, **config) if name else Config(**config)
            model = GPT(litgpt_config)
            model.apply(model._init_weights)
        if not isinstance(getattr(model, "lm_head", None), nn.Module) or not hasattr(model, "config"):
            raise TypeError(
                f"`model` must be a litgpt GPT (with `lm_head` and `config`), got {type(model).__name__}"
            )
        rows = model.lm_head.weight.shape[0]
        if vocab_size is not None and vocab_size > rows:
            raise ValueError(f"vocab_size={vocab_size} exceeds the {rows} rows of the model's lm_head")
        self.model = model
        if tie_embeddings:
            self.model.transformer.wte.weight = self.model.lm_head.weight
        self._check_softcap(self.flce_options.softcap)  # the flce_softcap option, as passed

    @property
    def flce_softcap(self) -> Optional[float]:
        """The softcap of the loss: always the config's ``final_logit_softcapping``, which ``GPT.forward``
        applies to the logits (read at each loss, so an edited config is followed)."""
        model = self.__dict__.get("_modules", {}).get("model")
        if model is None:  # during __init__, before the model exists: the option
            return self.flce_options.softcap
        return getattr(model.config, "final_logit_softcapping", None)

    @flce_softcap.setter
    def flce_softcap(self, value: Optional[float]) -> None:
        self._check_softcap(value)  # the config decides; a different value is an error

    def _check_softcap(self, value: Optional[float]) -> None:
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        if value is not None and value != softcap:
            raise ValueError(
                f"flce_softcap={value} differs from the LitGPT config's final_logit_softcapping={softcap}, which"
                " GPT.forward applies to the logits: set the softcap in the config (the loss follows it)"
            )

    def setup(self, stage: str) -> None:
        check_label_format(self, self.hparams.label_format)
        super().setup(stage)

    def hidden_states(self, input_ids: Tensor, **forward_kwargs: Any) -> Tensor:
        """Final hidden states [B, T, n_embd] (after ``transformer.ln_f``); see :func:`litgpt_hidden_states`."""
        return litgpt_hidden_states(self.model, input_ids, **forward_kwargs)

    def forward(self, input_ids: Tensor, **forward_kwargs: Any) -> Tensor:
        """Logits [B, T, padded_vocab_size] of the model, softcapped as LitGPT does (inference path)."""
        return self.model(input_ids, **forward_kwargs)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        # several dataloaders: the mixin keeps metrics per dataloader (val/loss/dataloader_idx_N, ...)
        return self._loss(batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._loss(batch)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Logits of ``batch["input_ids"]`` (``trainer.predict``)."""
        return self(batch["input_ids"])

    def configure_optimizers(self) -> OptimizerLRScheduler:
        return adamw_with_warmup_cosine(
            self,
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
            warmup_steps=self.hparams.warmup_steps,
        )

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        hidden = self.hidden_states(batch["input_ids"])
        return self.flce_loss(hidden, batch["labels"], shift=self.hparams.label_format == "hf")
