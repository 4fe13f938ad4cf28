"""A user project written from the README's patterns, checked by ``mypy --strict`` against the installed
package (``tests/typing/mypy.ini``; ``tests/test_typing.py`` and ``.ci/run`` run it). It is never executed: it
is what a typed user writes, and ``assert_type`` pins what mypy must infer from the public API.

The lines that end in a type-ignore comment must stay errors of the code it names (``reduction="avg"``, an
unknown ``impl``, ...): with ``warn_unused_ignores`` mypy fails once one type-checks, and
``tests/test_typing.py`` checks that each is reported with its code once the comment is gone.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from torch import Tensor, nn

# The optimizers from their modules: torch 2.4's torch.optim imports them without re-exporting them (no __all__),
# which mypy --strict refuses; the package supports torch >= 2.4.
from torch.optim.adamw import AdamW
from torch.optim.optimizer import Optimizer
from torch.optim.sgd import SGD
from torch.utils.data import DataLoader, Dataset
from typing_extensions import assert_type

from lightning_flce import (
    DistillationModule,
    FLCEHeadLoss,
    FLCEMemoryCallback,
    FLCEMixin,
    FLCEOptions,
    FLCEOutput,
    FusedLinearDistillationLoss,
    FusedLinearPolicyLoss,
    LogProbsOutput,
    PolicyLossOutput,
    TeacherTopKModule,
    TopKCacheDataset,
    TopKCacheWriter,
    TopKOutput,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_with_stats,
    fused_linear_distillation,
    fused_linear_distillation_from_top_k,
    fused_linear_logprobs,
    fused_linear_policy_loss,
    fused_linear_top_k,
    teacher_top_k,
)
from lightning_flce.flops import batch_size, batch_tokens
from lightning_flce.models import HFCausalLM, LitGPTCausalLM, TinyGPT
from lightning_flce.options import ImplName, LogitsPrecision, Reduction
from lightning_flce.parallel import (
    VocabParallelHead,
    vocab_parallel_fused_linear_distillation,
    vocab_parallel_fused_linear_distillation_from_top_k,
    vocab_parallel_fused_linear_top_k,
)

# --- the op (README "Quick start")
B, T, H, V = 2, 16, 32, 64
hidden = torch.randn(B, T, H, requires_grad=True)
lm_head = torch.randn(V, H, requires_grad=True)
labels = torch.randint(0, V, (B, T))

loss = fused_linear_cross_entropy(
    hidden, lm_head, labels, ignore_index=-100, label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0
)
assert_type(loss, Tensor)
per_token = fused_linear_cross_entropy(
    hidden,
    lm_head,
    labels,
    reduction="none",
    logits_precision="fp32",
    accum_dtype=torch.float32,
    chunk_size=1024,
    impl="torch",
)
assert_type(per_token, Tensor)

out = fused_linear_cross_entropy_with_stats(hidden, lm_head, labels, reduction="sum", impl="auto")
assert_type(out, FLCEOutput)
assert_type(out.loss, Tensor)
assert_type(out.lse, Tensor)
assert_type(out.correct, Tensor)
assert_type(out.entropy, Tensor)

# string options are Literals: a typo is a static error
fused_linear_cross_entropy(hidden, lm_head, labels, reduction="avg")  # type: ignore[arg-type]
fused_linear_cross_entropy_with_stats(hidden, lm_head, labels, impl="cuda")  # type: ignore[arg-type]
fused_linear_cross_entropy(hidden, lm_head, labels, logits_precision="fp64")  # type: ignore[arg-type]

reduction: Reduction = "mean"
impl: ImplName = "torch"
precision: LogitsPrecision = "fp32_compensated"
fused_linear_cross_entropy(
    hidden, lm_head, labels, reduction=reduction, impl=impl, logits_precision=precision
)

options = FLCEOptions.of(reduction="sum", chunk_size=512)
assert_type(options, FLCEOptions)
assert_type(options.chunk_size, Optional[int])
assert_type(fused_linear_cross_entropy(hidden, lm_head, labels, **options.as_kwargs()), Tensor)


# --- FLCEHeadLoss: the loss inside the head's own call (plain PyTorch, Fabric)
class Backbone(nn.Module):
    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden: Tensor = self.embed(input_ids)
        return hidden


backbone = Backbone(V, H)
head_loss = FLCEHeadLoss(ignore_index=-100, lse_square_scale=1e-4, chunk_size=256, impl="torch")
assert_type(head_loss, FLCEHeadLoss)
assert_type(head_loss(backbone.lm_head, backbone(labels), labels), Tensor)
assert_type(head_loss(backbone.lm_head, backbone(labels), labels, reduction="sum"), Tensor)
stats = head_loss(backbone.lm_head, backbone(labels), labels, with_stats=True)
assert_type(stats, FLCEOutput)
head_loss(backbone.lm_head, backbone(labels), labels, reduction="avg")  # type: ignore[call-overload]
FLCEHeadLoss(impl="cuda")  # type: ignore[arg-type]
assert_type(FLCEHeadLoss.from_options(options), FLCEHeadLoss)


# --- FLCEMixin in a LightningModule (README "FLCEMixin")
class MyLM(FLCEMixin, L.LightningModule):
    def __init__(self, vocab_size: int = 1024, d_model: int = 64, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # flce_* options go to the mixin
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.body = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=256, batch_first=True)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], device=input_ids.device)
        hidden: Tensor = self.body(self.embed(input_ids), src_mask=mask, is_causal=True)
        return hidden

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.flce_loss(self.hidden_states(batch["input_ids"]), batch["labels"])
        assert_type(loss, Tensor)
        # another term weighted per token like the LM loss
        weight = self.flce_last_loss_weight
        assert_type(weight, Optional[Tensor])
        return loss if weight is None else loss + 0.0 * weight

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.flce_loss(self.hidden_states(batch["input_ids"]), batch["labels"], shift=False)

    def configure_optimizers(self) -> Optimizer:
        return AdamW(self.parameters(), lr=1e-3)


model = MyLM(flce_label_smoothing=0.1, flce_lse_square_scale=1e-4, flce_chunk_size=4096)
assert_type(model.flce_options, FLCEOptions)
assert_type(model.flce_head_loss, FLCEHeadLoss)
assert_type(model.flce_logits(torch.randn(2, 64)), Tensor)
assert_type(model.flce_last_logits_shape, Optional[tuple[int, int]])


class Blocks(Dataset[dict[str, Tensor]]):
    """The README's random sequences, as a typed dataset."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        block = self.tokens[index]
        return {"input_ids": block[:-1], "labels": block[1:]}


