"""GRPO through FLCEMixin: TinyGPT learns, from a reward alone, to write a chosen token, with the policy loss
normalized over the whole optimizer step (gradient accumulation, and data-parallel ranks under DDP).

Each training step samples ``group_size`` completions for each of a few random prompts; a completion ends at
its first ``eos_token`` (the tokens after it leave the mask), so completions differ in length. The reward is the
fraction of a completion's tokens that are ``target_token`` (a toy verifiable reward), normalized within each
group (the GRPO advantage). The loss is :meth:`~lightning_flce.mixin.FLCEMixin.flce_policy_loss`, whose options
are the module's ``flce_*`` arguments (``flce_loss_type``, ``flce_epsilon_high``, ...); the old policy's
log-probabilities come from :meth:`~lightning_flce.mixin.FLCEMixin.flce_logprobs` at sampling time. With
``accumulate_grad_batches=2`` the mixin divides the step's loss by its loss type's normalizer over both
micro-batches (``"grpo"``: the step's sequences; ``"dapo"``: its masked tokens), as one call on the step's
sequences would. The logged ``train/reward`` and ``train/policy/*`` are in
``lightning_logs/grpo_lightning/version_*/metrics.csv``::

    python examples/grpo_lightning.py --max_steps 40 --loss_type dapo

Without the mixin (the function called on the head's weight in ``training_step``): ``examples/grpo_tinygpt.py``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_flce.models import TinyGPT


class GRPOLightningGPT(TinyGPT):
    """TinyGPT trained with ``flce_policy_loss`` on "fraction of completion tokens equal to ``target_token``"."""

    def __init__(
        self,
        target_token: int = 7,
        eos_token: int = 0,
        group_size: int = 8,
        completion_length: int = 12,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)  # the flce_* options (flce_loss_type, ...) go to the mixin
        self.target_token = target_token
        self.eos_token = eos_token
        self.group_size = group_size
        self.completion_length = completion_length

    @torch.no_grad()
    def sample(self, prompts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Completions [B, T] sampled at temperature 1, their mask (up to the first EOS, included) and the
        sampling policy's log-probabilities (as a sampler would return them)."""
        ids = prompts
        for _ in range(self.completion_length):
            logits = self.flce_logits(self.hidden_states(ids)[:, -1]).float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], dim=1)
        completions = ids[:, prompts.shape[1] :]
        ended_before = (completions == self.eos_token).long().cumsum(-1) - (
            completions == self.eos_token
        ).long()
        mask = ended_before == 0
        old_logprobs = self.flce_logprobs(self._completion_hidden(prompts, completions), completions).logprobs
        return completions, mask, old_logprobs

    def _completion_hidden(self, prompts: Tensor, completions: Tensor) -> Tensor:
        # the hidden state before each completion token predicts it
        ids = torch.cat([prompts, completions], dim=1)
        return self.hidden_states(ids[:, :-1])[:, prompts.shape[1] - 1 :]

    def training_step(self, batch, batch_idx: int) -> Tensor:
        (prompts,) = batch
        prompts = prompts.repeat_interleave(self.group_size, dim=0)  # [B, P], groups of group_size
        was_training = self.training
        self.eval()
        completions, mask, old_logprobs = self.sample(prompts)
        self.train(was_training)
        hits = ((completions == self.target_token) & mask).sum(-1)
        reward = hits / mask.sum(-1).clamp(min=1)  # [B]
        groups = reward.view(-1, self.group_size)
        advantages = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-4)

        out = self.flce_policy_loss(
            self._completion_hidden(prompts, completions),
            completions,
            advantages=advantages.view(-1),
            old_logprobs=old_logprobs,
            mask=mask,
            return_entropy=True,
        )  # logs train/policy/{clip_fraction_low, clip_fraction_high, ratio_mean, entropy_mean}
        self.log("train/reward", reward.mean(), prog_bar=True)
        self.log("train/completion_length", mask.sum(-1).float().mean())
        return out.loss


def main(argv=None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--loss_type", default="grpo")
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--prompts_per_micro_batch", type=int, default=4)
    parser.add_argument("--accumulate_grad_batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    L.seed_everything(args.seed)
    model = GRPOLightningGPT(
        vocab_size=args.vocab_size,
        d_model=64,
        n_layers=2,
        max_seq_len=32,
        lr=3e-3,
        warmup_steps=10,
        flce_loss_type=args.loss_type,
        flce_epsilon_high=0.28,
        flce_entropy_coef=0.0,
    )
    micro_batches = args.max_steps * args.accumulate_grad_batches
    prompts = torch.randint(1, args.vocab_size, (micro_batches * args.prompts_per_micro_batch, 4))
    loader = DataLoader(TensorDataset(prompts), batch_size=args.prompts_per_micro_batch, shuffle=False)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        logger=L.pytorch.loggers.CSVLogger("lightning_logs", name="grpo_lightning"),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return trainer


if __name__ == "__main__":
    main()
