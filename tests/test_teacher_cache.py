"""A teacher's top-k cache made and read through Lightning: :func:`teacher_top_k` on TinyGPT and Hugging Face
teachers (their logit scale and softcap applied) against the models' own logits in float64;
:class:`TeacherTopKModule` under ``trainer.predict`` with :class:`TopKCacheWriter`, read back by
:class:`TopKCacheDataset`, trains ``DistillationModule(cached_teacher=True)`` to the live teacher's ``top_k=k``
loss and gradients (float64); the writer's and the dataset's refusals; DDP on two gloo ranks writing one cache.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_distill_lightning import TOL, make_batch, student_grads, tiny_student, tiny_teacher, trainer
from torch.utils.data import DataLoader

from lightning_flce import (
    DistillationModule,
    TeacherTopKModule,
    TopKCacheDataModule,
    TopKCacheDataset,
    TopKCacheWriter,
    fused_linear_distillation_from_top_k,
    teacher_top_k,
)
from lightning_flce.data.top_k_cache import collate_top_k

K = 6


def expected_top_k(logits: torch.Tensor, k: int = K):
    """The float64 top k of the model's own logits: log-probabilities and columns."""
    return logits.double().log_softmax(-1).topk(k, dim=-1)


def test_teacher_top_k_of_a_tinygpt_equals_its_logits_and_skips_padding():
    teacher = tiny_teacher().double().eval()
    batch = make_batch(3)
    mask = torch.ones_like(batch["input_ids"])
    mask[1, 7:] = 0
    top = teacher_top_k(teacher, batch["input_ids"], K, attention_mask=mask)
    with torch.no_grad():
        want = expected_top_k(teacher(batch["input_ids"]))
    keep = mask.bool()
    torch.testing.assert_close(top.values[keep], want.values[keep], rtol=0, atol=1e-12)
    assert torch.equal(top.indices[keep], want.indices[keep])
    assert torch.isneginf(top.values[~keep]).all()
    logits = teacher_top_k(teacher, batch["input_ids"], K, log_probs=False)
    torch.testing.assert_close(logits.values, teacher(batch["input_ids"]).detach().topk(K, -1).values, **TOL)


@pytest.mark.parametrize("variant", ["llama_tied", "gemma2_softcap", "cohere_logit_scale"])
def test_teacher_top_k_of_hf_models_applies_their_logit_transforms(variant):
    """An HFCausalLM's softcap (Gemma 2) or logit scale (Cohere) is in the cached values, as in its own logits."""
    from test_hf import make_batch as hf_batch
    from test_hf import tiny_hf

    model = tiny_hf(variant).double().eval()
    batch = hf_batch()
    top = teacher_top_k(model, batch["input_ids"], K, attention_mask=batch["attention_mask"])
    with torch.no_grad():
        want = expected_top_k(model(batch["input_ids"], batch["attention_mask"]))
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(top.values[keep], want.values[keep], rtol=0, atol=1e-10)
    assert torch.equal(top.indices[keep], want.indices[keep])


def write_cache(tmp_path: Path, teacher, batches, **writer_options) -> Path:
    cache = tmp_path / "cache"
    run = trainer(callbacks=[TopKCacheWriter(str(cache), **writer_options)], precision="64-true")
    run.predict(
        TeacherTopKModule(teacher, k=K), DataLoader(batches, batch_size=None), return_predictions=False
    )
    return cache


