"""The end-of-fit text of :class:`~lightning_flce.callbacks.FLCEMemoryCallback`: the metrics' maximum and
median over the logged steps, where the peak goes, and the LM head's figures."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from lightning_flce.callbacks.memory_model import HeadMemoryEstimate, MemoryBreakdown

_MIB = 2**20
_LABEL = 30  # width of the row labels of the breakdown and head sections


def summary_text(
    history: Sequence[dict[str, float]],
    breakdown: Optional[MemoryBreakdown] = None,
    head: Optional[HeadMemoryEstimate] = None,
) -> str:
    """The metrics table, then the breakdown and the head's figures when there are any."""
    # in order of first appearance: a resumed run may add metrics (another device, a module that reports logits)
    names = list(dict.fromkeys(name for row in history for name in row if name != "step"))
    width = max([len(name) for name in names] + [len("metric")])
    lines = [
        f"FLCEMemoryCallback: memory over {len(history)} logged steps (MiB)",
        f"{'metric':<{width}}  {'max':>12}  {'median':>12}",
    ]
    for name in names:
        values = [row[name] for row in history if name in row]
        lines.append(f"{name:<{width}}  {max(values):>12.1f}  {statistics.median(values):>12.1f}")
    if breakdown is not None:
        lines += ["", *breakdown_lines(breakdown)]
    if head is not None:
        lines += ["", *head_lines(head)]
    return "\n".join(lines)


def _row(label: str, size: int, note: str = "") -> str:
    return f"  {label:<{_LABEL}}{size / _MIB:>10.1f} MiB" + (f"  {note}" if note else "")


def breakdown_lines(breakdown: MemoryBreakdown) -> list[str]:
    peak = breakdown.peak_bytes
    parts = [
        ("parameters", breakdown.parameter_bytes),
        ("gradients", breakdown.gradient_bytes),
        ("optimizer state", breakdown.optimizer_state_bytes),
        ("activations + temporaries", breakdown.rest_bytes),
    ]
    lines = [f"Where the peak goes (step {breakdown.step}, {peak / _MIB:.1f} MiB):"]
    lines += [_row(name, size, f"{100 * size / peak if peak else 0.0:5.1f}%") for name, size in parts]
    return lines


def head_lines(head: HeadMemoryEstimate) -> list[str]:
    lines = [
        f"LM head ([{head.num_tokens}, {head.vocab_size}] logits, {head.precision}):",
        _row("unfused head adds to the peak", head.unfused_bytes, f"({head.bytes_per_logit} bytes a logit)"),
    ]
    if head.teacher_bytes:  # distillation: the teacher's logits and softmax come on top of the student's
        per_logit = head.teacher_bytes // max(head.num_tokens * head.vocab_size, 1)
        lines[-1] = _row(
            "unfused heads add to the peak",
            head.unfused_bytes,
            f"({head.bytes_per_logit} + {per_logit} bytes a logit)",
        )
        lines.append(_row("  of which the teacher's", head.teacher_bytes, "(its logits and softmax)"))
    if head.chunk_rows is not None:
        lines.append(_row("fused head's chunk buffer", head.chunk_bytes, f"({head.chunk_rows} rows x V)"))
        lines.append(_row("fused head's buffers in all", head.fused_bytes, "(chunk, dX, dW accumulator)"))
    if head.naive:
        lines.append(f"  {'saved':<{_LABEL}}none: the unfused head ran (flce_naive)")
    else:
        lines.append(_row("saved by the fused head", head.saved_bytes, "(estimate)"))
    return lines
