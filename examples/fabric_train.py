"""Train a small language model with Lightning Fabric and the fused LM-head loss (:class:`FLCEHeadLoss`).

The loss is computed inside the model's ``forward``: Fabric runs that call in its precision (``torch.autocast``
under ``bf16-mixed``), and under DDP/FSDP the head is called where the strategy expects it. Each optimizer step
accumulates several micro-batches and normalizes per token: every micro-batch backpropagates its loss *sum*
divided by the labelled tokens of the whole step (all ranks), so the step's gradient is that of the mean over
the step's tokens, whatever the micro-batches' sizes. About 20 s of CPU time (``docs/fabric.md``)::

    python examples/fabric_train.py                         # 32-true
    python examples/fabric_train.py --precision bf16-mixed  # the loss in bf16 GEMMs, fp32 softmax
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Optional, cast

import lightning as L
import torch
from torch import Tensor, nn

from lightning_flce import FLCEHeadLoss

IGNORE_INDEX = -100


class TinyLM(nn.Module):
    """Embedding, pre-LN Transformer layers, a final LayerNorm and an LM head tied to the embedding."""

    def __init__(self, vocab_size: int = 512, d_model: int = 64, n_layers: int = 2, n_heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one parameter, one gradient
        nn.init.normal_(self.embed.weight, std=0.02)  # small logits at the start (nn.Embedding's std is 1)
        self.head_loss = FLCEHeadLoss(ignore_index=IGNORE_INDEX)

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """Final hidden states [B, T, d_model]."""
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.norm(x)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """The loss summed over the labelled tokens (``labels[t]`` is the token after ``input_ids[t]``)."""
        return self.head_loss(self.lm_head, self.hidden_states(input_ids), labels, reduction="sum")


def counting_batch(
    batch_size: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> dict[str, Tensor]:
    """Sequences that count up from a random token (mod ``vocab_size``), each cut at a random length; the
    positions past its end are labelled ``IGNORE_INDEX``, so micro-batches have different token counts."""
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    tokens = (start + torch.arange(seq_len + 1)) % vocab_size
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch_size, 1), generator=generator)
    labels = tokens[:, 1:].masked_fill(torch.arange(seq_len) >= lengths, IGNORE_INDEX)
    return {"input_ids": tokens[:, :-1], "labels": labels}


def train_step(
    fabric: L.Fabric,
    model: Any,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[dict[str, Tensor]],
) -> Tensor:
    """One optimizer step of ``model`` and ``optimizer`` (as ``fabric.setup`` returned them) over
    ``micro_batches``; returns the step's mean loss per labelled token (all ranks)."""
    local_tokens = sum((batch["labels"] != IGNORE_INDEX).sum() for batch in micro_batches)
    tokens = cast(
        Tensor, fabric.all_reduce(torch.as_tensor(local_tokens, device=fabric.device), reduce_op="sum")
    )
    # DDP and FSDP average the gradients over the ranks: world_size / tokens makes it the per-token mean
    scale = fabric.world_size / tokens.clamp(min=1)
    loss_sum = torch.zeros((), device=fabric.device)
    for index, batch in enumerate(micro_batches):
        with fabric.no_backward_sync(model, enabled=index < len(micro_batches) - 1):
            micro_loss_sum = model(batch["input_ids"], batch["labels"])
            fabric.backward(micro_loss_sum * scale)
        loss_sum += micro_loss_sum.detach()
    optimizer.step()
    optimizer.zero_grad()
    return cast(Tensor, fabric.all_reduce(loss_sum, reduce_op="sum")) / tokens.clamp(min=1)


def main(argv: Optional[Sequence[str]] = None) -> list[float]:
    parser = argparse.ArgumentParser(description="Train a small LM with Lightning Fabric and FLCEHeadLoss.")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    fabric = L.Fabric(accelerator=args.accelerator, devices=1, precision=args.precision)
    fabric.seed_everything(0)
    with fabric.init_module():
        model = TinyLM(vocab_size=args.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)

    generator = torch.Generator().manual_seed(fabric.global_rank)
    losses = []
    for step in range(1, args.steps + 1):
        micro_batches = [
            fabric.to_device(counting_batch(args.batch_size, args.seq_len, args.vocab_size, generator))
            for _ in range(args.accumulate)
        ]
        loss = train_step(fabric, model, optimizer, micro_batches)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            fabric.print(f"step {step:4d}  loss {loss.item():.4f}  ({args.precision})")
    return losses


if __name__ == "__main__":
    main()
