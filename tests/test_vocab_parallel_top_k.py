"""vocab_parallel_fused_linear_top_k on 2 and 3 CPU processes (gloo) against the float64 formula
``log_softmax(softcap(x @ W.T + b)).topk(k)`` over the whole head (``test_top_k.reference``) and the single-device
``fused_linear_top_k`` on the full head.

Each world size runs once per suite (a module-scoped fixture): ``world`` copies of this file join a gloo group through
a file store, run every case of :func:`cases` in the same order and save their outputs per case. The tests check that
every rank returns the same top k, and that it is the formula's (``test_top_k.check``: values in descending order
against the reference's k largest, each value against the reference at its own column, distinct columns; in float64
the columns themselves, to 1e-12), with the single-device op's padding of ignored tokens (-inf, 0).

Tolerances as in ``test_top_k.py``: float64 1e-12; fp32 GEMMs 1e-5 of the largest logit; bf16 logits 2^-7 of it
(each logit rounded to bf16 in the value and in the row's log-sum-exp, which is now a log-sum-exp of the shards'
log-sum-exps: the same bound). Errors must raise on every rank and leave the group usable (a later case runs).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from ranks import error_in_step, run_ranks
from test_top_k import check, make_problem, reference

from lightning_flce import fused_linear_top_k
from lightning_flce.parallel import vocab_parallel_fused_linear_top_k, vocab_shard_range

VOCAB = {2: 41, 3: 40}  # uneven shards: 21 + 20 and 14 + 13 + 13 rows
EXPLICIT = {0: (25, 40), 1: (0, 6), 2: (6, 25)}  # world 3, vocab_start given: not in rank order, uneven
TIMEOUT_S = 180
ERRORS = {
    # error -> (the exception type on every rank, a part of its message on the ranks that raise their own)
    "k_above_the_vocabulary": ("ValueError", "k must be an int in [1, V="),
    "k_differs": ("ValueError", "disagree"),
    "target_out_of_range": ("ValueError", "outside [0, "),
    "tokens_differ": ("ValueError", "disagree on their targets"),
    "hidden_size_differs_on_rank1": ("ValueError", "disagree"),
    "bad_k_on_rank1": ("ValueError", "k must be a positive int"),
    "vocab_start_overlap": ("ValueError", "do not tile"),
}


def cases(world: int) -> dict[str, dict]:
    """The cases every rank runs, in this order (the collectives of all ranks must line up)."""
    out: dict[str, dict] = {}
    for log_probs in (True, False):
        for softcap in (None, 4.0):
            out[f"fp64-log_probs{int(log_probs)}-softcap{softcap}"] = {
                "log_probs": log_probs,
                "softcap": softcap,
            }
    # k above the smallest shard (world 3: 13-14 rows; world 2: 20-21): a rank's candidates padded
    out["fp64-wide_k"] = {"k": 17 if world == 3 else 25}
    out["fp64-k_equal_to_v"] = {"k": VOCAB[world], "bias": False}
    out["fp64-no_target"] = {"target": False}
    out["fp64-default_chunks"] = {"chunk_size": None}
    out["fp64-sequence_parallel"] = {"sequence_parallel": True, "shape": (6, 5)}  # 6 rows: blocks of 2 or 3
    out["fp32"] = {"dtype": torch.float32}
    out["bf16"] = {"dtype": torch.bfloat16}
    out["bf16-logits_fp32"] = {"dtype": torch.bfloat16, "logits_precision": "fp32"}
    out["all_ignored"] = {"ignore": "all"}
    out["empty"] = {"shape": (0, 4)}
    if world == 3:
        out["fp64-explicit_vocab_start"] = {"explicit": True, "softcap": 4.0}
    for error in ERRORS:
        if error != "vocab_start_overlap" or world == 3:
            out[f"error-{error}"] = {"error": error}
    out["after_errors"] = {}  # the group still works
    return out


def interpret_cases(world: int) -> dict[str, dict]:
    """The Triton backend's row statistics (``impl="triton"``) in the interpreter (the workers inherit
    ``TRITON_INTERPRET=1`` from the interpreter's pytest run)."""
    return {
        "interpret-fp64": {"impl": "triton", "softcap": 4.0},
        "interpret-fp32-wide_k": {"impl": "triton", "dtype": torch.float32, "k": 17 if world == 3 else 25},
    }