def test_cache_round_trip_trains_as_the_live_teacher_in_float64(tmp_path):
    """trainer.predict writes one file a batch; the dataset gives back each sequence; a batch of the cache gives
    the loss and student gradients of the live teacher with top_k = K (float64)."""
    teacher = tiny_teacher().double()
    batches = [make_batch(seed, n_ignored=3) for seed in range(3)]
    cache = write_cache(tmp_path, teacher, batches)
    assert sorted(p.name for p in cache.iterdir()) == [f"part-r00000-d000-b{i:09d}.pt" for i in range(3)]
    dataset = TopKCacheDataset(str(cache))
    assert len(dataset) == 6
    item = dataset[3]
    assert set(item) == {"input_ids", "labels", "teacher_top_k_indices", "teacher_top_k_logits"}
    assert (
        item["teacher_top_k_indices"].dtype == torch.int32
        and item["teacher_top_k_logits"].dtype == torch.float32
    )
    assert torch.equal(item["input_ids"], batches[1]["input_ids"][1])

    options = {"divergence": "jsd", "beta": 0.3, "hard_weight": 0.25, "temperature": 0.7}
    live = DistillationModule(student=tiny_student(), teacher=teacher, top_k=K, **options).double()
    cached = DistillationModule(student=tiny_student(), cached_teacher=True, **options).double()
    cached_batch = next(iter(DataLoader(dataset, batch_size=2)))
    assert torch.equal(cached_batch["input_ids"], batches[0]["input_ids"])
    results = []
    for module, batch in ((live, batches[0]), (cached, cached_batch)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer
            loss = module.training_step(batch, 0)
        loss.backward()
        results.append((loss.detach(), student_grads(module)))
    # the cache's fp32 log-probabilities: within fp32's rounding of the live float64 teacher's
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-5, atol=1e-9, msg=name)


def test_items_of_different_lengths_are_padded_and_the_padding_carries_no_loss(tmp_path):
    """A cache of batches of different lengths: ``collate_top_k`` right-pads each key (input ids 0, labels -100, an
    attention mask of 0, columns 0, values -inf); the summed loss of a padded batch equals the two sequences' own
    (float64; the student is causal, so right padding changes no earlier position); ``TopKCacheDataModule`` trains
    on such batches."""
    teacher = tiny_teacher().double()
    short = {key: value[:, :7] for key, value in make_batch(0).items()}
    cache = write_cache(tmp_path, teacher, [short, make_batch(1, n_ignored=4)])
    dataset = TopKCacheDataset(str(cache))
    assert [len(item["input_ids"]) for item in dataset] == [7, 7, 12, 12]
    batch = collate_top_k([dataset[0], dataset[2]])
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 12)
    assert batch["attention_mask"][0].tolist() == [1] * 7 + [0] * 5 and bool(batch["attention_mask"][1].all())
    assert (batch["labels"][0, 7:] == -100).all() and (batch["input_ids"][0, 7:] == 0).all()
    assert (
        torch.isneginf(batch["teacher_top_k_logits"][0, 7:]).all()
        and (batch["teacher_top_k_indices"][0, 7:] == 0).all()
    )

    student = tiny_student().double()

    def summed_loss(batch: dict) -> torch.Tensor:
        mask = batch.get("attention_mask")
        target = batch["labels"] if mask is None else batch["labels"].masked_fill(mask == 0, -100)
        return fused_linear_distillation_from_top_k(
            student.hidden_states(batch["input_ids"]),
            student.lm_head.weight,
            batch["teacher_top_k_indices"],
            batch["teacher_top_k_logits"],
            target,
            divergence="jsd",
            hard_weight=0.3,
            reduction="sum",
        )

    alone = summed_loss(collate_top_k([dataset[0]])) + summed_loss(collate_top_k([dataset[2]]))
    torch.testing.assert_close(summed_loss(batch), alone, **TOL)

    datamodule = TopKCacheDataModule(str(cache), batch_size=3, val_dataloader_idx=None)
    module = DistillationModule(student=tiny_student(), cached_teacher=True)
    fit = trainer(max_steps=2, precision="64-true")
    fit.fit(module, datamodule=datamodule)
    assert fit.global_step == 2 and math.isfinite(float(fit.callback_metrics["train/loss"]))


