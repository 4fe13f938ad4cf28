"""FLCEMixin's summary lines beside a TQDM progress bar: each on a line of its own in a captured log, and the
bars cleared and redrawn around it in a terminal (lightning_flce/console.py)."""

from __future__ import annotations

import io
import logging
import re
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from torch.utils.data import DataLoader

from lightning_flce.console import metrics_summary, open_tqdm_bars, rank_zero_info_line
from lightning_flce.models.gpt import TinyGPT

VOCAB, SEQ = 53, 8


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def batches(num_batches: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_batches):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()})
    return DataLoader(out, batch_size=None)


def fit_into(stream: io.StringIO, monkeypatch, progress_bar=None) -> str:
    """Fits a tiny TinyGPT with a validation in the middle of the epoch (the training bar open), the bars and
    the ``lightning.pytorch`` logger both writing into ``stream``, as ``> log 2>&1`` puts them in one file."""
    monkeypatch.setattr(sys, "stdout", stream)  # Lightning's bars take sys.stdout when they are made
    monkeypatch.setattr(sys, "stderr", stream)
    handler = logging.StreamHandler(stream)
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.addHandler(handler)
    lightning_logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=1e-2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[progress_bar or TQDMProgressBar()],
    )
    try:
        trainer.fit(model, batches(4, seed=0), batches(2, seed=1))
    finally:
        lightning_logger.removeHandler(handler)
        lightning_logger.setLevel(level)
    return stream.getvalue()


def summary_positions(text: str) -> list[int]:
    positions = [match.start() for match in re.finditer(r"FLCEMixin val \(epoch 0, step \d\)", text)]
    assert len(positions) == 2, text  # the validations at steps 2 and 4
    return positions


def test_summary_line_on_its_own_line_in_a_captured_log(monkeypatch):
    text = fit_into(io.StringIO(), monkeypatch)
    lines = text.split("\n")
    for position in summary_positions(text):
        # the bar's frames before it end with a newline; the line itself carries no bar
        assert position > 0 and text[position - 1] == "\n", repr(text[position - 200 : position + 80])
    summaries = [line for line in lines if "FLCEMixin" in line]
    assert len(summaries) == 3  # two validations and the end of fit
    for line in summaries:
        assert line.startswith("FLCEMixin") and "\r" not in line and "|" not in line, repr(line)
    # the training bar carries on after the line: its later frames follow on their own lines
    first = summary_positions(text)[0]
    assert re.search(r"\rEpoch 0:", text[first:]), repr(text[first:])


def screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: carriage returns, newlines (the tty's CR LF), cursor up
    (``ESC [ n A``: tqdm's and Rich's moves back over their bars), erase line (``ESC [ 2 K``), characters
    overwriting in place; colours and cursor visibility ignored."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|.|\n", text, flags=re.DOTALL):
        if token == "\n":
            row, col = row + 1, 0
            rows.extend([] for _ in range(row + 1 - len(rows)))
        elif token == "\r":
            col = 0
        elif re.fullmatch(r"\x1b\[\d*A", token):
            row = max(row - int(token[2:-1] or 1), 0)
        elif token == "\x1b[2K":
            rows[row] = []
        elif token.startswith("\x1b"):
            assert token.endswith("m") or token.startswith("\x1b[?25"), f"escape sequence {token!r}"
        else:
            line = rows[row]
            line.extend(" " for _ in range(col + 1 - len(line)))
            line[col] = token
            col += 1
    return ["".join(line).rstrip() for line in rows]


def test_summary_line_clears_and_redraws_the_bars_in_a_terminal(monkeypatch):
    text = fit_into(Terminal(), monkeypatch)
    summary_positions(text)
    shown = screen(text)
    summaries = [index for index, line in enumerate(shown) if "FLCEMixin val" in line]
    assert len(summaries) == 2, shown
    for index in summaries:
        # the bars were erased before the line and drawn again below it, not over it
        assert re.fullmatch(r"FLCEMixin val \(epoch 0, step \d\): loss [0-9.]+, .*", shown[index]), shown
    # the training bar stays below the lines: redrawn under each, so the two validations' lines follow each other
    assert summaries[1] == summaries[0] + 1 and shown[summaries[1] + 1].startswith("Epoch 0:"), shown
    # in a terminal the bars are cleared (as tqdm.write does), so no newline is added: no blank line shows
    assert "" not in shown[: summaries[-1]], shown


def test_summary_line_above_richs_bar_in_a_terminal(monkeypatch):
    pytest.importorskip("rich")
    stream = Terminal()
    # Rich's live display redirects sys.stdout/sys.stderr (in a terminal only) to print above itself
    bar = RichProgressBar(console_kwargs={"file": stream, "force_terminal": True, "width": 160})
    text = fit_into(stream, monkeypatch, progress_bar=bar)
    shown = screen(text)
    summaries = [line for line in shown if "FLCEMixin" in line]
    assert [line.split(":")[0] for line in summaries] == [
        "FLCEMixin val (epoch 0, step 2)",
        "FLCEMixin val (epoch 0, step 4)",
        "FLCEMixin",
    ], shown
    for line in summaries:
        assert re.fullmatch(r"FLCEMixin.*: loss [0-9.]+, perplexity [0-9.]+, token accuracy [0-9.]+", line), (
            shown
        )


def test_without_a_progress_bar_it_is_rank_zero_info(caplog):
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert open_tqdm_bars(trainer) == [] and open_tqdm_bars(None) == []
    caplog.clear()  # the Trainer's own lines
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        rank_zero_info_line("a line", trainer)
        rank_zero_info_line("no trainer", None)
    assert [
        (record.name.split(".")[0], record.levelno, record.getMessage()) for record in caplog.records
    ] == [
        ("lightning", logging.INFO, "a line"),
        ("lightning", logging.INFO, "no trainer"),
    ]


def test_other_ranks_write_nothing(monkeypatch):
    from lightning.pytorch.utilities import rank_zero

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(handler)
    monkeypatch.setattr(rank_zero.rank_zero_only, "rank", 1)
    try:
        rank_zero_info_line("only rank zero", None)
    finally:
        lightning_logger.removeHandler(handler)
    assert stream.getvalue() == ""


def test_metrics_summary_names_values_and_groups_dataloaders():
    one = {"val/loss": 1.23456, "val/student_ce": 4.5, "val/perplexity": 90.0171, "val/token_accuracy": 0.25}
    assert metrics_summary(one) == "loss 1.2346, student CE 4.5000, perplexity 90.02, token accuracy 0.2500"
    several = {
        "test/loss/dataloader_idx_0": 1.0,
        "test/loss/dataloader_idx_1": 2.0,
        "test/perplexity/dataloader_idx_1": 7.389,
    }
    assert (
        metrics_summary(several) == "[dataloader 0] loss 1.0000; [dataloader 1] loss 2.0000, perplexity 7.389"
    )
