"""vocab_parallel_fused_linear_distillation on 2 and 3 CPU processes (gloo) against the float64 formula
(``test_distill.reference_loss``: TRL's ``generalized_jsd_loss`` written with ``F.kl_div``) and the single-device
op on the full heads.

Each world size runs once (a module-scoped fixture): ``world`` copies of this file join a gloo group through a file
store, run every case of :func:`cases` in the same order and save their loss, dX and dW / d bias shards per case.
The tests compare every rank's loss and dX, and dW / d bias put together from the shards at their rows, with the
float64 formula and with ``fused_linear_distillation`` on the full heads.

Tolerances as in ``test_distill.py``: fp64 inputs within 1e-10 relative (L2) of float64, fp32 within 2e-5 (two fp32
softmaxes over 40 columns, fp32 GEMMs; a missing or wrong term moves a result by more than 1e-3). bf16 against the
single-device bf16 op within 8e-3: both round the same fp32 gradients to bf16 (a relative step of 2^-8 = 3.9e-3 per
element), their fp32 values differing only in the order of the sums. Errors must raise on every rank and leave the
group usable (a later case still runs).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from ranks import error_in_step, run_ranks
from reference import relative_error
from test_distill import make_problem, reference_loss
from test_vocab_parallel import _full_from_shards

from lightning_flce import fused_linear_distillation, fused_linear_distillation_from_top_k
from lightning_flce.parallel import (
    vocab_parallel_fused_linear_distillation,
    vocab_parallel_fused_linear_distillation_from_top_k,
    vocab_shard_range,
)

FP64_TOL = 1e-10
FP32_TOL = 2e-5
BF16_TOL = 8e-3
VOCAB = {2: 41, 3: 40}  # uneven shards: 21 + 20 and 14 + 13 + 13 rows
SHAPE = (3, 7)
EXPLICIT = {0: (25, 40), 1: (0, 6), 2: (6, 25)}  # world 3, vocab_start given: not in rank order, uneven
DIVERGENCES = {
    "forward_kl": {"divergence": "forward_kl"},
    "reverse_kl": {"divergence": "reverse_kl"},
    "jsd_0.5": {"divergence": "jsd", "beta": 0.5},
    "jsd_0.2": {"divergence": "jsd", "beta": 0.2},
}
# name -> options (True: the problem's tensor of that name)
FEATURES = {
    "plain": {},
    "all": {
        "bias": True,
        "temperature": True,
        "token_weight": True,
        "hard_weight": 0.3,
        "student_softcap": 4.0,
        "teacher_softcap": 6.0,
        "student_logit_scale": 0.8,
        "teacher_logit_scale": 1.3,
    },
}
# top_k: the teacher's k largest of each row chosen across the shards (7 < every shard's rows; 17 > world 3's 13-14
# rows, so a rank's own candidates are padded), with the cross-entropy over the whole vocabulary or without it
TOP_K_FEATURES = {
    "top_k": {**FEATURES["all"], "top_k": 7},
    "top_k_wide": {"top_k": 17},
    "top_k_no_ce": {"bias": True, "temperature": True, "top_k": 7},
}
FEATURES.update(TOP_K_FEATURES)
# a teacher cached as its top k per token (vocab_parallel_fused_linear_distillation_from_top_k): no teacher head, so
# no teacher transforms; CACHED_K columns a token, the last two of token 0 padding (-inf)
FEATURES["cached"] = {
    "bias": True,
    "temperature": True,
    "token_weight": True,
    "hard_weight": 0.3,
    "student_softcap": 4.0,
    "student_logit_scale": 0.8,
}
CACHED_K = 6
REDUCTIONS = ("mean", "sum", "none")
TIMEOUT_S = 180


def cases(world: int) -> dict[str, dict]:
    """The cases every rank runs, in this order (the collectives of all ranks must line up)."""
    out = {}
    for divergence in DIVERGENCES:
        for feature in FEATURES:
            for reduction in REDUCTIONS:
                out[f"{divergence}-{feature}-{reduction}"] = {
                    "divergence": divergence,
                    "feature": feature,
                    "reduction": reduction,
                }
    for reduction in REDUCTIONS:
        out[f"fp64-jsd_0.5-all-{reduction}"] = {
            "divergence": "jsd_0.5",
            "feature": "all",
            "reduction": reduction,
            "dtype": torch.float64,
        }
    out["no_target-jsd_0.5-plain-mean"] = {"divergence": "jsd_0.5", "reduction": "mean", "target": False}
    out["default_chunk-forward_kl-all-mean"] = {
        "divergence": "forward_kl",
        "feature": "all",
        "reduction": "mean",
        "chunk_size": None,
    }
    for reduction in ("mean", "none"):
        out[f"all_ignored-jsd_0.5-all-{reduction}"] = {
            "divergence": "jsd_0.5",
            "feature": "all",
            "reduction": reduction,
            "ignore": "all",
        }
    out["empty-reverse_kl-plain-mean"] = {"divergence": "reverse_kl", "reduction": "mean", "shape": (0,)}
    out["bf16-jsd_0.5-all-mean"] = {
        "divergence": "jsd_0.5",
        "feature": "all",
        "reduction": "mean",
        "dtype": torch.bfloat16,
    }
    out["dtensor-forward_kl-all-sum"] = {
        "divergence": "forward_kl",
        "feature": "all",
        "reduction": "sum",
        "kind": "dtensor",
    }
    if world == 3:
        for reduction in REDUCTIONS:
            out[f"explicit_start-jsd_0.2-all-{reduction}"] = {
                "divergence": "jsd_0.2",
                "feature": "all",
                "reduction": reduction,
                "layout": "explicit",
            }
    for feature in TOP_K_FEATURES:
        for divergence in ("jsd_0.5", "forward_kl", "reverse_kl"):
            for reduction in ("mean", "none") if feature == "top_k" else ("mean",):
                out[f"{divergence}-{feature}-{reduction}"] = {
                    "divergence": divergence,
                    "feature": feature,
                    "reduction": reduction,
                }
    for divergence in ("jsd_0.5", "forward_kl", "reverse_kl"):
        for reduction in REDUCTIONS:
            out[f"cached-{divergence}-cached-{reduction}"] = {
                "teacher": "cached",
                "divergence": divergence,
                "feature": "cached",
                "reduction": reduction,
            }
    out["fp64-jsd_0.2-top_k-sum"] = {
        "divergence": "jsd_0.2",
        "feature": "top_k",
        "reduction": "sum",
        "dtype": torch.float64,
    }
    out.update(sequence_parallel_cases())
    for error in ERRORS:
        if error not in INTERPRET_ERRORS:
            out[f"error-{error}"] = {"kind": "error", "error": error}
    out["after_errors-jsd_0.5-all-mean"] = {"divergence": "jsd_0.5", "feature": "all", "reduction": "mean"}
    return out


SP_SHAPE = (6, 4)  # 24 tokens: a block of 12 or 8 on each of 2 or 3 ranks


def sequence_parallel_cases() -> dict[str, dict]:
    """``sequence_parallel=True``: each rank holds its block of the tokens (hidden states of both sides, targets,
    token weights, temperatures, "none"'s grad_output); every option, so a per-token value gathered in the wrong
    order or a "mean" over one rank's tokens shows."""
    base = {"kind": "sequence_parallel", "feature": "all", "shape": SP_SHAPE}
    out = {}
    for divergence in ("jsd_0.5", "forward_kl", "reverse_kl"):
        for reduction in REDUCTIONS:
            out[f"sp-{divergence}-all-{reduction}"] = {
                **base,
                "divergence": divergence,
                "reduction": reduction,
            }
    # rank 0's tokens all ignored: "mean" divides by the group's counted tokens, not a rank's
    out["sp-first_block_ignored-jsd_0.2-all-mean"] = {
        **base,
        "divergence": "jsd_0.2",
        "reduction": "mean",
        "ignore": "first_block",
    }
    out["sp-no_target-jsd_0.5-plain-mean"] = {
        **base,
        "feature": "plain",
        "divergence": "jsd_0.5",
        "reduction": "mean",
        "target": False,
    }
    out["sp-cached-jsd_0.5-cached-none"] = {
        **base,
        "teacher": "cached",
        "feature": "cached",
        "divergence": "jsd_0.5",
        "reduction": "none",
    }
    out["sp-top_k-forward_kl-top_k-mean"] = {
        **base,
        "feature": "top_k",
        "divergence": "forward_kl",
        "reduction": "mean",
    }
    out["sp-fp64-jsd_0.5-all-none"] = {
        **base,
        "divergence": "jsd_0.5",
        "reduction": "none",
        "dtype": torch.float64,
    }
    return out


def token_block(values: torch.Tensor, world: int, rank: int, n_dims: int = 0) -> torch.Tensor:
    """Rank ``rank``'s block of the tokens of ``values`` ([*tokens, *trailing] with ``n_dims`` trailing dims),
    flattened: the rows sequence parallelism gives it."""
    flat = values.reshape(-1, *values.shape[values.dim() - n_dims :])
    rows = flat.shape[0] // world
    return flat[rank * rows : (rank + 1) * rows]


def cuda_cases(world: int) -> dict[str, dict]:
    """The GPU cases: the engine's GPU path (the teacher in blocks of 256 rows of each chunk, cuBLAS GEMMs) on 600
    tokens over 1001 columns; each rank on its own GPU through NCCL where there are as many, else all on the
    first one through gloo (its collectives take CUDA tensors)."""
    out = {}
    base = {"device": "cuda", "feature": "all", "shape": (2, 300), "vocab": 1001, "hidden": (64, 96)}
    for dtype in (torch.float32, torch.bfloat16):
        for divergence in ("jsd_0.5", "forward_kl", "reverse_kl"):
            for reduction in ("mean", "none"):
                name = f"cuda-{str(dtype).removeprefix('torch.')}-{divergence}-all-{reduction}"
                out[name] = {
                    **base,
                    "dtype": dtype,
                    "divergence": divergence,
                    "reduction": reduction,
                    "chunk_size": 384,
                }
    # the Triton launch's merge of several slices a rank (two of 4096 columns or fewer on each of the two ranks)
    for divergence in ("jsd_0.5", "forward_kl"):
        out[f"cuda-bfloat16-slices-{divergence}-all-mean"] = {
            **base,
            "vocab": 9001,
            "dtype": torch.bfloat16,
            "divergence": divergence,
            "reduction": "mean",
            "chunk_size": 384,
        }
    # the PyTorch twin on the GPU: asked for, and for the 16-bit gradient in fp32 rows that the split launch cannot take
    out["cuda-bfloat16-twin-jsd_0.5-all-mean"] = {
        **base,
        "dtype": torch.bfloat16,
        "divergence": "jsd_0.5",
        "reduction": "mean",
        "chunk_size": 384,
        "impl": "torch",
    }
    out["cuda-bfloat16-fp32_logits-jsd_0.5-all-mean"] = {
        **base,
        "dtype": torch.bfloat16,
        "divergence": "jsd_0.5",
        "reduction": "mean",
        "chunk_size": 384,
        "logits_precision": "fp32",
    }
    for dtype in (torch.float32, torch.bfloat16):
        out[f"cuda-{str(dtype).removeprefix('torch.')}-sp-jsd_0.5-all-none"] = {
            **base,
            "kind": "sequence_parallel",
            "dtype": dtype,
            "divergence": "jsd_0.5",
            "reduction": "none",
            "chunk_size": 384,
        }
    # top_k in fp32 (bf16 logits tie often at the k-th largest, where the single-device op may choose another column)
    for divergence in ("jsd_0.5", "forward_kl"):
        out[f"cuda-float32-top_k-{divergence}-top_k-mean"] = {
            **base,
            "feature": "top_k",
            "dtype": torch.float32,
            "divergence": divergence,
            "reduction": "mean",
            "chunk_size": 384,
        }
    out["cuda-float32-cached-jsd_0.5-cached-mean"] = {
        **base,
        "teacher": "cached",
        "feature": "cached",
        "dtype": torch.float32,
        "divergence": "jsd_0.5",
        "reduction": "mean",
        "chunk_size": 384,
    }
    out["cuda-bfloat16-default_chunk-jsd_0.5-all-mean"] = {
        **base,
        "dtype": torch.bfloat16,
        "divergence": "jsd_0.5",
        "reduction": "mean",
        "chunk_size": None,
    }
    return out


def interpret_cases(world: int) -> dict[str, dict]:
    """The Triton kernel's shard launch (``impl="triton"``) in the interpreter, on the CPU (the workers inherit
    ``TRITON_INTERPRET=1`` from the interpreter's pytest run): its statistics, JSD's sums and the CE's target logit
    all-reduced between the steps."""
    out = {}
    for divergence in ("jsd_0.5", "forward_kl", "reverse_kl"):
        for reduction in ("mean", "none"):
            out[f"interpret-{divergence}-all-{reduction}"] = {
                "divergence": divergence,
                "feature": "all",
                "reduction": reduction,
                "impl": "triton",
            }
    for error in INTERPRET_ERRORS:
        out[f"interpret-error-{error}"] = {"kind": "error", "error": error}
    # the cross-entropy alone in the Triton launch (top_k's), on 2 ranks; sequence parallelism changes no kernel
    if world == 2:
        out["interpret-jsd_0.5-top_k-mean"] = {
            "divergence": "jsd_0.5",
            "feature": "top_k",
            "reduction": "mean",
            "impl": "triton",
        }
    out["interpret-jsd_0.2-plain-sum"] = {"divergence": "jsd_0.2", "reduction": "sum", "impl": "triton"}
    out["interpret-bf16-jsd_0.5-all-mean"] = {
        "divergence": "jsd_0.5",
        "feature": "all",
        "reduction": "mean",
        "dtype": torch.bfloat16,
        "impl": "triton",
    }
    if world == 3:
        out["interpret-explicit_start-jsd_0.5-all-mean"] = {
            "divergence": "jsd_0.5",
            "feature": "all",
            "reduction": "mean",
            "layout": "explicit",
            "impl": "triton",
        }
    return out


SUITES = {"main": cases, "cuda": cuda_cases, "interpret": interpret_cases}


# errors that need the Triton launch on a rank: the interpreter's suite
INTERPRET_ERRORS = ("impl_differs",)

# name: (what the ranks do, the error type and message every rank raises; None: a peer error on the good ranks)
ERRORS = {
    "teacher_rows_differ_on_rank1": ("ValueError", "rows of the student's head and"),
    "divergence_differs": ("ValueError", "the loss's own options"),
    "temperature_differs": ("ValueError", "the loss's own options"),
    "impl_differs": ("ValueError", "the loss's own options"),
    "target_out_of_range": ("ValueError", "target(s) outside [0, "),
    "teacher_requires_grad": ("ValueError", "teacher_weight requires grad"),
    "bad_temperature": ("ValueError", "temperature"),
    "vocab_start_overlap": ("ValueError", "do not tile"),
    "top_k_differs": ("ValueError", "the loss's own options"),
    "cached_k_above_the_vocabulary": ("ValueError", "columns per token, more than V="),
    "cached_index_out_of_range": ("ValueError", "have indices outside [0, "),
    "top_k_above_the_vocabulary": ("ValueError", "top_k must be None or an int in [1, V="),
    "sequence_parallel_rank0_only": ("ValueError", "disagree on sequence_parallel"),
    "sequence_parallel_uneven_tokens": ("ValueError", "the same number of tokens on every rank"),
}


def cached_top_k(spec: dict, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cached teacher of the case: the float64 teacher's CACHED_K largest logits a token, [*shape, k] (indices,
    logits in the case's dtype), the last two entries of token 0 padding."""
    (_, _, _), (xt, wt, bt), _, _ = problem({**spec, "dtype": torch.float64}, world)
    use_bias = FEATURES[spec.get("feature", "plain")].get("bias", False)
    logits = xt.double() @ wt.double().T + (bt.double() if use_bias else 0.0)
    values, indices = logits.topk(CACHED_K, dim=-1)
    values = values.to(spec.get("dtype", torch.float32))
    values.view(-1, CACHED_K)[0, -2:] = float("-inf")
    return indices, values


def vocab_of(spec: dict, world: int) -> int:
    return spec.get("vocab", VOCAB[world])


def problem(spec: dict, world: int):
    """(student [xs, ws, bs], teacher [xt, wt, bt], target, extras) of a case, the same on every rank, on the
    case's device."""
    dtype = spec.get("dtype", torch.float32)
    hidden = spec.get("hidden", (8, 12))
    (xs, ws, bs), (xt, wt, bt), target, extras = make_problem(
        shape=spec.get("shape", SHAPE),
        hs=hidden[0],
        ht=hidden[1],
        v=vocab_of(spec, world),
        dtype=torch.float64,
        seed=3,
    )
    device = spec.get("device", "cpu")
    target = target.to(device)
    extras = {name: value.to(device) for name, value in extras.items()}
    if spec.get("ignore") == "all":
        target = torch.full_like(target, -100)
    elif spec.get("ignore") == "first_block":
        target = target.clone()
        target.view(-1)[: target.numel() // world] = -100
    student = [t.detach().to(device, dtype) for t in (xs, ws, bs)]
    teacher = [t.to(device, dtype) for t in (xt, wt, bt)]
    return student, teacher, target, extras


def op_kwargs(spec: dict, extras: dict) -> dict:
    kwargs = dict(DIVERGENCES[spec["divergence"]])
    for name, value in FEATURES[spec.get("feature", "plain")].items():
        if name != "bias":
            kwargs[name] = extras[name] if value is True else value
    kwargs["reduction"] = spec["reduction"]
    if "logits_precision" in spec:
        kwargs["logits_precision"] = spec["logits_precision"]
    return kwargs


def shard_rows(spec: dict, world: int, rank: int) -> tuple[int, int]:
    if spec.get("layout") == "explicit":
        return EXPLICIT[rank]
    return vocab_shard_range(vocab_of(spec, world), world, rank)


def _backward(loss: torch.Tensor, spec: dict, extras: dict) -> None:
    grad_output = (
        extras["grad_output"] if spec["reduction"] == "none" else torch.tensor(0.75, device=loss.device)
    )
    (loss * grad_output.to(loss.dtype)).sum().backward()


# ----------------------------------------------------------------------------------------------
# Worker (this file run as a script, one process per rank)
# ----------------------------------------------------------------------------------------------


def run_case(spec: dict, world: int, rank: int) -> dict:
    if spec.get("kind") == "error":
        return {"error": run_error(spec["error"], world, rank)}
    (xs, ws, bs), (xt, wt, bt), target, extras = problem(spec, world)
    start, end = shard_rows(spec, world, rank)
    use_bias = FEATURES[spec.get("feature", "plain")].get("bias", False)
    cached = cached_top_k(spec, world) if spec.get("teacher") == "cached" else None
    sequence_parallel = spec.get("kind") == "sequence_parallel"
    if sequence_parallel:  # this rank's tokens only
        xs, xt = token_block(xs, world, rank, 1), token_block(xt, world, rank, 1)
        target = token_block(target, world, rank)
        extras = {name: token_block(value, world, rank) for name, value in extras.items()}
        if cached is not None:
            cached = tuple(token_block(t, world, rank, 1) for t in cached)
    x = xs.clone().requires_grad_()
    w = ws[start:end].clone().requires_grad_()
    b = bs[start:end].clone().requires_grad_() if use_bias else None
    teacher_w, teacher_b = wt[start:end], bt[start:end] if use_bias else None
    kwargs = op_kwargs(spec, extras)
    kwargs["chunk_size"] = spec.get("chunk_size", 8)
    if "impl" in spec:
        kwargs["impl"] = spec["impl"]
    if spec.get("layout") == "explicit":
        kwargs["vocab_start"] = start
    if sequence_parallel:
        kwargs["sequence_parallel"] = True
    if spec.get("kind") == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_flce._compat import dtensor_api

        api = dtensor_api()
        mesh = init_device_mesh("cpu", (world,))
        w = api.distribute_tensor(ws, mesh, [api.Shard(0)]).requires_grad_()
        b = api.distribute_tensor(bs, mesh, [api.Shard(0)]).requires_grad_()
        teacher_w = api.distribute_tensor(wt, mesh, [api.Shard(0)])
        teacher_b = api.distribute_tensor(bt, mesh, [api.Shard(0)])
    given_target = target if spec.get("target", True) else None
    if cached is not None:
        loss = vocab_parallel_fused_linear_distillation_from_top_k(
            x, w, *cached, given_target, student_bias_shard=b, **kwargs
        )
    else:
        loss = vocab_parallel_fused_linear_distillation(
            x, w, xt, teacher_w, given_target, student_bias_shard=b, teacher_bias_shard=teacher_b, **kwargs
        )
    _backward(loss, spec, extras)
    dw, db = w.grad, None if b is None else b.grad
    if spec.get("kind") == "dtensor":
        dw, db = dw.to_local(), db.to_local()
        start = (
            -(-vocab_of(spec, world) // world) * rank
        )  # torch's Shard(0): torch.chunk's rows, not vocab_shard_range's
        end = start + dw.shape[0]
    return {"rows": (start, end), "loss": loss.detach(), "dx": x.grad, "dw": dw, "db": db}


def run_error(error: str, world: int, rank: int) -> str:
    spec = {"divergence": "jsd_0.5", "feature": "all", "reduction": "mean"}
    (xs, ws, bs), (xt, wt, bt), target, extras = problem(spec, world)
    start, end = shard_rows(spec, world, rank)
    x, w, teacher_w = xs.clone().requires_grad_(), ws[start:end].clone().requires_grad_(), wt[start:end]
    kwargs = op_kwargs(spec, extras)
    kwargs["chunk_size"] = 8
    if error == "teacher_rows_differ_on_rank1" and rank == 1:
        teacher_w = teacher_w[1:]
    elif error == "divergence_differs":
        kwargs["divergence"] = "forward_kl" if rank == 1 else "jsd"
    elif error == "temperature_differs":
        kwargs["temperature"] = 1.0 + rank
    elif error == "impl_differs":  # the Triton launch (in the interpreter) on rank 0, the twin on the others
        kwargs["impl"] = "triton" if rank == 0 else "torch"
    elif error == "target_out_of_range":
        target = target.clone()
        target[0, 0] = VOCAB[world] + 2
    elif error == "teacher_requires_grad":
        teacher_w = teacher_w.clone().requires_grad_()
    elif error == "bad_temperature":
        kwargs["temperature"] = extras["temperature"].clone()
        kwargs["temperature"][0, 0] = 0.0
    elif error == "vocab_start_overlap":
        kwargs["vocab_start"] = 0  # every rank claims row 0
    elif error in ("cached_k_above_the_vocabulary", "cached_index_out_of_range"):
        k = VOCAB[world] + 1 if error == "cached_k_above_the_vocabulary" else 4
        indices = torch.arange(k).expand(*target.shape, k).contiguous()
        if error == "cached_index_out_of_range":
            indices[0, 2, 2] = VOCAB[world]  # a token that carries a loss
        logits = torch.randn(*target.shape, k, dtype=xs.dtype)
        for name in ("teacher_softcap", "teacher_logit_scale"):  # no teacher head
            kwargs.pop(name)
        return error_in_step(
            lambda: vocab_parallel_fused_linear_distillation_from_top_k(
                x, w, indices, logits, target, **kwargs
            )
        )
    elif error == "top_k_differs":
        kwargs["top_k"] = 5 + rank
    elif (
        error == "top_k_above_the_vocabulary"
    ):  # fine for each rank's shard check, too many for the vocabulary
        kwargs["top_k"] = VOCAB[world] + 1
    elif error == "sequence_parallel_rank0_only":
        kwargs["sequence_parallel"] = rank == 0
    elif error == "sequence_parallel_uneven_tokens":  # rank 1 holds 2 rows of tokens, the others 3
        kwargs["sequence_parallel"] = True
        if rank == 1:
            x, xt, target = x[:2].detach().requires_grad_(), xt[:2], target[:2]
            kwargs.update({name: kwargs[name][:2] for name in ("temperature", "token_weight")})
    return error_in_step(
        lambda: vocab_parallel_fused_linear_distillation(x, w, xt, teacher_w, target, **kwargs)
    )


def worker(out_dir: str, world: int, rank: int, suite: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "gloo"
    if suite == "cuda":
        gpus = torch.cuda.device_count()
        backend = "nccl" if gpus >= world else "gloo"
        torch.cuda.set_device(rank if backend == "nccl" else 0)
    dist.init_process_group(
        backend, init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=world
    )
    results: dict = {"_backend": backend}
    start = time.perf_counter()
    for name, spec in SUITES[suite](world).items():
        print(f"[rank {rank}] {name}", flush=True)  # the harness shows these tails on a timeout
        results[name] = _on_cpu(run_case(spec, world, rank))
    results["_seconds"] = time.perf_counter() - start
    dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    # No destroy_process_group(): see test_vocab_parallel.py's worker (torch 2.4's gloo teardown can hang).


def _on_cpu(result: dict) -> dict:
    return {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in result.items()}


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def get(world: int, suite: str = "main") -> list[dict]:
        if (world, suite) not in cache:
            out_dir = tmp_path_factory.mktemp(f"vpd{world}_{suite}")
            cache[world, suite] = run_ranks(
                world,
                lambda rank: [__file__, out_dir, world, rank, suite],
                out_dir,
                TIMEOUT_S,
                label=f"vocab-parallel distillation ({suite})",
            )
        return cache[world, suite]

    return get


def _case_ids():
    return [(world, name) for world in (2, 3) for name in cases(world)]


def _expected(spec: dict, world: int):
    """((loss, dx, dw, db) of the float64 formula, the same of the single-device op on the full heads)."""
    (xs, ws, bs), (xt, wt, bt), target, extras = problem(spec, world)
    use_bias = FEATURES[spec.get("feature", "plain")].get("bias", False)
    kwargs = op_kwargs(spec, extras)
    given_target = target if spec.get("target", True) else None

    def run(fn, dtype):
        # fresh leaves for each run (.to of the same dtype would return the problem's own tensors)
        x, w = xs.to(dtype).clone().requires_grad_(), ws.to(dtype).clone().requires_grad_()
        b = bs.to(dtype).clone().requires_grad_() if use_bias else None
        teacher = (xt.to(dtype), wt.to(dtype), bt.to(dtype) if use_bias else None)
        loss = fn(x, w, b, teacher)
        _backward(loss, spec, extras)
        return tuple(
            None if t is None else t.cpu()
            for t in (loss.detach(), x.grad, w.grad, None if b is None else b.grad)
        )

    if spec.get("teacher") == "cached":
        indices, values = cached_top_k(spec, world)
        reference = run(
            lambda x, w, b, t: reference_loss(
                x,
                w,
                t[0],
                t[1],
                given_target,
                student_bias=b,
                top_k_indices=indices,
                top_k_logits=values,
                **kwargs,
            ),
            torch.float64,
        )
        single = run(
            lambda x, w, b, t: fused_linear_distillation_from_top_k(
                x,
                w,
                indices,
                values,
                given_target,
                student_bias=b,
                chunk_size=spec.get("chunk_size", 8),
                **kwargs,
            ),
            xs.dtype,
        )
        return reference, single
    reference = run(
        lambda x, w, b, t: reference_loss(
            x, w, t[0], t[1], given_target, student_bias=b, teacher_bias=t[2], **kwargs
        ),
        torch.float64,
    )
    single = run(
        lambda x, w, b, t: fused_linear_distillation(
            x,
            w,
            t[0],
            t[1],
            given_target,
            student_bias=b,
            teacher_bias=t[2],
            chunk_size=spec.get("chunk_size", 8),
            **kwargs,
        ),
        xs.dtype,
    )
    return reference, single


@pytest.mark.parametrize(("world", "name"), _case_ids(), ids=[f"w{w}-{n}" for w, n in _case_ids()])
def test_vocab_parallel_distillation(results, world, name):
    _check_case(cases(world)[name], world, [r[name] for r in results(world)])


@pytest.mark.interpret
@pytest.mark.parametrize(("world", "name"), [(w, n) for w in (2, 3) for n in interpret_cases(w)])
def test_vocab_parallel_distillation_triton_in_the_interpreter(results, world, name):
    _check_case(interpret_cases(world)[name], world, [r[name] for r in results(world, "interpret")])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", list(cuda_cases(2)))
def test_vocab_parallel_distillation_cuda(results, name):
    _check_case(cuda_cases(2)[name], 2, [r[name] for r in results(2, "cuda")])


def _group_tokens(spec: dict, world: int, ranks: list[dict]) -> list[dict]:
    """Sequence parallelism: each rank's results with the group's tokens put together from every rank's block ("none"'s
    losses and dX, in rank order, in the problem's shape), after checking that each rank returned its block only."""
    shape = spec["shape"]
    block = shape[0] * shape[1] // world
    losses, grads = [r["loss"] for r in ranks], [r["dx"] for r in ranks]
    for loss, dx in zip(losses, grads):
        assert dx.shape[0] == block, dx.shape
        assert loss.shape == ((block,) if spec["reduction"] == "none" else ()), loss.shape
    dx = torch.cat(grads).view(*shape, -1)
    return [
        {**r, "dx": dx, "loss": torch.cat(losses).view(shape) if spec["reduction"] == "none" else r["loss"]}
        for r in ranks
    ]


def _check_case(spec: dict, world: int, ranks: list[dict]) -> None:
    if spec.get("kind") == "error":
        kind, message = ERRORS[spec["error"]]
        for rank, r in enumerate(ranks):
            assert r["error"] is not None, f"rank {rank} raised nothing"
            assert r["error"].startswith(kind), r["error"]
            # the ranks whose own arguments passed name the failing ones; the others raise the message itself
            assert message in r["error"] or "failed their argument checks" in r["error"], r["error"]
        assert any(message in r["error"] for r in ranks)
        return
    if spec.get("kind") == "sequence_parallel":
        ranks = _group_tokens(spec, world, ranks)
    if spec.get("layout") == "explicit":
        assert [r["rows"] for r in ranks] == [EXPLICIT[rank] for rank in range(world)]
    reference, single = _expected(spec, world)
    dtype = spec.get("dtype", torch.float32)
    vocab = vocab_of(spec, world)
    dw = _full_from_shards([(r["rows"], r["dw"]) for r in ranks], vocab)
    db = _full_from_shards([(r["rows"], r["db"]) for r in ranks], vocab) if single[3] is not None else None
    if spec.get("ignore") == "all" or spec.get("shape") == (0,):
        for r in ranks:
            assert torch.count_nonzero(r["loss"]) == 0 and torch.count_nonzero(r["dx"]) == 0
            assert r["loss"].shape == single[0].shape and r["dx"].shape == single[1].shape
        assert torch.count_nonzero(dw) == 0 and (db is None or torch.count_nonzero(db) == 0)
        return
    for r in ranks:
        assert r["loss"].dtype == single[0].dtype and r["loss"].shape == single[0].shape
        assert r["dx"].dtype == single[1].dtype == dtype
    assert dw.dtype == dtype
    if dtype == torch.bfloat16:  # against the single-device bf16 op (see the module docstring)
        pairs = [(r["loss"], single[0]) for r in ranks] + [(r["dx"], single[1]) for r in ranks]
        pairs += [(dw, single[2]), (db, single[3])]
        for got, want in pairs:
            assert relative_error(got, want) < BF16_TOL
        return
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    for rank, r in enumerate(ranks):
        for what, want in (("reference", reference), ("single-device op", single)):
            assert relative_error(r["loss"], want[0]) < tol, f"rank {rank} loss vs the {what}"
            assert relative_error(r["dx"], want[1]) < tol, f"rank {rank} dx vs the {what}"
    for what, want in (("reference", reference), ("single-device op", single)):
        assert relative_error(dw, want[2]) < tol, f"dw vs the {what}"
        if want[3] is not None:
            assert relative_error(db, want[3]) < tol, f"d bias vs the {what}"
    assert (db is None) == (single[3] is None)


def test_takes_the_single_device_options_under_their_names_and_defaults():
    """One name per option: the single-device op's keywords (same defaults and types), less the one it refuses
    (``vocab_size``), the biases named ``_shard`` as the weights (as the vocab-parallel CE's), plus the
    group's layout."""
    import inspect

    def keywords(function):
        parameters = inspect.signature(function).parameters.values()
        return {p.name: (p.default, p.annotation) for p in parameters if p.kind is p.KEYWORD_ONLY}

    single, sharded = keywords(fused_linear_distillation), keywords(vocab_parallel_fused_linear_distillation)
    for side in ("student", "teacher"):
        single[f"{side}_bias_shard"] = single.pop(f"{side}_bias")
    single.pop("vocab_size")
    layout = {"group": (None, "Optional[dist.ProcessGroup]"), "vocab_start": (None, "Optional[int]")}
    assert sharded == {**single, **layout, "sequence_parallel": (False, "bool")}


def test_needs_an_initialized_process_group():
    (xs, ws, _), (xt, wt, _), target, _ = make_problem()
    with pytest.raises(RuntimeError, match="initialized torch.distributed"):
        vocab_parallel_fused_linear_distillation(xs, ws, xt, wt, target)


def test_group_of_one_is_the_single_device_op_and_refuses_a_second_backward(tmp_path):
    """One process (a group of 1): the same loss and gradients as the single-device op; a second backward
    through a "mean" call is refused as the single-device op refuses it."""
    import torch.distributed as dist

    (xs, ws, bs), (xt, wt, bt), target, extras = make_problem(dtype=torch.float32)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = vocab_parallel_fused_linear_distillation(
            xs, ws, xt, wt, target, student_bias_shard=bs, teacher_bias_shard=bt, hard_weight=0.2
        )
        got.backward(retain_graph=True)
        got_grads = [t.grad.clone() for t in (xs, ws, bs)]
        with pytest.raises(RuntimeError, match="backward ran twice"):
            got.backward()
    finally:
        dist.destroy_process_group()
    for t in (xs, ws, bs):
        t.grad = None
    want = fused_linear_distillation(
        xs, ws, xt, wt, target, student_bias=bs, teacher_bias=bt, hard_weight=0.2
    )
    want.backward()
    assert relative_error(got.detach(), want.detach()) < FP32_TOL
    for g, t in zip(got_grads, (xs, ws, bs)):
        assert relative_error(g, t.grad) < FP32_TOL


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    sys.stdout.flush()
    os._exit(0)  # skip the process group's and the interpreter's teardown (see worker)