def cuda_cases(world: int) -> dict[str, dict]:
    """The GPU path (the engine's GPU chunks, cuBLAS GEMMs, the Triton row statistics) on 600 tokens over 1001
    columns; each rank on its own GPU through NCCL where there are as many, else all on the first through gloo."""
    base = {"device": "cuda", "shape": (2, 300), "vocab": 1001, "hidden": 64, "k": 20, "chunk_size": None}
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for log_probs in (True, False):
            name = f"cuda-{str(dtype).removeprefix('torch.')}-log_probs{int(log_probs)}"
            out[name] = {**base, "dtype": dtype, "log_probs": log_probs, "softcap": 30.0}
    out["cuda-bfloat16-logits_fp32"] = {**base, "dtype": torch.bfloat16, "logits_precision": "fp32"}
    out["cuda-float32-sequence_parallel"] = {
        **base,
        "dtype": torch.float32,
        "sequence_parallel": True,
        "shape": (6, 100),
    }
    return out


SUITES = {"main": cases, "interpret": interpret_cases, "cuda": cuda_cases}


def vocab_of(spec: dict, world: int) -> int:
    return spec.get("vocab", VOCAB[world])


def problem(spec: dict, world: int):
    """(x, w, b, target) of the full head, in the case's dtype and on its device; some tokens ignored."""
    x, w, b, target = make_problem(
        n=spec.get("shape", (3, 7)),
        h=spec.get("hidden", 16),
        v=vocab_of(spec, world),
        dtype=spec.get("dtype", torch.float64),
        device=spec.get("device", "cpu"),
        bias=spec.get("bias", True),
        seed=3,
    )
    if spec.get("ignore") == "all":
        target = torch.full_like(target, -100)
    return x, w, b, target


def shard_rows(spec: dict, world: int, rank: int) -> tuple[int, int]:
    if spec.get("explicit"):
        return EXPLICIT[rank]
    return vocab_shard_range(vocab_of(spec, world), world, rank)


def kwargs_of(spec: dict) -> dict:
    return {
        "softcap": spec.get("softcap"),
        "log_probs": spec.get("log_probs", True),
        "logits_precision": spec.get("logits_precision", "input"),
        "chunk_size": spec.get("chunk_size", 4),
        "impl": spec.get("impl", "auto"),
    }


def run_case(spec: dict, world: int, rank: int) -> dict:
    x, w, b, target = problem(spec, world)
    start, end = shard_rows(spec, world, rank)
    kwargs = kwargs_of(spec)
    k = spec.get("k", 7)
    if "error" in spec:
        return {
            "error": run_error(spec["error"], x, w[start:end], b[start:end], target, k, world, rank, kwargs)
        }
    if spec.get("explicit"):
        kwargs["vocab_start"] = start
    tokens, given = (x, target if spec.get("target", True) else None)
    if spec.get("sequence_parallel"):  # this rank's block of the flattened tokens
        rows = x.shape[0] // world
        tokens, given = x[rank * rows : (rank + 1) * rows], target[rank * rows : (rank + 1) * rows]
        kwargs["sequence_parallel"] = True
    out = vocab_parallel_fused_linear_top_k(
        tokens, w[start:end], k, None if b is None else b[start:end], target=given, **kwargs
    )
    return {"values": out.values, "indices": out.indices}


def run_error(error, x, w, b, target, k, world, rank, kwargs) -> str:
    if error == "k_above_the_vocabulary":  # within each rank's checks, above the whole vocabulary
        k = VOCAB[world] + 1
    elif error == "k_differs":
        k = 5 + rank
    elif error == "target_out_of_range":
        target = target.clone()
        target[0, 1] = VOCAB[world]  # a column no shard holds (each shard's own checks see no range)
    elif error == "tokens_differ" and rank == 1:
        target = target.roll(1, dims=1)
    elif error == "hidden_size_differs_on_rank1" and rank == 1:
        x, w = x[..., :-1], w[:, :-1]
    elif error == "bad_k_on_rank1" and rank == 1:
        k = 0
    elif error == "vocab_start_overlap":
        kwargs["vocab_start"] = 0  # every rank claims row 0
    return error_in_step(lambda: vocab_parallel_fused_linear_top_k(x, w, k, b, target=target, **kwargs))


