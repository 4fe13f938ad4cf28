"""FLOPs of a decoder-only language model's step, counted from its shapes, for Lightning's ``ThroughputMonitor``.

Lightning's recipe (``measure_flops`` of a forward on the meta device) fails for Hugging Face models, whose masking
code calls ``.item()``; an analytic count needs no forward at all. It counts what ``torch.utils.flop_counter``
counts, the matrix products at 2 FLOPs per multiply-add:

- ``2 · tokens · P`` for the weight products, ``P`` the weights of the linear layers (the projections, the MLP
  and the LM head's ``H · V``; embeddings and norms multiply nothing);
- ``4 · B · T² · A`` per layer for the attention scores and their weighted sum (``A`` = heads × head size),
  the full ``T × T`` as the kernels compute it, causal mask or not;
- backward, for training, twice the forward: the gradients of the inputs and of the weights
  (so the LM head costs its ``6 · N · H · V``).

The bundled models (``TinyGPT``, ``HFCausalLM``) mix in :class:`ThroughputFlops`: their ``flops_per_batch`` is
this count for the batch in progress, training (forward + backward) or evaluation (forward), which is what
``ThroughputMonitor`` reads after each batch::

    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning_flce.flops import batch_size, batch_tokens

    monitor = ThroughputMonitor(batch_size_fn=batch_size, length_fn=batch_tokens)
    trainer = L.Trainer(callbacks=[monitor], log_every_n_steps=10)  # train|device|flops_per_sec, ... are logged

YAML::

    trainer:
      callbacks:
        - class_path: lightning.pytorch.callbacks.ThroughputMonitor
          init_args:
            batch_size_fn: lightning_flce.flops.batch_size
            length_fn: lightning_flce.flops.batch_tokens
"""

from typing import Any, Optional

from torch import nn


def decoder_flops(
    *,
    batch_size: int,
    seq_len: int,
    linear_params: int,
    n_layers: int,
    attention_width: int,
    training: bool = True,
) -> int:
    """FLOPs of one batch of ``batch_size`` sequences of ``seq_len`` tokens through a decoder whose linear layers
    hold ``linear_params`` weights (LM head included) and whose ``n_layers`` attention layers are
    ``attention_width`` wide (query heads × head size); ``training`` adds the backward (twice the forward)."""
    tokens = batch_size * seq_len
    forward = 2 * tokens * linear_params + 4 * n_layers * batch_size * seq_len**2 * attention_width
    return 3 * forward if training else forward


def linear_weight_count(module: nn.Module) -> int:
    """Weights of the linear layers of ``module`` (``nn.Linear``, and the ``Conv1D`` of Hugging Face's GPT-2
    family, a linear layer with a transposed weight): the ``P`` of :func:`decoder_flops`. A weight shared by two
    layers counts once per layer, as both multiply."""
    count = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear) or (type(layer).__name__ == "Conv1D" and getattr(layer, "nf", None)):
            count += layer.weight.numel()
    return count


def batch_size(batch: Any) -> int:
    """Sequences in a batch ``{"input_ids": [B, T], ...}`` (``ThroughputMonitor(batch_size_fn=...)``)."""
    return int(batch["input_ids"].shape[0])


def batch_tokens(batch: Any) -> int:
    """Token positions in a batch ``{"input_ids": [B, T], ...}``, padding included (``length_fn=...``)."""
    return int(batch["input_ids"].numel())


class ThroughputFlops:
    """LightningModule mixin: ``flops_per_batch`` (what ``ThroughputMonitor`` reads) is
    ``self.estimate_flops(B, T, training)`` of the batch in progress, ``[B, T]`` the shape of its
    ``input_ids``: forward + backward for training batches, forward for validation and test batches. Assigning
    ``flops_per_batch`` fixes it to that number instead. The class defines ``estimate_flops``."""

    _flops_fixed: Optional[int] = None
    _flops_shape: Optional[tuple[int, int]] = None
    _flops_training = True

    def estimate_flops(self, batch_size: int, seq_len: int, training: bool = True) -> int:
        raise NotImplementedError

    @property
    def flops_per_batch(self) -> Optional[int]:
        if self._flops_fixed is not None:
            return self._flops_fixed
        if self._flops_shape is None:
            return None
        return self.estimate_flops(*self._flops_shape, training=self._flops_training)

    @flops_per_batch.setter
    def flops_per_batch(self, value: Optional[int]) -> None:
        self._flops_fixed = value

    def _flops_of(self, batch: Any, training: bool) -> None:
        input_ids = batch.get("input_ids") if isinstance(batch, dict) else None
        self._flops_shape = None if input_ids is None or input_ids.dim() != 2 else tuple(input_ids.shape)
        self._flops_training = training

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        self._flops_of(batch, training=True)
        return super().on_train_batch_start(batch, batch_idx)

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._flops_of(batch, training=False)
        super().on_validation_batch_start(batch, batch_idx, dataloader_idx)

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._flops_of(batch, training=False)
        super().on_test_batch_start(batch, batch_idx, dataloader_idx)