def test_float64_values_and_a_teacher_checkpoint(tmp_path):
    """``values_dtype="float64"`` keeps the float64 teacher's values exactly; a teacher given as a checkpoint."""
    teacher = tiny_teacher()
    run = trainer(max_steps=0, default_root_dir=tmp_path)
    run.strategy.connect(teacher)
    path = tmp_path / "teacher.ckpt"
    run.save_checkpoint(path)
    module = TeacherTopKModule(teacher_checkpoint=str(path), k=3, values_dtype="float64", log_probs=False)
    batch = make_batch(1)
    record = module.predict_step(batch, 0)
    with torch.no_grad():
        want = teacher(batch["input_ids"]).topk(3, -1)
    assert record["teacher_top_k_logits"].dtype == torch.float64
    torch.testing.assert_close(record["teacher_top_k_logits"], want.values.double(), rtol=1e-6, atol=1e-6)
    assert not any(p.requires_grad for p in module.teacher.parameters()) and not module.teacher.training


def test_writer_and_dataset_refuse_what_they_cannot_use(tmp_path):
    teacher = tiny_teacher().double()
    cache = write_cache(tmp_path, teacher, [make_batch(0)])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_cache(tmp_path, teacher, [make_batch(1)])
    write_cache(tmp_path, teacher, [make_batch(1), make_batch(2)], overwrite=True)
    assert len(TopKCacheDataset(str(cache))) == 4
    with pytest.raises(FileNotFoundError, match="no top-k cache files"):
        TopKCacheDataset(str(tmp_path))
    torch.save({"input_ids": torch.zeros(2, 3)}, cache / "part-r00009-d000-b000000000.pt")
    with pytest.raises(ValueError, match="no \\['teacher_top_k_indices'"):
        TopKCacheDataset(str(cache))

    class Plain(pl.LightningModule):
        def predict_step(self, batch, batch_idx):
            return [batch["input_ids"]]

    run = trainer(callbacks=[TopKCacheWriter(str(tmp_path / "other"))])
    with pytest.raises(TypeError, match="dict of tensors"):
        run.predict(Plain(), DataLoader([make_batch(0)], batch_size=None))
    with pytest.raises(ValueError, match="one of teacher and teacher_checkpoint"):
        TeacherTopKModule()
    with pytest.raises(ValueError, match="k must be a positive int"):
        TeacherTopKModule(teacher, k=0)
    with pytest.raises(ValueError, match="values_dtype must name a floating-point"):
        TeacherTopKModule(teacher, values_dtype="int32")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_on_cuda_equals_the_teachers_logits(tmp_path, dtype):
    """On a GPU (the Triton backend): a TinyGPT teacher's top k through ``trainer.predict`` in ``dtype`` against its
    own logits: fp32 against the float64 model on the CPU, within 1e-4; bf16 against the same bf16 model's logits on
    the GPU (the same hidden states) upcast, within their rounding (2^-7 of the largest, as tests/test_top_k.py);
    each value at its own column; and the cache trains a student on the GPU."""
    teacher = tiny_teacher().to(dtype)
    batches = [make_batch(seed, n_ignored=3) for seed in range(2)]
    cache = tmp_path / "cache"
    run = trainer(accelerator="gpu", callbacks=[TopKCacheWriter(str(cache))])
    run.predict(
        TeacherTopKModule(teacher, k=K), DataLoader(batches, batch_size=None), return_predictions=False
    )
    reference = copy.deepcopy(teacher).eval()
    reference = reference.double() if dtype == torch.float32 else reference.cuda()
    device = next(reference.parameters()).device
    dataset = TopKCacheDataset(str(cache))
    for item in dataset:
        with torch.no_grad():
            logits = reference(item["input_ids"][None].to(device))[0].double().cpu()
        log_probs = logits.log_softmax(-1)
        atol = 1e-4 if dtype == torch.float32 else 2.0**-7 * logits.abs().max().item()
        values = item["teacher_top_k_logits"].double()
        torch.testing.assert_close(values, log_probs.topk(K, -1).values, rtol=0, atol=atol)
        torch.testing.assert_close(
            values, log_probs.gather(-1, item["teacher_top_k_indices"].long()), rtol=0, atol=atol
        )
    module = DistillationModule(student=tiny_student(), cached_teacher=True, hard_weight=0.2)
    fit = trainer(accelerator="gpu", max_steps=2)
    fit.fit(module, DataLoader(dataset, batch_size=2))
    assert fit.global_step == 2 and math.isfinite(float(fit.callback_metrics["train/loss"]))


