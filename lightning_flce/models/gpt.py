"""TinyGPT: a small GPT-style decoder whose LM loss goes through :class:`~lightning_flce.mixin.FLCEMixin`."""

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import OptimizerLRScheduler, OptimizerLRSchedulerConfig
from torch import Tensor, nn

from lightning_flce.data.dataset import check_label_format
from lightning_flce.flops import ThroughputFlops, decoder_flops
from lightning_flce.mixin import FLCEMixin


class TinyGPT(FLCEMixin, ThroughputFlops, pl.LightningModule):
    r"""Small GPT-style decoder: learned token and position embeddings, pre-LN blocks with causal
    self-attention (``F.scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm and an LM head
    tied to the token embedding by default.

    Batches are dicts ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` whose labels are
    already aligned with the positions (``labels[t]`` is the token after ``input_ids[t]``, -100 ignored),
    so the model does not shift; an optional ``token_weight`` (float, the shape of ``labels``) weights each
    token's loss (:meth:`~lightning_flce.mixin.FLCEMixin.flce_loss`). The loss never builds the logits (:class:`FLCEMixin`); ``forward`` returns
    them for inference.

    Args:
        vocab_size: vocabulary size (rows of the LM head).
        d_model: hidden size.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block (must divide ``d_model``).
        max_seq_len: longest input (size of the position embedding).
        dropout: dropout of the embeddings, attention and MLP outputs.
        tie_embeddings: share one parameter between the token embedding and the LM head.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay of the matrices (embeddings included); biases and norms get none.
        warmup_steps: linear warmup steps, then cosine decay to 10% of ``lr`` at the last step.
        \**kwargs: the ``flce_*`` options of :class:`FLCEMixin`.

    Example:

    .. code-block:: python

        model = TinyGPT(vocab_size=8192, d_model=128, flce_chunk_size=1024)
        trainer = L.Trainer(max_steps=500)
        trainer.fit(model, datamodule)
        logits = model(input_ids)  # [B, T, vocab_size]
        model.estimate_flops(batch_size=16, seq_len=128)  # one training step's FLOPs (ThroughputMonitor)

    .. code-block:: yaml

        model:
          class_path: lightning_flce.models.TinyGPT
          init_args:
            d_model: 128
            n_layers: 2
            flce_lse_square_scale: 1.0e-4

    """

    def __init__(
        self,
        vocab_size: int = 8192,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        max_seq_len: int = 128,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if d_model % n_heads != 0:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        for name, value in (("vocab_size", vocab_size), ("n_layers", n_layers), ("max_seq_len", max_seq_len)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.save_hyperparameters()
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                # GPT-2: residual projections scaled down with depth
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layers))
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def setup(self, stage: str) -> None:
        check_label_format(self, "shifted")
        super().setup(stage)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2): shard each block, an untied head, then the root."""
        if self.device_mesh is None:
            return
        from lightning_flce.parallel import fully_shard_lm

        head = None if self.lm_head.weight is self.tok_emb.weight else self.lm_head
        fully_shard_lm(self, self.device_mesh["data_parallel"], blocks=self.blocks, head=head)

    def estimate_flops(self, batch_size: int, seq_len: int, training: bool = True) -> int:
        """FLOPs of a batch of ``batch_size`` sequences of ``seq_len`` tokens from the configuration
        (:func:`~lightning_flce.flops.decoder_flops`): per block ``12 · d_model²`` weights (qkv 3, output 1,
        MLP 4 + 4) and the head's ``vocab_size · d_model``; forward + backward when ``training``. It is
        ``flops_per_batch`` during fit (:class:`~lightning_flce.flops.ThroughputFlops`)."""
        hp = self.hparams
        return decoder_flops(
            batch_size=batch_size,
            seq_len=seq_len,
            linear_params=hp.n_layers * 12 * hp.d_model**2 + hp.vocab_size * hp.d_model,
            n_layers=hp.n_layers,
            attention_width=hp.d_model,
            training=training,
        )

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """Final hidden states [B, T, d_model] (after the last LayerNorm)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
        seq_len = input_ids.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}")
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits [B, T, vocab_size] (inference path)."""
        return self.flce_logits(self.hidden_states(input_ids))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        # several dataloaders: the mixin keeps metrics per dataloader (val/loss/dataloader_idx_N, ...)
        return self._loss(batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._loss(batch)

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        hidden = self.hidden_states(batch["input_ids"])
        return self.flce_loss(hidden, batch["labels"], token_weight=batch.get("token_weight"))

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Logits [B, T, vocab_size] of ``batch["input_ids"]`` (``trainer.predict``)."""
        return self(batch["input_ids"])

    def configure_optimizers(self) -> OptimizerLRScheduler:
        return adamw_with_warmup_cosine(
            self,
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
            warmup_steps=self.hparams.warmup_steps,
        )


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, d_model = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq_len, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        x = x + self.drop(self.attn_proj(attn.transpose(1, 2).reshape(batch, seq_len, d_model)))
        return x + self.drop(self.mlp_proj(F.gelu(self.fc(self.norm2(x)))))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def adamw_with_warmup_cosine(
    module: pl.LightningModule, *, lr: float, weight_decay: float, warmup_steps: int
) -> OptimizerLRSchedulerConfig:
    """AdamW (decay on matrices only) with linear warmup and cosine decay to 10% of ``lr``, stepped per
    optimizer step; without a known number of steps (``max_steps=-1`` on an endless loader) the rate stays
    at ``lr`` after warmup. AdamW is torch's fused implementation where Lightning supports it (below)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if any(p.dtype == torch.float16 for p in params):
        # AdamW keeps its states in the parameters' dtype: in fp16 eps=1e-8 is 0, so a parameter row without
        # gradient (an unseen token's embedding) divides 0 by 0
        raise ValueError(
            "this AdamW cannot train fp16 parameters (precision='16-true'): its states would be fp16 and its eps"
            " underflows to 0, giving NaN; use precision='16-mixed' (fp32 parameters) or 'bf16-true'"
        )
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = _can_fuse(module, params)
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), fused=fused)
    total_steps = module.trainer.estimated_stepping_batches

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if not math.isfinite(total_steps) or total_steps <= warmup_steps:
            return 1.0
        progress = min((step - warmup_steps) / (total_steps - warmup_steps), 1.0)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _can_fuse(module: pl.LightningModule, params: list[nn.Parameter]) -> Optional[bool]:
    """``True`` (fused AdamW: one pass over the parameters and states instead of foreach's dozen: 14–17 ms
    a step at 1.2B fp32 parameters on an H200) for CUDA parameters on one device or under DDP, where nothing
    Lightning does with the gradients before the step needs them unscaled by the optimizer: no loss scaler
    (16-mixed: the hooks would see scaled gradients, and a non-fused checkpoint could not resume), no gradient
    clipping under mixed precision (Lightning refuses to clip for a fused optimizer there), and automatic
    optimization (manual optimization clips by itself). ``None`` (torch's default) otherwise, sharded
    strategies included. On resume the checkpoint's choice wins (``load_state_dict`` restores ``fused``)."""
    trainer = module.trainer
    if not params or not all(p.is_cuda for p in params) or not module.automatic_optimization:
        return None
    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(
        strategy, DeepSpeedStrategy
    ):
        return None
    precision = trainer.precision_plugin
    if getattr(precision, "scaler", None) is not None:
        return None
    clips = bool(trainer.gradient_clip_val) or is_overridden(
        "configure_gradient_clipping", module, pl.LightningModule
    )
    if clips and isinstance(precision, MixedPrecision):
        return None
    return True
