"""benchmarks/bench_distill.py on the CPU at tiny shapes: its divergence is the contract's (the convention every
provider is configured to), its float64 reference has the closed-form student gradient, and a --quick run
writes one JSON line per provider x divergence."""

import json
import math
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
bench = pytest.importorskip("bench_distill")


def _log_probs(rows, vocab, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale, -1)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_divergence_rows_is_the_generalized_jsd_of_the_contract(beta):
    log_p, log_q = _log_probs(5, 50, 0), _log_probs(5, 50, 1)  # student p, teacher q
    p, q = log_p.exp(), log_q.exp()
    if beta == 0.0:
        expected = (q * (log_q - log_p)).sum(-1)  # KL(teacher || student)
    elif beta == 1.0:
        expected = (p * (log_p - log_q)).sum(-1)  # KL(student || teacher)
    else:
        log_m = (beta * q + (1 - beta) * p).log()
        expected = beta * (q * (log_q - log_m)).sum(-1) + (1 - beta) * (p * (log_p - log_m)).sum(-1)
    torch.testing.assert_close(bench.divergence_rows(log_p, log_q, beta), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_reference_gradients_are_the_closed_form_ones(divergence):
    """dX and dW of the float64 reference (autograd per row chunk, 3 chunks) against d/dz_s written out:
    p - q (forward KL) or (1 - beta) p (log p - log M - KL(p || M)) (JSD), over T, per non-ignored token."""
    beta, temperature = bench.beta_of(divergence, 0.3), 2.0
    gen = torch.Generator().manual_seed(2)
    n, h_s, h_t, v = 12, 6, 5, 40
    xs, ws = torch.randn(n, h_s, generator=gen).bfloat16(), torch.randn(v, h_s, generator=gen).bfloat16()
    xt, wt = torch.randn(n, h_t, generator=gen).bfloat16(), torch.randn(v, h_t, generator=gen).bfloat16()
    target = torch.randint(0, v, (n,), generator=gen)
    target[[1, 7]] = bench.IGNORE_INDEX
    loss, dx, dw = bench.reference(xs, ws, xt, wt, target, beta, temperature, rows=5)

    x64, w64 = xs.double(), ws.double()
    log_p = torch.log_softmax(x64 @ w64.t() / temperature, -1)
    log_q = torch.log_softmax(xt.double() @ wt.double().t() / temperature, -1)
    p, q = log_p.exp(), log_q.exp()
    if divergence == "forward_kl":
        grad_z = p - q
    else:
        log_m = (beta * q + (1 - beta) * p).log()
        kl_p_m = (p * (log_p - log_m)).sum(-1, keepdim=True)
        grad_z = (1 - beta) * p * (log_p - log_m - kl_p_m)
    valid = (target != bench.IGNORE_INDEX).double()[:, None]
    grad_logits = grad_z * valid / valid.sum() / temperature
    rows = bench.divergence_rows(log_p, log_q, beta)
    assert math.isclose(loss, float((rows * valid[:, 0]).sum() / valid.sum()), rel_tol=1e-12)
    torch.testing.assert_close(dx, grad_logits @ w64, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(dw, grad_logits.t() @ x64, rtol=1e-10, atol=1e-14)
    assert dx[[1, 7]].abs().max() == 0  # ignored tokens carry no loss


def test_quick_run_writes_a_line_per_provider_and_divergence(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(
        ["--quick", "--device", "cpu", "--providers", "unfused,liger_fused_linear_jsd", "--repeats", "1"]
    )
    lines = [json.loads(line) for line in (tmp_path / "distill.jsonl").read_text().splitlines()]
    assert [(r["divergence"], r["provider"]) for r in lines] == [
        ("forward_kl", "unfused"),
        ("forward_kl", "liger_fused_linear_jsd"),
        ("jsd", "unfused"),
        ("jsd", "liger_fused_linear_jsd"),
    ]
    for record in lines:
        assert record["env"]["torch"] == torch.__version__
        if record["provider"] == "unfused":
            # bf16 logits of ~N(0, 1): the unfused loss within 1e-3 of float64, its gradients within 2e-2
            assert record["status"] == "ok" and record["samples"] == 1 and record["ms"] > 0
            assert record["loss_rel_err"] < 1e-3 and max(record["dx_rel_err"], record["dw_rel_err"]) < 2e-2
            assert record["floor_ms"] > 0 and record["pct_floor"] > 0
        else:
            assert record["status"] == "skipped" and "needs CUDA" in record["error"]
    assert "goals (flce):" in (tmp_path / "distill.md").read_text()
