"""The analytic FLOP count of the bundled models against torch.utils.flop_counter on tiny models (CPU), and its
wiring into Lightning's ThroughputMonitor."""

import importlib.util
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from lightning_flce import fused_linear_cross_entropy
from lightning_flce.flops import batch_size, batch_tokens, decoder_flops
from lightning_flce.models import HFCausalLM, TinyGPT

_HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# The count leaves out what the counter does not count either (norms, activations, softmax) and what it does
# count but is negligible here: Llama's rotary-embedding product (B·T·head_dim FLOPs). Exact otherwise.
REL_TOL = 1e-3


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [True, False])
def test_tinygpt_count_matches_the_flop_counter(tied):
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=96, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tied)
    input_ids = torch.randint(0, 96, (3, 16))
    labels = torch.randint(0, 96, (3, 16))

    def train_step():
        # the fused loss (its custom op's registered formula: 6·N·H·V with both gradients)
        hidden = model.hidden_states(input_ids)
        fused_linear_cross_entropy(hidden, model.lm_head.weight, labels).backward()

    def plain_train_step():
        F.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten()).backward()

    # the math backend: its products are plain bmm's, counted on every build (the CPU flash kernel may not be)
    with sdpa_kernel(SDPBackend.MATH):
        fused, plain = _counted(train_step), _counted(plain_train_step)
        with torch.no_grad():
            forward = _counted(lambda: model(input_ids))
    assert fused == plain
    assert math.isclose(model.estimate_flops(3, 16), fused, rel_tol=REL_TOL)
    assert math.isclose(model.estimate_flops(3, 16, training=False), forward, rel_tol=REL_TOL)
    # 1.5M-parameter default config: the head's 6·N·H·V is most of it
    default = TinyGPT()
    head = 6 * 16 * 128 * 128 * 8192
    assert head < default.estimate_flops(16, 128) < 2 * head


@pytest.mark.skipif(not _HAS_TRANSFORMERS, reason="needs transformers")
@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_count_matches_the_flop_counter(tied):
    # Lightning's measure_flops on the meta device fails for Hugging Face models (.item() in the masking code):
    # the counter runs on real tiny tensors here.
    torch.manual_seed(0)
    config = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": tied,
    }
    model = HFCausalLM(config=config, model_kwargs={"attn_implementation": "eager"})
    input_ids = torch.randint(0, 128, (2, 24))

    def train_step():
        model.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()

    counted = _counted(train_step)
    assert counted > 0
    assert math.isclose(model.estimate_flops(2, 24), counted, rel_tol=REL_TOL)
    with torch.no_grad():
        forward = _counted(lambda: model(input_ids))
    assert math.isclose(model.estimate_flops(2, 24, training=False), forward, rel_tol=REL_TOL)


@pytest.mark.skipif(not _HAS_TRANSFORMERS, reason="needs transformers")
def test_hf_mixture_of_experts_is_refused():
    config = {
        "model_type": "mixtral",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    with pytest.raises(NotImplementedError, match="experts"):
        HFCausalLM(config=config).estimate_flops(1, 8)


def test_decoder_flops_formula():
    forward = decoder_flops(
        batch_size=2, seq_len=8, linear_params=100, n_layers=3, attention_width=4, training=False
    )
    assert forward == 2 * 16 * 100 + 4 * 3 * 2 * 64 * 4
    assert (
        decoder_flops(batch_size=2, seq_len=8, linear_params=100, n_layers=3, attention_width=4)
        == 3 * forward
    )


class _Recorder(pl.Callback):
    def __init__(self):
        self.flops = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.flops.append(("train", pl_module.flops_per_batch))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.flops.append(("val", pl_module.flops_per_batch))


def test_throughput_monitor_gets_flops_per_batch(tmp_path):
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, warmup_steps=0)
    model.setup = lambda stage: None  # no data module to check the label format against
    tokens = torch.randint(0, 64, (8, 9))
    data = DataLoader([{"input_ids": t[:-1], "labels": t[1:]} for t in tokens], batch_size=4)
    assert model.flops_per_batch is None  # before any batch
    recorder = _Recorder()
    # window_size: batches averaged over; flops_per_sec appears once the window is full
    monitor = ThroughputMonitor(batch_size_fn=batch_size, length_fn=batch_tokens, window_size=2)
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[monitor, recorder],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data, data)
    train, evaluation = model.estimate_flops(4, 8), model.estimate_flops(4, 8, training=False)
    assert recorder.flops == [("train", train)] * 2 + [("val", evaluation)] * 2
    import csv

    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    rates = [float(r["train/device/flops_per_sec"]) for r in rows if r.get("train/device/flops_per_sec")]
    assert rates and all(rate > 0 for rate in rates)
    # an assigned number wins over the estimate
    model.flops_per_batch = 123
    assert model.flops_per_batch == 123
