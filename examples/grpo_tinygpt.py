"""GRPO on the fused head: TinyGPT learns, from a reward alone, to write a chosen token.

Each step samples ``group_size`` completions for each of a few random prompts, rewards each completion by the
fraction of its tokens that are ``target_token`` (a toy verifiable reward), normalizes the rewards within each
group (the GRPO advantage), and trains on :func:`lightning_flce.fused_linear_policy_loss` — the LM head's loss
and gradients computed in chunks, without the [B, T, V] logits. On a shared 2-core CPU the logged
``train/reward`` (``lightning_logs/grpo_tinygpt/version_*/metrics.csv``) climbed from 0.08 at step 10 to 0.38, 0.91
and 0.99 at steps 20, 30 and 40, with the entropy falling from 4.1 to 0.06 (vocabulary 64; 0.2 s a step)::

    python examples/grpo_tinygpt.py --max_steps 60

On-policy (one optimizer step per sampled batch), so ``old_logprobs`` is None (ratio 1, with its gradient); a
multi-epoch PPO-style loop would pass the sampling-time log-probabilities (``PolicyLossOutput.logprobs``).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_flce import fused_linear_policy_loss
from lightning_flce.models import TinyGPT


class GRPOTinyGPT(TinyGPT):
    """TinyGPT trained with the GRPO loss on the reward "fraction of completion tokens equal to ``target_token``"."""

    def __init__(
        self,
        target_token: int = 7,
        group_size: int = 8,
        completion_length: int = 12,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.target_token = target_token
        self.group_size = group_size
        self.completion_length = completion_length
        self.beta = beta
        self.entropy_coef = entropy_coef

    @torch.no_grad()
    def sample(self, prompts: Tensor) -> Tensor:
        """``completion_length`` tokens after each prompt, sampled at temperature 1."""
        ids = prompts
        for _ in range(self.completion_length):
            logits = self.flce_logits(self.hidden_states(ids)[:, -1]).float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], dim=1)
        return ids[:, prompts.shape[1] :]

    def training_step(self, batch, batch_idx: int) -> Tensor:
        (prompts,) = batch
        prompts = prompts.repeat_interleave(self.group_size, dim=0)  # [B, P], groups of group_size
        was_training = self.training
        self.eval()
        completions = self.sample(prompts)  # [B, T]
        self.train(was_training)
        reward = (completions == self.target_token).float().mean(-1)  # [B]
        groups = reward.view(-1, self.group_size)
        advantages = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-4)).view(
            -1
        )

        ids = torch.cat([prompts, completions], dim=1)
        # the hidden state before each completion token predicts it
        hidden = self.hidden_states(ids[:, :-1])[:, prompts.shape[1] - 1 :]
        out = fused_linear_policy_loss(
            hidden,
            self.lm_head.weight,
            completions,
            advantages=advantages,
            loss_type="grpo",
            entropy_coef=self.entropy_coef,
            return_entropy=True,
        )
        self.log("train/reward", reward.mean(), prog_bar=True)
        self.log_dict({f"train/{name}": value for name, value in out.metrics.items()})
        return out.loss


def main(argv=None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--prompts_per_step", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    L.seed_everything(args.seed)
    model = GRPOTinyGPT(
        vocab_size=args.vocab_size, d_model=64, n_layers=2, max_seq_len=32, lr=3e-3, warmup_steps=10
    )
    prompts = torch.randint(0, args.vocab_size, (args.max_steps * args.prompts_per_step, 4))
    loader = DataLoader(TensorDataset(prompts), batch_size=args.prompts_per_step, shuffle=False)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        logger=L.pytorch.loggers.CSVLogger("lightning_logs", name="grpo_tinygpt"),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return trainer


if __name__ == "__main__":
    main()
