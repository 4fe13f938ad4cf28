"""On-policy distillation (GKD) with DistillationModule: a small TinyGPT learns a teacher's Markov chain from the
teacher's next-token distributions on the student's own samples (CPU, under a minute).

GKD (Agarwal et al., "On-Policy Distillation of Language Models", ICLR 2024; TRL's ``GKDTrainer``) trains the student
on sequences it samples itself, so that it learns where its own mistakes lead and not only on the dataset's
sequences: with probability ``lmbda`` a micro-batch's completions are replaced by the student's samples for the same
prompts, otherwise the dataset's are kept. The loss is the divergence between the teacher's and the student's
next-token distributions at every completion position (the prompt's positions carry none): here the generalized JSD
with ``beta`` 0.5, GKD's default (``--divergence reverse_kl`` for the mode-seeking one). The teacher's distribution over
the whole vocabulary at each sampled position comes from the fused loss: neither model's ``[N, V]`` logits exist in the
training step (only the sampling loop's last position has logits).

The example trains the teacher (TinyGPT, two blocks) on sequences of a random Markov chain in which each token has a
few successors, distills it into a student of one block and half the width, and prints how often each model's sampled
transitions are ones the chain allows::

    python examples/distill_on_policy.py
    python examples/distill_on_policy.py --lmbda 0    # off-policy: the dataset's completions only

For a real student, replace :meth:`OnPolicyDistillation.sample_completions` (a Hugging Face model's ``generate``, or
an inference engine's samples from the student's current weights); the rest is the module's.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_flce import DistillationModule
from lightning_flce.models import TinyGPT

IGNORE_INDEX = -100


def chain_successors(vocab_size: int, successors: int, seed: int) -> Tensor:
    """[V, successors]: the tokens each token may be followed by (distinct, uniformly likely)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack(
        [torch.randperm(vocab_size, generator=generator)[:successors] for _ in range(vocab_size)]
    )


def chain_sequences(successors: Tensor, count: int, length: int, seed: int) -> Tensor:
    """[count, length] token sequences walked on the chain from uniformly random first tokens."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.empty(count, length, dtype=torch.long)
    sequences[:, 0] = torch.randint(0, successors.shape[0], (count,), generator=generator)
    for t in range(1, length):
        pick = torch.randint(0, successors.shape[1], (count, 1), generator=generator)
        sequences[:, t] = successors[sequences[:, t - 1]].gather(1, pick).squeeze(1)
    return sequences


def allowed_fraction(successors: Tensor, sequences: Tensor, start: int) -> float:
    """The fraction of the transitions into positions ``start..`` of ``sequences`` that the chain allows."""
    previous, following = sequences[:, start - 1 : -1], sequences[:, start:]
    allowed = (successors[previous] == following.unsqueeze(-1)).any(-1)
    return float(allowed.float().mean())


@torch.no_grad()
def sample(model: Any, prompts: Tensor, length: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """[B, length] tokens sampled after ``prompts`` [B, P] at temperature 1, in eval mode: token by token from an
    ``FLCEMixin`` model's ``hidden_states`` and ``flce_logits`` (TinyGPT, HFCausalLM, LitGPTCausalLM, unsharded),
    recomputing the prefix each time (no KV cache: a toy sampler)."""
    was_training = model.training
    model.eval()
    ids = prompts
    for _ in range(length):
        logits = model.flce_logits(model.hidden_states(ids)[:, -1]).float()
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
    model.train(was_training)
    return ids[:, prompts.shape[1] :]


def language_model_batch(sequences: Tensor) -> dict[str, Tensor]:
    """A TinyGPT batch of whole sequences: each position's label is the next token."""
    return {"input_ids": sequences[:, :-1], "labels": sequences[:, 1:]}


def completion_batch(
    sequences: Tensor, prompt_length: int, label_format: str = "shifted"
) -> dict[str, Tensor]:
    """A batch of prompt + completion sequences whose loss is on the completion only, in the student's label format
    (``DistillationModule.label_format``): ``"shifted"`` (TinyGPT, LitGPT: each position's label is the next token;
    the positions whose next token is still the prompt's get ``IGNORE_INDEX``) or ``"hf"`` (Hugging Face: labels are
    the tokens themselves, shifted by the module; the prompt's get ``IGNORE_INDEX``)."""
    if label_format == "hf":
        labels = sequences.clone()
        labels[:, :prompt_length] = IGNORE_INDEX
        return {"input_ids": sequences, "labels": labels, "attention_mask": torch.ones_like(sequences)}
    labels = sequences[:, 1:].clone()
    labels[:, : prompt_length - 1] = IGNORE_INDEX
    return {"input_ids": sequences[:, :-1], "labels": labels}