data = DataLoader(Blocks(torch.randint(0, 1024, (32, 33))), batch_size=8)
memory = FLCEMemoryCallback(plot=False, prog_bar=True, snapshot_steps=[10])
assert_type(memory, FLCEMemoryCallback)
trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, callbacks=[memory])
trainer.fit(model, data, data)

# --- the ready-made models (README "Models", docs/lightning.md, docs/adapters.md)
tiny = TinyGPT(vocab_size=8192, d_model=128, n_layers=2, flce_chunk_size=1024)
assert_type(tiny, TinyGPT)
assert_type(tiny.estimate_flops(batch_size=16, seq_len=128), int)
assert_type(tiny.flce_loss(torch.randn(2, 8, 128), torch.randint(0, 8192, (2, 8)), shift=True), Tensor)
# the RL calls on the mixin's head (docs/rl.md), the policy options as flce_* arguments
rl_tiny = TinyGPT(vocab_size=8192, d_model=128, flce_loss_type="dapo", flce_epsilon_high=0.28, flce_beta=0.0)
rl_ids = torch.randint(0, 8192, (2, 8))
rl_logprobs = rl_tiny.flce_logprobs(torch.randn(2, 8, 128), rl_ids, temperature=0.7, return_entropy=True)
assert_type(rl_logprobs, LogProbsOutput)
rl_policy = rl_tiny.flce_policy_loss(
    torch.randn(2, 8, 128), rl_ids, advantages=torch.randn(2), old_logprobs=rl_logprobs.logprobs.detach()
)
assert_type(rl_policy, PolicyLossOutput)
assert_type(rl_policy.metrics, dict[str, Tensor])
monitor = ThroughputMonitor(batch_size_fn=batch_size, length_fn=batch_tokens)
L.Trainer(max_steps=500, callbacks=[monitor, FLCEMemoryCallback()])

hf = HFCausalLM(config={"model_type": "llama", "vocab_size": 512}, flce_chunk_size=2048)
assert_type(hf, HFCausalLM)
assert_type(hf.estimate_flops(8, 128), int)
litgpt = LitGPTCausalLM(name="pythia-14m", flce_impl="torch")
assert_type(litgpt, LitGPTCausalLM)
assert_type(head_loss.ignore_index, int)
assert_type(head_loss.impl, ImplName)


class MyTinyGPT(TinyGPT):
    """A subclass may override the models' hooks with any type Lightning accepts."""

    def configure_optimizers(self) -> Optimizer:
        return SGD(self.parameters(), lr=0.1)


# --- reinforcement learning (docs/rl.md)
lp = fused_linear_logprobs(hidden, lm_head, labels, temperature=0.7, return_entropy=True)
assert_type(lp, LogProbsOutput)
assert_type(lp.logprobs, Tensor)
assert_type(lp.entropy, Optional[Tensor])
advantages = torch.randn(B)
policy = fused_linear_policy_loss(
    hidden,
    lm_head,
    labels,
    advantages=advantages,
    old_logprobs=lp.logprobs.detach(),
    loss_type="dapo",
    beta=0.04,
)
assert_type(policy, PolicyLossOutput)
assert_type(policy.loss, Tensor)
fused_linear_policy_loss(hidden, lm_head, labels, advantages=advantages, loss_type="gspo")  # type: ignore[arg-type]
policy_module = FusedLinearPolicyLoss(loss_type="cispo", epsilon_high=5.0)
assert_type(policy_module, FusedLinearPolicyLoss)

