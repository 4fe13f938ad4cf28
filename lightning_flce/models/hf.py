"""HFCausalLM: a Hugging Face causal LM trained with :class:`~lightning_flce.mixin.FLCEMixin`."""

import inspect
import os
from typing import Any, Optional, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn

from lightning_flce.data.dataset import check_label_format
from lightning_flce.flops import ThroughputFlops, decoder_flops, linear_weight_count
from lightning_flce.mixin import NARROW_INT_DTYPES, FLCEMixin
from lightning_flce.models.gpt import adamw_with_warmup_cosine


class HFCausalLM(FLCEMixin, ThroughputFlops, pl.LightningModule):
    r"""A Hugging Face causal LM (``AutoModelForCausalLM``) whose training and validation loss is computed
    from the decoder's hidden states and ``get_output_embeddings()`` by :class:`FLCEMixin`, so the logits are
    never built for the loss. The model is not patched: ``forward`` and ``generate`` (through ``self.model``)
    keep the normal logits path. Softcapping (``config.final_logit_softcapping``) and logit scaling
    (Cohere ``logit_scale``, Granite ``logits_scaling``) are applied to the loss as the model applies them.

    Batches follow the Hugging Face convention: ``{"input_ids", "attention_mask", "labels"}`` with
    ``labels`` a copy of ``input_ids`` (the model shifts them); positions with ``attention_mask == 0``
    and labels equal to ``flce_ignore_index`` are ignored. ``labels`` defaults to ``input_ids``. An optional
    ``token_weight`` (float, the shape of ``labels``; advantages, soft masks) weights each token's loss, shifted
    with the labels (see :meth:`~lightning_flce.mixin.FLCEMixin.flce_loss`). Every other
    key of the batch goes to the decoder as a keyword (``position_ids`` of packed sequences, say), as
    ``model(**batch)`` would pass it (Hugging Face decoders take extra keywords without checking them).

    Args:
        config: keyword arguments of ``transformers.AutoConfig.for_model`` including ``model_type``, e.g.
            ``{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, ...}``: a model with random
            weights is built from it (no download).
        pretrained: local directory for ``AutoModelForCausalLM.from_pretrained`` (``local_files_only``),
            instead of ``config``.
        model: a causal LM instance to train as it is (already loaded, resized or PEFT-wrapped), instead of
            ``config`` and ``pretrained``. It is not saved in the hyperparameters: pass it again to
            ``load_from_checkpoint``.
        model_kwargs: keyword arguments of ``from_config`` / ``from_pretrained``, e.g.
            ``{"attn_implementation": "eager"}``, or the dtype keyword of the installed transformers.
        vocab_size: overrides ``config["vocab_size"]`` (``FLCELightningCLI`` links it to the data module's
            tokenizer). With ``pretrained`` or ``model`` it must not exceed the model's vocabulary.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay of the matrices; biases and norms get none.
        warmup_steps: linear warmup steps, then cosine decay to 10% of ``lr``.
        compile_layers: ``torch.compile`` every decoder layer (:func:`compile_decoder_layers`), compiled at
            its first call; the embedding, the final norm and the loss stay eager. On an H200 this took a 1.2B
            Llama's training step from 0.35 to 0.27 s (``benchmarks/bench_lightning_e2e.py``).
        \**kwargs: the ``flce_*`` options of :class:`FLCEMixin`.

    Example:

    .. code-block:: python

        model = HFCausalLM(
            config={"model_type": "llama", "vocab_size": 8192, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
            flce_chunk_size=1024,
        )
        L.Trainer(max_steps=100).fit(model, datamodule)

    .. code-block:: yaml

        model:
          class_path: lightning_flce.models.HFCausalLM
          init_args:
            config:
              model_type: llama
              hidden_size: 64
              intermediate_size: 128
              num_hidden_layers: 2
              num_attention_heads: 4
            lr: 1.0e-3

    """

    def __init__(
        self,
        config: Optional[dict[str, Any]] = None,
        pretrained: Optional[str] = None,
        model: Optional[nn.Module] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        vocab_size: Optional[int] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        compile_layers: bool = False,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(name for name in kwargs if not name.startswith("flce_"))
        if unknown:
            own = [
                name
                for name in inspect.signature(HFCausalLM.__init__).parameters
                if name not in ("self", "kwargs")
            ]
            raise TypeError(
                f"HFCausalLM got unexpected keyword arguments {unknown}: it takes {', '.join(own)} and the flce_*"
                " options; from_config / from_pretrained options (torch_dtype, attn_implementation, ...) go in"
                " model_kwargs"
            )
        super().__init__(**kwargs)
        if sum(source is not None for source in (config, pretrained, model)) != 1:
            raise ValueError(
                "Pass exactly one of `config` (a dict with `model_type`), `pretrained` (a local path) and `model`"
                " (a causal LM instance)"
            )
        if model is not None and model_kwargs is not None:
            raise ValueError("model_kwargs apply to `config` and `pretrained`, not to a `model` instance")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.save_hyperparameters(ignore=["model"])
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as err:
            raise ImportError("HFCausalLM needs transformers: pip install 'lightning-flce[hf]'") from err

        if config is not None:
            config = dict(config)
            model_type = config.pop("model_type", None)
            if model_type is None:
                raise ValueError("`config` must contain `model_type`, e.g. {'model_type': 'llama', ...}")
            if vocab_size is not None:
                config["vocab_size"] = vocab_size
            self.model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, **config), **(model_kwargs or {})
            )
        else:
            if model is None:
                _check_pretrained_path(pretrained)
                model = AutoModelForCausalLM.from_pretrained(
                    pretrained, **{"local_files_only": True, **(model_kwargs or {})}
                )
            self.model = model
            rows = cast(Tensor, _lm_head(model).weight).shape[0]
            if vocab_size is not None and vocab_size > rows:
                raise ValueError(f"vocab_size={vocab_size} exceeds the {rows} rows of the pretrained LM head")
        if compile_layers:
            compile_decoder_layers(self.model)

    def setup(self, stage: str) -> None:
        check_label_format(self, "hf")
        super().setup(stage)

    def configure_model(self) -> None:
        """Compiles the decoder layers again where a copy lost them (pickling drops ``torch.compile``'s
        wrapper: ``strategy="ddp_spawn"`` workers, deep copies)."""
        if self.hparams.get("compile_layers") and not _layers_compiled(self.model):
            compile_decoder_layers(self.model)

    def estimate_flops(self, batch_size: int, seq_len: int, training: bool = True) -> int:
        """FLOPs of a batch of ``batch_size`` sequences of ``seq_len`` tokens
        (:func:`~lightning_flce.flops.decoder_flops`): the weights of the model's linear layers (the LM head's
        included), ``num_hidden_layers`` attention layers of ``num_attention_heads · head_dim``; forward +
        backward when ``training`` (weight gradients of frozen layers included). It is ``flops_per_batch``
        during fit (:class:`~lightning_flce.flops.ThroughputFlops`). Mixture-of-experts models, whose tokens
        each use a few of the experts' weights, are refused."""
        config = self.model.config
        if any(
            getattr(config, name, None) for name in ("num_local_experts", "num_experts", "n_routed_experts")
        ):
            raise NotImplementedError(
                f"estimate_flops counts every linear layer, which overcounts the experts of {type(self.model).__name__}"
                "; set `flops_per_batch` to your own count"
            )
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        return decoder_flops(
            batch_size=batch_size,
            seq_len=seq_len,
            linear_params=linear_weight_count(self.model),
            n_layers=config.num_hidden_layers,
            attention_width=n_heads * head_dim,
            training=training,
        )

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, **decoder_kwargs: Any
    ) -> Tensor:
        """Final hidden states of the decoder [B, T, hidden_size] (what the LM head is applied to);
        ``decoder_kwargs`` (``position_ids``, ...) go to the decoder."""
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
        decoder_kwargs.setdefault("use_cache", False)
        output = decoder(input_ids=input_ids, attention_mask=attention_mask, **decoder_kwargs)
        return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        """Logits [B, T, V] of the wrapped model (inference path). No KV cache unless ``use_cache=True`` is
        passed: only the logits are returned, and a cache makes compiled layers recompile per layer."""
        kwargs.setdefault("use_cache", False)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        # several dataloaders: the mixin keeps metrics per dataloader (val/loss/dataloader_idx_N, ...)
        return self._loss(batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._loss(batch)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Logits [B, T, V] of ``batch["input_ids"]`` (its ``attention_mask`` and other keys but ``labels`` go to
        the model), for ``trainer.predict``."""
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        return self(**inputs)

    def configure_optimizers(self) -> OptimizerLRScheduler:
        return adamw_with_warmup_cosine(
            self,
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
            warmup_steps=self.hparams.warmup_steps,
        )

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        batch = dict(batch)
        input_ids = batch.pop("input_ids")
        attention_mask = batch.pop("attention_mask", None)
        labels = batch.pop("labels", input_ids)
        token_weight = batch.pop("token_weight", None)
        if labels.dtype in NARROW_INT_DTYPES:
            labels = labels.long()  # the -100 written below must fit (uint8 ids)
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, self.flce_ignore_index)
        hidden = self.hidden_states(input_ids, attention_mask, **batch)  # position_ids, ...
        return self.flce_loss(hidden, labels, shift=True, token_weight=token_weight)


def _check_pretrained_path(pretrained: Any) -> None:
    """A ``pretrained`` that is written as a path (a separator, or a leading ``.`` or ``~``) must exist:
    ``from_pretrained`` would otherwise take it for a Hub repo id and complain about its characters."""
    path = os.fspath(pretrained) if isinstance(pretrained, (str, os.PathLike)) else None
    if path is None:
        return
    looks_like_path = os.sep in path or "/" in path or path.startswith((".", "~"))
    if looks_like_path and not os.path.exists(os.path.expanduser(path)):
        raise FileNotFoundError(
            f"HFCausalLM(pretrained={path!r}): no such file or directory; `pretrained` is a local directory"
            " holding a model's config.json and weights (save_pretrained's output, or a downloaded snapshot)"
        )


def _lm_head(model: nn.Module) -> nn.Module:
    """The output embeddings (LM head) of a Hugging Face causal LM, or a plain error for a model without one."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    if not callable(get_output_embeddings):
        raise TypeError(
            f"HFCausalLM(model=...) takes a Hugging Face causal LM (an *ForCausalLM instance), got"
            f" {type(model).__name__}"
        )
    head: Optional[nn.Module] = get_output_embeddings()
    if head is None:
        name = type(model).__name__
        causal = f"{name[: -len('Model')]}ForCausalLM" if name.endswith("Model") else "the *ForCausalLM class"
        raise ValueError(
            f"{name} has no output embeddings (no LM head) for the loss: pass a causal LM with one, e.g."
            f" {causal} (AutoModelForCausalLM.from_config / from_pretrained) instead of the bare decoder"
        )
    return head


def compile_decoder_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """``torch.compile`` (``nn.Module.compile(**compile_kwargs)``, in place) the modules whose class a Hugging
    Face model's ``_no_split_modules`` names: the decoder layers of causal LMs such as Llama, Mistral, Qwen,
    Gemma and GPT-2 (the per-layer unit that FSDP wraps too; some models name other blocks there). Returns
    how many; raises ``ValueError`` for a model that names none. Layers of one class share their compiled code.

    Generation with a KV cache (``generate``) guards on each layer's cache and recompiles per layer until
    Dynamo's recompile limit, after which the layers run eager, training included: generate under
    ``torch.compiler.set_stance("force_eager")`` (torch >= 2.6) or from an uncompiled copy."""
    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in `_no_split_modules`; compile its layers"
            " yourself (`layer.compile()`)"
        )
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def _layers_compiled(model: nn.Module) -> bool:
    # nn.Module.compile() keeps its wrapper here; pickling and deep copies drop it
    return all(getattr(layer, "_compiled_call_impl", None) is not None for layer in _decoder_layers(model))
