"""PythonStdlibDataModule: corpus discovery, local BPE, file-level split, label formats, disk cache."""

import pytest
import torch

import lightning_flce.data.stdlib as stdlib_module
from lightning_flce.data import PythonStdlibDataModule, TokenBlockDataset
from lightning_flce.data.corpus import EOS_TOKEN, find_source_files, read_texts, stdlib_root

# Small enough to tokenize in a fraction of a second, large enough for a 512-token BPE and a few val blocks.
SMALL = {"vocab_size": 512, "max_chars": 200_000, "seq_len": 32, "batch_size": 4}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flce_cache")


@pytest.fixture(scope="module")
def datamodule(cache_dir):
    dm = PythonStdlibDataModule(**SMALL, cache_dir=str(cache_dir))
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_find_source_files_in_stdlib():
    files = find_source_files()
    root = stdlib_root()
    relative = [f.relative_to(root).as_posix() for f in files]
    assert "os.py" in relative
    assert "json/decoder.py" in relative
    assert relative == sorted(relative)
    assert all(f.suffix == ".py" for f in files)
    assert not any(
        part in ("site-packages", "test", "tests") for f in files for part in f.relative_to(root).parts
    )


def test_find_source_files_skips_and_orders(tmp_path):
    for name in [
        "b.py",
        "a/z.py",
        "a/b.py",
        "notes.txt",
        "site-packages/pkg/mod.py",
        "encodings/cp1252.py",
        "pkg/tests/test_x.py",
        "test/test_y.py",
    ]:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n")
    found = [f.relative_to(tmp_path).as_posix() for f in find_source_files(tmp_path)]
    assert found == ["a/b.py", "a/z.py", "b.py"]
    with_tests = [f.relative_to(tmp_path).as_posix() for f in find_source_files(tmp_path, include_tests=True)]
    assert with_tests == ["a/b.py", "a/z.py", "b.py", "pkg/tests/test_x.py", "test/test_y.py"]


def test_find_source_files_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        find_source_files(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="No \\*.py files"):
        find_source_files(tmp_path)


def test_read_texts_caps_characters(tmp_path):
    files = []
    for i, text in enumerate(["aaaa", "", "bbbbbb", "cccc"]):
        files.append(tmp_path / f"{i}.py")
        files[-1].write_text(text)
    assert read_texts(files, 7) == ["aaaa", "bbb"]
    assert read_texts(files, 100) == ["aaaa", "bbbbbb", "cccc"]
    with pytest.raises(ValueError, match="max_chars"):
        read_texts(files, 0)


def test_tokenizer_vocab_and_roundtrip(datamodule):
    # The requested size is reached on this corpus, and the linked attribute is the tokenizer's real size.
    assert datamodule.vocab_size == SMALL["vocab_size"] == datamodule.tokenizer.get_vocab_size()
    assert datamodule.eos_token_id == datamodule.tokenizer.token_to_id(EOS_TOKEN) == 0
    # Byte-level BPE: any text, including characters never seen in training, decodes back unchanged.
    text = "def f(x):\n    return x ** 2  # ünïcode ✓ 日本\n"
    assert datamodule.tokenizer.decode(datamodule.tokenizer.encode(text).ids) == text


def test_splits_are_disjoint_by_file(datamodule):
    all_files = find_source_files()
    train_files, val_files = datamodule.split_files()
    assert set(train_files).isdisjoint(val_files)
    assert sorted(train_files + val_files) == sorted(all_files)
    assert val_files == all_files[datamodule.val_every - 1 :: datamodule.val_every]

    # The token streams hold exactly the files of their split, each followed by end-of-text.
    def stream(texts):
        eos = [datamodule.eos_token_id]
        return [i for t in texts for i in datamodule.tokenizer.encode(t).ids + eos]

    train_texts, val_texts = datamodule._read_split()
    assert datamodule.train_dataset.tokens.tolist() == stream(train_texts)
    assert datamodule.val_dataset.tokens.tolist() == stream(val_texts)
    assert val_texts[0] == val_files[0].read_text(encoding="utf-8", errors="replace")
    assert sum(map(len, train_texts + val_texts)) == SMALL["max_chars"]


@pytest.mark.parametrize("label_format", ["shifted", "hf"])
def test_batches_match_token_stream(cache_dir, label_format):
    dm = PythonStdlibDataModule(**SMALL, label_format=label_format, cache_dir=str(cache_dir))
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    batch_size, seq_len = SMALL["batch_size"], SMALL["seq_len"]
    tokens = dm.val_dataset.tokens.long()
    # Unshuffled validation blocks are consecutive windows of the stream.
    expected_inputs = torch.stack([tokens[i * seq_len : (i + 1) * seq_len] for i in range(batch_size)])
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    torch.testing.assert_close(batch["input_ids"], expected_inputs, rtol=0, atol=0)
    if label_format == "shifted":
        assert set(batch) == {"input_ids", "labels"}
        expected_labels = torch.stack(
            [tokens[i * seq_len + 1 : (i + 1) * seq_len + 1] for i in range(batch_size)]
        )
        torch.testing.assert_close(batch["labels"], expected_labels, rtol=0, atol=0)
    else:
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        torch.testing.assert_close(batch["labels"], batch["input_ids"], rtol=0, atol=0)
        torch.testing.assert_close(
            batch["attention_mask"], torch.ones_like(batch["input_ids"]), rtol=0, atol=0
        )


