"""``FLCEHeadLoss`` under Lightning Fabric (``docs/fabric.md``, ``examples/fabric_train.py``), on the CPU.

The fused loss and its gradients (dX, dW) through a module set up by ``Fabric(precision=...)`` are compared with
the plain loss computed the same way (``F.cross_entropy(F.linear(hidden, W).float(), labels)`` in the same
module's forward, so under the same precision), both measured against a float64 reference: the fused error must
be no worse than the plain one's times a small factor. Under ``bf16-mixed`` both errors are dominated by the
same bf16 rounding of the GEMM operands and logits (~1e-3 relative for the gradients), so the factor is the
check; under ``32-true`` both are at fp32 rounding level, where a floor of a few fp32 ulps of the value keeps a
lucky plain result from failing a fused one that is as accurate.

The documented precision behaviour is tested too: the loss follows Fabric's precision inside the forward of a
module that ``fabric.setup`` wrapped or inside ``fabric.autocast()``, and outside both it runs in the inputs'
dtype (fp32 under ``bf16-mixed``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from ranks import end_worker, free_port, run_ranks, torchrun_env
from torch import nn

from lightning_flce import FLCEHeadLoss
from lightning_flce._compat import TORCH_VERSION

ROOT = Path(__file__).resolve().parents[1]
N, H, V = 192, 48, 700  # tokens, hidden size, vocabulary
CHUNK = 64  # several chunks, so the fused dW accumulates over chunks
FP32_EPS = torch.finfo(torch.float32).eps
# the fused error may be this many times the plain one's (same operands and roundings; ~1.1x measured for dW,
# whose plain reference rounds each logit gradient to bf16 once more)
FACTOR = 2.0
# plain fp32 (its error ~3e-7 relative) and bf16 (~4e-3 relative for the gradients: the bf16 operands'
# rounding, 2^-9, grown over the H and V sums) against float64: a bound for each alone
TO_FLOAT64 = {"32-true": 1e-5, "bf16-mixed": 2e-2, "bf16-true": 2e-2}


class HeadModel(nn.Module):
    """An LM head whose forward computes the loss of given hidden states, fused or plain."""

    def __init__(self, weight: torch.Tensor, *, naive: bool, tied: bool = False) -> None:
        super().__init__()
        # a tied head is the embedding module itself, used as the output matrix
        self.lm_head = nn.Embedding(V, H) if tied else nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        self.head_loss = FLCEHeadLoss(chunk_size=CHUNK)
        self.naive = naive

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.naive:
            return F.cross_entropy(F.linear(hidden, self.lm_head.weight).float(), labels)
        return self.head_loss(self.lm_head, hidden, labels)


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator)
    weight = torch.randn(V, H, generator=generator) * 0.3  # logits of std ~2
    labels = torch.randint(0, V, (N,), generator=generator)
    labels[::7] = -100  # some ignored tokens
    return hidden, weight, labels


def _through_fabric(
    precision: str, *, naive: bool, tied: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    hidden, weight, labels = _problem(seed)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    model = fabric.setup_module(HeadModel(weight, naive=naive, tied=tied))
    hidden = hidden.requires_grad_()
    loss = model(hidden, labels)
    fabric.backward(loss)
    return {"loss": loss.detach(), "dX": hidden.grad, "dW": model.lm_head.weight.grad}


def _float64_reference(seed: int = 0) -> dict[str, torch.Tensor]:
    hidden, weight, labels = _problem(seed)
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    loss = F.cross_entropy(F.linear(hidden, weight), labels)
    loss.backward()
    return {"loss": loss.detach(), "dX": hidden.grad, "dW": weight.grad}


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("tied", [False, True], ids=["linear_head", "tied_embedding_head"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_fused_loss_and_gradients_match_the_plain_loss_under_fabric(precision, tied):
    fused = _through_fabric(precision, naive=False, tied=tied)
    plain = _through_fabric(precision, naive=True, tied=tied)
    reference = _float64_reference()
    for name in ("loss", "dX", "dW"):
        # Fabric returns fp32 outputs; dX of the fp32 input; dW in the parameters' dtype (bf16 under bf16-true)
        expected_dtype = torch.bfloat16 if name == "dW" and precision == "bf16-true" else torch.float32
        assert fused[name].dtype == plain[name].dtype == expected_dtype, name
        fused_error = _relative_error(fused[name], reference[name])
        plain_error = _relative_error(plain[name], reference[name])
        assert plain_error < TO_FLOAT64[precision], (name, plain_error)
        assert fused_error <= FACTOR * plain_error + 4 * FP32_EPS, (name, fused_error, plain_error)


def test_bf16_mixed_runs_the_head_in_bf16():
    """Under ``bf16-mixed`` the GEMMs run in bf16: the loss's error to float64 is bf16's, not fp32's."""
    bf16 = _through_fabric("bf16-mixed", naive=False)
    fp32 = _through_fabric("32-true", naive=False)
    reference = _float64_reference()
    for name in ("dX", "dW"):
        # bf16 operands (2^-9 relative rounding) against fp32's ~3e-7: three orders of magnitude apart
        assert _relative_error(bf16[name], reference[name]) > 100 * _relative_error(
            fp32[name], reference[name]
        )