class OnPolicyDistillation(DistillationModule):
    """:class:`~lightning_flce.DistillationModule` whose micro-batches are, with probability ``lmbda``, the student's
    own completions of the batch's prompts (GKD). Batches are :func:`completion_batch`'s: the first
    ``prompt_length`` tokens of each sequence are its prompt."""

    def __init__(self, *, prompt_length: int, lmbda: float = 0.5, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= lmbda <= 1.0:
            raise ValueError(f"lmbda must be in [0, 1], got {lmbda}")
        if prompt_length < 1:
            raise ValueError(f"prompt_length must be >= 1, got {prompt_length}")
        self.prompt_length = prompt_length
        self.lmbda = lmbda
        # one seeded stream on every rank: the DDP ranks sample in the same micro-batches, so none waits on
        # another's generation
        self._draws = torch.Generator().manual_seed(seed)

    def sample_completions(self, prompts: Tensor, length: int) -> Tensor:
        """[B, length] tokens sampled from the student after ``prompts`` [B, P] (:func:`sample`). The one method to
        replace for a real student: a Hugging Face model's ``generate``, or an inference engine's samples from the
        student's current weights."""
        return sample(self.student, prompts, length)

    def on_policy_batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` (of :func:`completion_batch`) with each completion replaced by the student's sample of the same
        length for its prompt."""
        input_ids = batch["input_ids"]
        prompts = input_ids[:, : self.prompt_length]
        # a shifted batch's input_ids lack the sequence's last token
        length = input_ids.shape[1] - self.prompt_length + (self.label_format != "hf")
        completions = self.sample_completions(prompts, length)
        return completion_batch(
            torch.cat([prompts, completions], dim=1), self.prompt_length, self.label_format
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        on_policy = bool(torch.rand((), generator=self._draws) < self.lmbda)
        if on_policy:
            batch = self.on_policy_batch(batch)
        self.log("train/on_policy", float(on_policy), on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def sampled_allowed_fraction(
    model: TinyGPT, successors: Tensor, prompts: Tensor, length: int, seed: int = 0
) -> float:
    """How often ``model``'s sampled continuations of ``prompts`` take transitions the chain allows (its own seeded
    draws: the same for every model and run)."""
    completions = sample(model, prompts, length, torch.Generator().manual_seed(seed))
    return allowed_fraction(successors, torch.cat([prompts, completions], dim=1), prompts.shape[1])


def _trainer(max_steps: int, name: str, log_every_n_steps: int = 10) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        val_check_interval=max_steps,  # one validation, at the end
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=log_every_n_steps,
        logger=L.loggers.CSVLogger("lightning_logs", name=name),
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--successors", type=int, default=3)
    parser.add_argument("--prompt_length", type=int, default=4)
    parser.add_argument("--completion_length", type=int, default=12)
    parser.add_argument("--teacher_steps", type=int, default=150)
    parser.add_argument("--student_steps", type=int, default=150)
    parser.add_argument("--lmbda", type=float, default=0.5, help="the share of on-policy micro-batches")
    parser.add_argument("--divergence", default="jsd", choices=["jsd", "reverse_kl", "forward_kl"])
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    L.seed_everything(args.seed, verbose=False)

    length = args.prompt_length + args.completion_length
    successors = chain_successors(args.vocab_size, args.successors, args.seed)
    train = chain_sequences(successors, 4096, length, args.seed + 1)
    val = chain_sequences(successors, 64, length, args.seed + 2)
    test_prompts = chain_sequences(successors, 256, args.prompt_length, args.seed + 3)

    def loader(sequences: Tensor, collate, shuffle: bool = False) -> DataLoader:
        return DataLoader(
            list(sequences), batch_size=32, shuffle=shuffle, collate_fn=lambda s: collate(torch.stack(s))
        )

    def as_completions(sequences: Tensor) -> dict[str, Tensor]:
        return completion_batch(sequences, args.prompt_length)

    # 1. the teacher: TinyGPT trained on the chain's sequences with the fused cross-entropy
    teacher = TinyGPT(
        vocab_size=args.vocab_size, d_model=64, n_layers=2, max_seq_len=length, lr=3e-3, warmup_steps=10
    )
    _trainer(args.teacher_steps, "distill_on_policy_teacher").fit(
        teacher, loader(train, language_model_batch, shuffle=True), loader(val, language_model_batch)
    )

    # 2. the student, distilled from it: one block, half the width
    student = TinyGPT(vocab_size=args.vocab_size, d_model=32, n_layers=1, max_seq_len=length)
    student_before = sampled_allowed_fraction(student, successors, test_prompts, args.completion_length)
    module = OnPolicyDistillation(
        student=student,
        teacher=teacher,
        prompt_length=args.prompt_length,
        lmbda=args.lmbda,
        seed=args.seed,
        divergence=args.divergence,
        beta=args.beta,
        lr=3e-3,
        warmup_steps=10,
    )
    trainer = _trainer(args.student_steps, "distill_on_policy")
    trainer.fit(module, loader(train, as_completions, shuffle=True), loader(val, as_completions))

    results = {
        "teacher": sampled_allowed_fraction(teacher, successors, test_prompts, args.completion_length),
        "student_before": student_before,
        "student_after": sampled_allowed_fraction(student, successors, test_prompts, args.completion_length),
        "val": module.last_val_metrics,
        "log_dir": trainer.logger.log_dir,
    }
    print(
        f"sampled transitions the chain allows: teacher {results['teacher']:.3f}, student before"
        f" {results['student_before']:.3f}, after distillation with lmbda {args.lmbda}: {results['student_after']:.3f}"
    )
    return results


if __name__ == "__main__":
    main()
