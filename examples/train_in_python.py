"""Train TinyGPT with the fused linear cross-entropy loss, the Trainer set up in Python (CPU, under a minute).

The data is a fixed random Markov chain over the vocabulary (each token has a few likely successors), so
the loss has a known floor: the chain's entropy rate, printed at the end.

    python examples/train_in_python.py
    python examples/train_in_python.py --naive       # plain logits + cross-entropy, for comparison
"""

import argparse
import math

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_flce.models import TinyGPT


class MarkovTokens(Dataset):
    """Sequences sampled from a fixed random Markov chain; labels are the next tokens (already shifted)."""

    def __init__(self, transitions: torch.Tensor, num_sequences: int, seq_len: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        vocab_size = transitions.shape[0]
        # sample among the few successors of each token only: much faster than over the whole vocabulary
        probs, successors = transitions.topk(int((transitions > 0).sum(1).max()), dim=1)
        tokens = torch.empty(num_sequences, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab_size, (num_sequences,), generator=generator)
        for t in range(seq_len):
            pick = torch.multinomial(probs[tokens[:, t]], 1, generator=generator)
            tokens[:, t + 1] = successors[tokens[:, t]].gather(1, pick).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


def markov_chain(vocab_size: int, successors: int, seed: int) -> torch.Tensor:
    """Row-stochastic [V, V] matrix: each token moves to one of ``successors`` random tokens."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab_size, vocab_size), -math.inf)
    choice = torch.rand(vocab_size, vocab_size, generator=generator).argsort(dim=1)[:, :successors]
    logits.scatter_(1, choice, torch.randn(vocab_size, successors, generator=generator))
    return logits.softmax(dim=1)


def entropy_rate(transitions: torch.Tensor) -> float:
    """Entropy per token (nats) of the chain in its stationary distribution."""
    stationary = torch.full((transitions.shape[0],), 1.0 / transitions.shape[0])
    for _ in range(200):
        stationary = stationary @ transitions
    row_entropy = -(transitions * transitions.clamp_min(1e-30).log()).sum(dim=1)
    return float(stationary @ row_entropy)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--naive", action="store_true", help="materialize the logits (flce_naive=True)")
    args = parser.parse_args()

    L.seed_everything(0)
    seq_len = 64
    transitions = markov_chain(args.vocab_size, successors=4, seed=0)
    train = MarkovTokens(transitions, num_sequences=1024, seq_len=seq_len, seed=1)
    val = MarkovTokens(transitions, num_sequences=64, seq_len=seq_len, seed=2)

    model = TinyGPT(
        vocab_size=args.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=seq_len,
        lr=3e-3,
        warmup_steps=20,
        flce_chunk_size=512,  # tokens per chunk: the loss never holds more than 512 x vocab logits
        flce_naive=args.naive,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        accumulate_grad_batches=2,  # the loss is still the mean over all tokens of each optimizer step
        limit_val_batches=4,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=16, shuffle=True),
        DataLoader(val, batch_size=16),
    )
    train_loss = trainer.callback_metrics["train/loss_step"].item()
    metrics = trainer.validate(model, DataLoader(val, batch_size=16), verbose=False)[0]
    print(
        f"train/loss {train_loss:.3f}  val/loss {metrics['val/loss']:.3f}"
        f"  val/perplexity {metrics['val/perplexity']:.2f}  val/token_accuracy {metrics['val/token_accuracy']:.3f}"
    )
    print(
        f"entropy rate of the chain (the lowest reachable loss): {entropy_rate(transitions):.3f} nats/token"
    )
    built = "built (naive path)" if args.naive else "never built"
    print(f"logits of the last loss call, {built}: {model.flce_last_logits_shape} (N, V)")

    # inference keeps the normal logits path
    prompt = val[0]["input_ids"][:8].unsqueeze(0)
    with torch.no_grad():
        next_token = model(prompt)[0, -1].argmax().item()
    print(f"greedy next token after {prompt[0].tolist()}: {next_token}")


if __name__ == "__main__":
    main()