def test_train_loader_shuffles_full_batches(datamodule):
    batches = list(datamodule.train_dataloader())
    assert len(batches) == len(datamodule.train_dataset) // SMALL["batch_size"]
    assert all(b["input_ids"].shape == (SMALL["batch_size"], SMALL["seq_len"]) for b in batches)
    first = torch.cat([b["input_ids"] for b in batches[:4]])
    in_order = torch.stack([datamodule.train_dataset[i]["input_ids"] for i in range(len(first))])
    assert not torch.equal(first, in_order)
    assert len(datamodule.test_dataloader()) == len(datamodule.val_dataloader()) > 0


def test_cache_is_reused(datamodule, cache_dir, monkeypatch):
    # A cache hit must not read the corpus or train a tokenizer again.
    def fail(*args, **kwargs):
        raise AssertionError("cache miss: the corpus was read again")

    monkeypatch.setattr(stdlib_module, "find_source_files", fail)
    monkeypatch.setattr(stdlib_module, "train_bpe_tokenizer", fail)
    again = PythonStdlibDataModule(**SMALL, cache_dir=str(cache_dir))
    assert again.cache_path == datamodule.cache_path
    again.prepare_data()
    again.setup("fit")
    assert again.tokenizer.to_str() == datamodule.tokenizer.to_str()
    assert torch.equal(again.train_dataset.tokens, datamodule.train_dataset.tokens)
    assert torch.equal(again.val_dataset.tokens, datamodule.val_dataset.tokens)


def test_cache_key_and_rebuild_are_reproducible(datamodule, tmp_path):
    other = PythonStdlibDataModule(**{**SMALL, "vocab_size": 600}, cache_dir=str(datamodule.cache_dir))
    assert other.cache_path != datamodule.cache_path
    # Rebuilding from scratch elsewhere gives the same tokenizer and tokens.
    fresh = PythonStdlibDataModule(**SMALL, cache_dir=str(tmp_path))
    fresh.setup("fit")
    assert fresh.tokenizer.to_str() == datamodule.tokenizer.to_str()
    assert torch.equal(fresh.train_dataset.tokens, datamodule.train_dataset.tokens)


def test_vocab_size_below_request_on_tiny_corpus(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n" * 50)
    dm = PythonStdlibDataModule(vocab_size=8192, root=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    assert 258 <= dm.vocab_size < 8192
    # Loggers read hparams_initial; it must agree with the model that gets the real size.
    assert dm.hparams.vocab_size == dm.hparams_initial.vocab_size == dm.vocab_size
    assert dm.hparams.max_chars == 4_000_000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_chars": 0}, "max_chars"),
        ({"val_every": 1}, "val_every"),
        ({"label_format": "unshifted"}, "label_format"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PythonStdlibDataModule(**kwargs)


def test_too_little_data_is_a_clear_error(tmp_path):
    dm = PythonStdlibDataModule(vocab_size=300, max_chars=2_000, seq_len=512, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="Increase `max_chars`"):
        dm.setup("fit")
    with pytest.raises(RuntimeError, match="setup"):
        PythonStdlibDataModule(cache_dir=str(tmp_path)).train_dataloader()


def test_token_block_dataset():
    tokens = torch.arange(10, dtype=torch.int32)
    dataset = TokenBlockDataset(tokens, seq_len=3)
    assert len(dataset) == 3  # 9 targets available -> three full blocks
    assert dataset[2]["input_ids"].tolist() == [6, 7, 8]
    assert dataset[2]["labels"].tolist() == [7, 8, 9]
    with pytest.raises(IndexError):
        dataset[3]
    assert len(TokenBlockDataset(tokens[:1], seq_len=3)) == 0
    with pytest.raises(ValueError, match="1-D"):
        TokenBlockDataset(tokens.view(2, 5), seq_len=3)
    with pytest.raises(ValueError, match="label_format"):
        TokenBlockDataset(tokens, seq_len=3, label_format="x")


@pytest.mark.parametrize("model_format", ["shifted", "hf"])
@pytest.mark.parametrize("data_format", ["shifted", "hf"])
def test_models_refuse_the_other_label_format(cache_dir, model_format, data_format):
    """TinyGPT reads "shifted" labels, HFCausalLM "hf" ones (it shifts them): with the other format a run would
    train on the wrong targets without an error (copying its input, or predicting two tokens ahead)."""
    import lightning.pytorch as pl

    from lightning_flce.models import TinyGPT

    dm = PythonStdlibDataModule(**SMALL, label_format=data_format, cache_dir=str(cache_dir))
    if model_format == "shifted":
        model = TinyGPT(vocab_size=SMALL["vocab_size"], d_model=16, n_layers=1, n_heads=2, max_seq_len=32)
    else:
        pytest.importorskip("transformers")
        from lightning_flce.models import HFCausalLM

        config = {"model_type": "llama", "vocab_size": SMALL["vocab_size"], "hidden_size": 16}
        config.update(intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        model = HFCausalLM(config=config)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if model_format == data_format:
        trainer.fit(model, datamodule=dm)
        assert trainer.global_step == 1
    else:
        with pytest.raises(ValueError, match=f"label_format='{model_format}'"):
            trainer.fit(model, datamodule=dm)