def test_the_loss_follows_fabric_precision_in_forward_and_autocast_only():
    """``docs/fabric.md``'s statement: inside the forward of a module that ``fabric.setup`` wrapped, or inside
    ``fabric.autocast()``, the loss runs in Fabric's precision (bf16 GEMMs); outside both it runs in the
    inputs' dtype (fp32 here), like any op outside autocast."""
    hidden, weight, labels = _problem()
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = fabric.setup_module(HeadModel(weight, naive=False))
    in_forward = model(hidden, labels)
    with fabric.autocast():
        in_autocast = model.head_loss(model.lm_head, hidden, labels)
    outside = model.head_loss(model.lm_head, hidden, labels)
    plain_bf16 = _through_fabric("bf16-mixed", naive=True)["loss"]
    plain_fp32 = F.cross_entropy(F.linear(hidden, weight), labels)
    reference = _float64_reference()["loss"]

    torch.testing.assert_close(in_autocast, in_forward, rtol=0, atol=0)  # the same op on the same operands
    assert abs(in_forward - plain_bf16) <= 4 * FP32_EPS * abs(reference)  # bf16 GEMM, like the plain loss's
    # outside: fp32, within fp32 rounding of the plain fp32 loss and nowhere near the bf16 one
    assert abs(outside - plain_fp32) <= 8 * FP32_EPS * abs(reference)
    assert abs(plain_bf16 - plain_fp32) > 100 * abs(outside - plain_fp32)


def test_bf16_true_outside_forward_is_refused_not_silent():
    """Under ``bf16-true`` the parameters are bf16 and Fabric returns forward's outputs in fp32: a loss computed
    on them outside forward mixes dtypes, which the op refuses (``fabric.autocast()`` sets the default dtype
    there, no autocast, so it does not help); inside forward it runs in bf16 (the test above)."""
    hidden, weight, labels = _problem()
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    model = fabric.setup_module(HeadModel(weight, naive=False))
    assert model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="differs from input dtype torch.float32 outside autocast"):
        model.head_loss(model.lm_head, hidden, labels)
    with pytest.raises(TypeError, match="outside autocast"), fabric.autocast():
        model.head_loss(model.lm_head, hidden, labels)


def _load_example():
    spec = importlib.util.spec_from_file_location("fabric_train", ROOT / "examples" / "fabric_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step_problem(example, micro_batch_count: int = 2, tied: bool = True):
    """Micro-batches of unequal labelled-token counts and the model their optimizer step trains."""
    generator = torch.Generator().manual_seed(0)
    micro_batches = [example.counting_batch(4, 16, 64, generator) for _ in range(micro_batch_count)]
    counts = [int((batch["labels"] != example.IGNORE_INDEX).sum()) for batch in micro_batches]
    assert len(set(counts)) > 1  # the tests mean something only with unequal counts
    torch.manual_seed(0)
    model = example.TinyLM(vocab_size=64, d_model=32, n_layers=1)
    if not tied:
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach() * 0.5)
    return micro_batches, model


def _float64_step(example, model, micro_batches):
    """The float64 mean loss over all the micro-batches' labelled tokens as one batch, and its gradients."""
    model = model.double()
    whole = {key: torch.cat([batch[key] for batch in micro_batches]) for key in micro_batches[0]}
    loss = model(whole["input_ids"], whole["labels"]) / (whole["labels"] != example.IGNORE_INDEX).sum()
    names = [name for name, _ in model.named_parameters()]
    return loss.detach(), dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