# --- distillation: a frozen teacher's head beside the student's (another hidden size, the same vocabulary)
teacher_hidden = torch.randn(B, T, 48)
teacher_head = torch.randn(V, 48)
distill_loss = fused_linear_distillation(
    hidden, lm_head, teacher_hidden, teacher_head, labels, divergence="forward_kl", hard_weight=0.1, top_k=8
)
assert_type(distill_loss, Tensor)
fused_linear_distillation(hidden, lm_head, teacher_hidden, teacher_head, divergence="kl")  # type: ignore[arg-type]
distill_module = FusedLinearDistillationLoss(divergence="jsd", beta=0.1, temperature=2.0)
# a teacher head padded to more rows for the same tokenizer: the loss over the rows both share
padded_teacher_head = torch.randn(V + 64, 48)
fused_linear_distillation(hidden, lm_head, teacher_hidden, padded_teacher_head, labels, vocab_size=V)
fused_linear_distillation(hidden, lm_head, teacher_hidden, padded_teacher_head, vocab_size="V")  # type: ignore[arg-type]
FusedLinearDistillationLoss(accum_dtype=torch.bfloat16)  # the memory-lean accumulator
FusedLinearDistillationLoss(accum_dtype="bfloat16")
FusedLinearDistillationLoss(accum_dtype="bf16")  # type: ignore[arg-type]
# a teacher cached as its top 20 columns and logits per token
cached_indices = torch.randint(0, V, (B, T, 20))
cached_logits = torch.randn(B, T, 20)
cached_loss = fused_linear_distillation_from_top_k(
    hidden, lm_head, cached_indices, cached_logits, labels, divergence="reverse_kl", temperature=1.5
)
assert_type(cached_loss, Tensor)
fused_linear_distillation_from_top_k(hidden, lm_head, cached_indices, cached_logits, top_k=5)  # type: ignore[call-arg]
assert_type(distill_module, FusedLinearDistillationLoss)
# both heads sharded over the vocabulary alike (tensor parallelism): this rank's rows of each
vp_distill_loss = vocab_parallel_fused_linear_distillation(
    hidden,
    lm_head[:32],
    teacher_hidden,
    teacher_head[:32],
    labels,
    vocab_start=0,
    sequence_parallel=True,
    divergence="reverse_kl",
)
assert_type(vp_distill_loss, Tensor)
assert_type(
    vocab_parallel_fused_linear_distillation(hidden, lm_head, teacher_hidden, teacher_head, top_k=8), Tensor
)
vocab_parallel_fused_linear_distillation(hidden, lm_head, teacher_hidden, teacher_head, vocab_size=8)  # type: ignore[call-arg]
cached_indices = torch.randint(0, V, (B, T, 4))
assert_type(
    vocab_parallel_fused_linear_distillation_from_top_k(
        hidden, lm_head, cached_indices, torch.randn(B, T, 4), labels, group=None, hard_weight=0.1
    ),
    Tensor,
)
# the LightningModule: a smaller TinyGPT trained on a frozen one (docs/distill.md)
distill_lm = DistillationModule(
    student=TinyGPT(vocab_size=8192, d_model=64, n_layers=1),
    teacher_checkpoint="lightning_logs/default/tinygpt/checkpoints/last.ckpt",
    divergence="forward_kl",
    temperature=2.0,
    temperature_squared=True,
    hard_weight=0.1,
)
assert_type(distill_lm, DistillationModule)
assert_type(distill_lm.loss_weights, tuple[float, float])
DistillationModule(student=tiny, teacher=tiny, divergence="kl")  # type: ignore[arg-type]
offline_lm = DistillationModule(student=tiny, cached_teacher=True)  # batches carry the teacher's top k
assert_type(offline_lm.teacher, Optional[nn.Module])
# a teacher's top k per token (what the cache above holds), from its head or from the model
top = fused_linear_top_k(teacher_hidden, teacher_head, 20, target=labels, softcap=30.0, log_probs=False)
assert_type(top, TopKOutput)
assert_type(top.values, Tensor)
assert_type(top.indices, Tensor)
fused_linear_top_k(teacher_hidden, teacher_head, k=2.5)  # type: ignore[arg-type]
assert_type(teacher_top_k(tiny, labels, 8, attention_mask=torch.ones_like(labels)), TopKOutput)
# a tensor-parallel teacher's head (its rows of the vocabulary on this rank)
assert_type(
    vocab_parallel_fused_linear_top_k(teacher_hidden, teacher_head, 20, target=labels, group=None), TopKOutput
)
vocab_parallel_fused_linear_top_k(teacher_hidden, teacher_head, 20, log_probs="yes")  # type: ignore[arg-type]
assert_type(VocabParallelHead(H, V).top_k(teacher_hidden, 20), TopKOutput)
cache_lm = TeacherTopKModule(tiny, k=20, values_dtype="float16")
assert_type(cache_lm, TeacherTopKModule)
TeacherTopKModule(tiny, k=20, logits_precision="fp64")  # type: ignore[arg-type]
cache_writer = TopKCacheWriter("teacher_top_20", overwrite=True)
cache = TopKCacheDataset("teacher_top_20")
assert_type(cache[0], dict[str, Tensor])
DataLoader(cache, batch_size=4)