# ------------------------------------------------------------------ the `teacher_cache` and `distill_cached` configs
def test_cache_configs_write_the_cache_and_distill_from_it(tmp_path, monkeypatch, caplog):
    """`predict --config teacher_cache` writes the training split (dataloader 0) and the validation split (1) of a
    tiny teacher's top 32; `fit --config distill_cached` trains on the first and validates on the second."""
    from test_distill_lightning import save_module_checkpoint

    from lightning_flce.cli import main
    from lightning_flce.data import PythonStdlibDataModule

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-flce"])
    data_args = {"cache_dir": str(tmp_path / "tokens"), "vocab_size": 512, "max_chars": 300000, "seq_len": 32}
    datamodule = PythonStdlibDataModule(**data_args, batch_size=4)
    vocab_size = datamodule.vocab_size  # the tokenizer's real size
    datamodule.setup("predict")
    splits = (len(datamodule.train_dataset), len(datamodule.val_dataset))
    teacher_path = save_module_checkpoint(
        tiny_teacher(vocab_size=vocab_size, max_seq_len=32), tmp_path / "t.ckpt"
    )
    main(
        [
            "predict",
            "--config",
            "teacher_cache",
            *(f"--data.init_args.{name}={value}" for name, value in data_args.items()),
            "--data.init_args.batch_size=4",
            f"--model.init_args.teacher_checkpoint={teacher_path}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    cache = tmp_path / "lightning_logs/teacher_cache/top_32"
    train, val = TopKCacheDataset(str(cache), 0), TopKCacheDataset(str(cache), 1)
    assert (len(train), len(val)) == splits
    assert train[0]["teacher_top_k_logits"].shape == (32, 32)
    torch.testing.assert_close(train[0]["input_ids"], datamodule.train_dataset[0]["input_ids"])
    main(
        [
            "fit",
            "--config",
            "distill_cached",
            "--data.init_args.batch_size=4",
            f"--model.init_args.student.init_args.vocab_size={vocab_size}",
            "--model.init_args.student.init_args.d_model=16",
            "--model.init_args.student.init_args.max_seq_len=32",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
        ]
    )
    rows = (tmp_path / "lightning_logs/distill_cached/distill_cached/version_0/metrics.csv").read_text()
    assert {"train/loss_step", "val/loss", "val/divergence", "val/student_ce"} <= set(
        rows.splitlines()[0].split(",")
    )
    assert "Distillation val (epoch 0, step 3): loss" in caplog.text


# ------------------------------------------------------------------ DDP (2 gloo ranks)
def run_ddp(out_dir: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    teacher = tiny_teacher().double()
    run = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        precision="64-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TopKCacheWriter(out_dir)],
    )
    sequences = [
        {key: value[i] for key, value in make_batch(seed).items()} for seed in range(3) for i in range(2)
    ]
    run.predict(
        TeacherTopKModule(teacher, k=K), DataLoader(sequences, batch_size=2), return_predictions=False
    )


def test_ddp_two_ranks_write_one_cache_of_every_sequence(tmp_path):
    """Each rank writes the batches of its share; the cache holds every sequence once (6 over 2 ranks: no
    padding), each with the single-process teacher's top k."""
    out = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, __file__, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert {name.split("-")[1] for name in names} == {"r00000", "r00001"}
    dataset = TopKCacheDataset(str(out))
    assert len(dataset) == 6
    teacher = tiny_teacher().double()
    seen = set()
    for item in dataset:
        seen.add(tuple(item["input_ids"].tolist()))
        with torch.no_grad():
            want = expected_top_k(teacher(item["input_ids"][None]))
        torch.testing.assert_close(item["teacher_top_k_logits"].double(), want.values[0].float().double())
        assert torch.equal(item["teacher_top_k_indices"].long(), want.indices[0])
    assert len(seen) == 6


if __name__ == "__main__":
    run_ddp(sys.argv[1])