def worker(out_dir: str, world: int, rank: int, suite: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "gloo"
    if suite == "cuda":
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
        torch.cuda.set_device(rank if backend == "nccl" else 0)
    dist.init_process_group(
        backend, init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=world
    )
    results = {}
    for name, spec in SUITES[suite](world).items():
        print(f"[rank {rank}] {name}", flush=True)  # the harness shows these tails on a timeout
        if suite == "cuda":
            spec = {**spec, "device": f"cuda:{torch.cuda.current_device()}"}
        outputs = run_case(spec, world, rank)
        results[name] = {key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in outputs.items()}
    dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    # No destroy_process_group(): see test_vocab_parallel.py's worker (torch 2.4's gloo teardown can hang).


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def get(world: int, suite: str = "main") -> list[dict]:
        if (world, suite) not in cache:
            out_dir = tmp_path_factory.mktemp(f"vptk{world}_{suite}")
            cache[world, suite] = run_ranks(
                world,
                lambda rank: [__file__, out_dir, world, rank, suite],
                out_dir,
                TIMEOUT_S,
                label=f"vocab-parallel top k ({suite})",
            )
        return cache[world, suite]

    return get


def _check_case(spec: dict, world: int, ranks: list[dict]) -> None:
    if "error" in spec:
        kind, message = ERRORS[spec["error"]]
        errors = [r["error"] for r in ranks]
        assert all(e is not None and e.startswith(kind) for e in errors), errors
        assert any(message in e for e in errors), errors
        return
    if spec.get("sequence_parallel"):  # each rank its block of the tokens
        values, indices = (torch.cat([r[key] for r in ranks]) for key in ("values", "indices"))
    else:  # the same top k on every rank, bit for bit (the same merge of the same candidates)
        values, indices = ranks[0]["values"], ranks[0]["indices"]
        for other in ranks[1:]:
            assert torch.equal(other["values"], values) and torch.equal(other["indices"], indices)
    x, w, b, target = problem(spec, world)
    kwargs = kwargs_of(spec)
    k = spec.get("k", 7)
    valid = target != -100 if spec.get("target", True) else torch.ones_like(target, dtype=torch.bool)
    z = reference(x, w, b, kwargs["softcap"], kwargs["log_probs"])
    dtype = spec.get("dtype", torch.float64)
    logits = reference(x, w, b, kwargs["softcap"], log_probs=False)
    scale = max(logits.abs().max().item() if logits.numel() else 0.0, 1.0)
    if dtype == torch.float64:
        atol, exact = 1e-12, True
    elif dtype == torch.bfloat16 and kwargs["logits_precision"] == "input":
        atol, exact = 2.0**-7 * scale, False
    else:
        atol, exact = 1e-5 * scale, False
    check((values, indices), z, k, valid, atol=atol, exact_columns=exact)
    # the single-device op on the full head, the same options
    single_kwargs = {key: value for key, value in kwargs.items() if key != "chunk_size"}
    single = fused_linear_top_k(
        x, w, k, b, target=target if spec.get("target", True) else None, chunk_size=4, **single_kwargs
    )
    assert values.dtype == single.values.dtype
    torch.testing.assert_close(values, single.values.cpu(), rtol=0, atol=atol)
    if exact:
        assert torch.equal(indices, single.indices.cpu())


def _case_ids(suite: dict) -> list:
    return [(world, name) for world in (2, 3) for name in suite(world)]


@pytest.mark.parametrize(("world", "name"), _case_ids(cases), ids=[f"w{w}-{n}" for w, n in _case_ids(cases)])
def test_vocab_parallel_top_k(results, world, name):
    _check_case(cases(world)[name], world, [r[name] for r in results(world)])


@pytest.mark.interpret
@pytest.mark.parametrize(("world", "name"), _case_ids(interpret_cases))
def test_vocab_parallel_top_k_triton_in_the_interpreter(results, world, name):
    _check_case(interpret_cases(world)[name], world, [r[name] for r in results(world, "interpret")])


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(cuda_cases(2)))
def test_vocab_parallel_top_k_cuda(results, name):
    _check_case(cuda_cases(2)[name], 2, [r[name] for r in results(2, "cuda")])


def test_needs_an_initialized_process_group():
    x, w, b, target = make_problem()
    with pytest.raises(RuntimeError, match="initialized torch.distributed"):
        vocab_parallel_fused_linear_top_k(x, w, 3, b, target=target)


def test_group_of_one_is_the_single_device_op(tmp_path):
    """One process (a group of 1): the single-device op's result, bit for bit (the same chunks, a merge of one)."""
    import torch.distributed as dist

    x, w, b, target = make_problem(dtype=torch.float32)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = vocab_parallel_fused_linear_top_k(x, w, 5, b, target=target, softcap=3.0)
    finally:
        dist.destroy_process_group()
    want = fused_linear_top_k(x, w, 5, b, target=target, softcap=3.0)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-6)
    assert torch.equal(got.indices, want.indices)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    sys.stdout.flush()
    os._exit(0)  # skip the process group's and the interpreter's teardown (see worker)