def _fabric_step(example, fabric, model, micro_batches):
    """``train_step`` on ``micro_batches``; returns its loss and the full gradients it left (not zeroed)."""
    # lr=0 and no zero_grad: the step's gradients stay readable and the weights unchanged
    fabric_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    optimizer.zero_grad = lambda *args, **kwargs: None
    loss = example.train_step(fabric, fabric_model, optimizer, micro_batches)
    full = lambda grad: grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # noqa: E731 (DTensor)
    return loss, {name: full(p.grad) for name, p in model.named_parameters()}


def _check_step(loss, grads, reference_loss, reference_grads):
    # fp32 against float64: ~3e-7 relative measured, the sums over a few hundred tokens and 64 classes
    assert abs(loss.item() - reference_loss.item()) <= 1e-5 * abs(reference_loss.item())
    assert grads.keys() == reference_grads.keys()
    for name, reference in reference_grads.items():
        assert _relative_error(grads[name], reference) < 1e-5, name


def test_train_step_normalizes_per_token_over_the_micro_batches():
    """Two micro-batches with different labelled-token counts give the gradient of the mean over all of the
    step's tokens, as one batch of both would (not the mean of the two micro-batch means)."""
    example = _load_example()
    micro_batches, model = _step_problem(example)
    reference = _float64_step(example, _step_problem(example)[1], micro_batches)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    _check_step(*_fabric_step(example, fabric, model, micro_batches), *reference)


FSDP_SCENARIOS = ("tied", "untied")


def fsdp_worker(out_dir: str) -> None:
    """A rank of the FSDP2 test: Fabric's ``ModelParallelStrategy`` on 2 CPU processes (gloo), each rank
    stepping on its half of 4 micro-batches; saves each scenario's loss and full gradients."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_flce.fsdp import fully_shard_lm

    torch.set_num_threads(1)
    example = _load_example()
    rank = int(os.environ["RANK"])
    results = {}
    for scenario in FSDP_SCENARIOS:
        micro_batches, model = _step_problem(example, micro_batch_count=4, tied=scenario == "tied")
        head = None if scenario == "tied" else model.lm_head  # a tied head stays in the root unit

        def shard(module, mesh, head=head):
            return fully_shard_lm(module, mesh["data_parallel"], blocks=module.layers, head=head)

        strategy = ModelParallelStrategy(
            shard, data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
        )
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        loss, grads = _fabric_step(example, fabric, model, micro_batches[2 * rank : 2 * rank + 2])
        results[scenario] = {"loss": loss, "grads": grads}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.skipif(TORCH_VERSION < (2, 6), reason="FSDP2 on the CPU needs a newer torch")
def test_fsdp2_under_fabric_equals_one_process_on_the_global_batch(tmp_path):
    """``docs/fabric.md``'s FSDP recipe: the loss in the model's forward, blocks and an untied head sharded as
    their own units (a tied head in the root's), the step normalized per token over both ranks' micro-batches:
    every rank's loss and full gradients equal one float64 process's on the global batch."""
    port = free_port()
    results = run_ranks(
        2,
        lambda rank: [__file__, tmp_path],
        tmp_path,
        150,
        env=lambda rank: torchrun_env(rank, 2, port, OMP_NUM_THREADS="1"),
        cwd=tmp_path,
        label="fabric fsdp2",
    )
    example = _load_example()
    for scenario in FSDP_SCENARIOS:
        micro_batches, model = _step_problem(example, micro_batch_count=4, tied=scenario == "tied")
        reference = _float64_step(example, model, micro_batches)
        for result in results:
            _check_step(result[scenario]["loss"], result[scenario]["grads"], *reference)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_example_main_trains(precision, capsys):
    losses = _load_example().main(["--precision", precision, "--steps", "4", "--log-every", "2"])
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    printed = re.findall(r"step +(\d+) +loss ([0-9.]+)", capsys.readouterr().out)
    assert [int(step) for step, _ in printed] == [2, 4]
    assert float(printed[-1][1]) == pytest.approx(losses[-1], abs=1e-4)


if __name__ == "__main__":
    fsdp_worker(sys.argv[1])
    end_worker()
