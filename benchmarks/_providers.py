"""The implementations bench_flce.py compares. Each provider is ``fn(x, W, t) -> scalar mean loss``; the
benchmark calls ``loss.backward()`` and reads ``x.grad`` (dX) and ``W.grad`` (dW). A ``weighted`` provider
is ``fn(x, W, t, token_weight)``: the mean loss with every token's summand multiplied by its weight (the
denominator stays the number of non-ignored tokens); the benchmark gates it against a weighted reference.

To add or change a variant of this project's op, edit ``FLCE_VARIANTS`` (name -> keyword arguments of
``lightning_flce.fused_linear_cross_entropy``; ``FLCE_NAMED_VARIANTS`` for rows that run only when named),
or pass ``--flce-variant NAME='{"chunk_size": 2048}'`` on the command line. ``flce_base`` is the op of
another commit, loaded beside this one (``make_baseline.py``). Everything is imported lazily inside
``build`` so a missing library only disables its row.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

LossFn = Callable[..., torch.Tensor]  # (x, W, t) -> loss; weighted providers: (x, W, t, token_weight)
IGNORE_INDEX = -100

# name -> kwargs for lightning_flce.fused_linear_cross_entropy. The lead adjusts these.
FLCE_VARIANTS: Dict[str, Dict[str, Any]] = {
    "flce": {},
    # Minimum-memory setting: dW accumulated in place in the weight's dtype ("param"), smaller chunks.
    "flce_minmem": {"chunk_size": 512, "accum_dtype": "param"},
}
# Timed samples of the slow named rows: the fp32 head runs fp32 GEMMs (TF32 off), ~15x the default's time, and
# its cost row has no tight goal; 4 samples keep the issue-18/23 run inside ~5 minutes.
FLCE_MAX_SAMPLES: Dict[str, int] = {"flce_fp32head": 4}
# Variants that run only when named (not part of `--providers all`): the logits-precision options of issue 23.
FLCE_NAMED_VARIANTS: Dict[str, Dict[str, Any]] = {
    # Each chunk's logits kept in fp32 (the 16-bit GEMM accumulates and writes fp32).
    "flce_fp32logits": {"logits_precision": "fp32"},
    # The same with the logits GEMM's sum over H in short tensor-core chains (a Triton GEMM, 1.12-1.22x the
    # fp32-output GEMM's time in run89).
    "flce_fp32comp": {"logits_precision": "fp32_compensated"},
    # The head's GEMMs themselves in fp32 (an fp32 head).
    "flce_fp32head": {"logits_precision": "fp32_head"},
}
# Named rows of "fp32_compensated" (or of "precision") with its Triton GEMM at another launch configuration
# than the measured one ("config": fields of kernels.compensated_gemm.GemmConfig replaced), with the fp32 chunk
# buffer ("relative": engine.RELATIVE_16BIT_LOGITS off) and the GEMM's LSE partials feeding the chunk kernel
# ("lse_from_gemm": engine.LSE_FROM_LOGITS_GEMM on), or with the chunk
# kernel's exponentials chosen otherwise ("exp": "precise", libdevice's in both passes as until run88; "fast",
# the GPU's exp2 in both): to choose from whole-op times in one run.
FLCE_COMPENSATED_VARIANTS: Dict[str, Dict[str, Any]] = {
    # one program per tile, masked stores (the configuration of run80-run83)
    "flce_fp32comp_pertile": {"config": {"persistent": False, "tma_store": False}},
    # BK = 128, 3 stages: chains of 2 x 128 products (the default until run86: loss within 2.8-3.2e-6 of
    # float64), of 4 x 128 (run86-run88's), of 8 x 128 (fewer breaks of the MMA pipeline, a longer fp32 chain's
    # rounding: past 1e-5 in run87)
    "flce_fp32comp_c2": {"config": {"block_k": 128, "num_stages": 3, "chain_blocks": 2}},
    "flce_fp32comp_bk128": {"config": {"block_k": 128, "num_stages": 3, "chain_blocks": 4}},
    "flce_fp32comp_c8": {"config": {"block_k": 128, "num_stages": 3, "chain_blocks": 8}},
    # the measured BK = 64 chains of 8 x 64 with a sixth stage
    "flce_fp32comp_s6": {"config": {"num_stages": 6}},
    # the fp32 buffer with the chunk kernel's LSE from the GEMM's epilogue: one read of the fp32 logits, not two
    "flce_fp32comp_tilelse": {"lse_from_gemm": True, "relative": False},
    # libdevice's exp in the chunk kernel's gradient pass too (as until run88), for both wide-logits options
    "flce_fp32comp_preciseexp": {"exp": "precise"},
    "flce_fp32logits_preciseexp": {"exp": "precise", "precision": "fp32"},
    # the GPU's exp2 in the first pass too (run88: inside the spread, so not the library's rule)
    "flce_fp32comp_fastexp": {"exp": "fast"},
    # the compensated GEMM of run88 (128-row tiles over two warp groups, 5 stages, one program per SM)
    "flce_fp32comp_m128": {"config": {"block_m": 128, "num_warps": 8, "num_stages": 5, "programs_per_sm": 1}},
    # the warps' masked stores instead of the copy engine's; chains of 12 x 64 = 768 products (fewer drains)
    "flce_fp32comp_masked": {"config": {"tma_store": False}},
    "flce_fp32comp_c12": {"config": {"chain_blocks": 12}},
    # the fp32 chunk buffer holding its 16-bit gradient, two passes of the chunk kernel (the library's path
    # until the 16-bit relative logits, engine.RELATIVE_16BIT_LOGITS; run89's row "flce_fp32comp")
    "flce_fp32comp_rows": {"relative": False},
}

# Where benchmarks/fetch_peers.sh copies torch 2.13's pure-Python linear_cross_entropy modules.
DEFAULT_TORCH213_DIR = Path(__file__).resolve().parent.parent / ".whl" / "torch213"


@dataclass
class Provider:
    name: str
    description: str
    build: Callable[[torch.device], LossFn]
    needs_cuda: bool = False
    # Part of `--providers all`; the others run only when named.
    default: bool = True
    # fn(x, W, t, token_weight): gated against the token-weighted reference.
    weighted: bool = False
    # Timed samples at most (None: --samples): a slow row whose time has no tight goal need not pay them all.
    max_samples: Optional[int] = None
    # Filled by build_all(): the callable, or why it is unavailable.
    fn: Optional[LossFn] = field(default=None, repr=False)
    error: Optional[str] = None
    note: Optional[str] = None


# --------------------------------------------------------------------------------------------- naive
def _build_naive(device: torch.device) -> LossFn:
    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=IGNORE_INDEX)

    return fn


def _build_naive_token_weighted(device: torch.device) -> LossFn:
    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(F.linear(x, w).float(), t, ignore_index=IGNORE_INDEX, reduction="none")
        return (per_token * tw).sum() / (t != IGNORE_INDEX).sum()

    return fn


# --------------------------------------------------------------------------------------------- liger
def _build_liger(accum_dtype: Optional[torch.dtype]) -> Callable[[torch.device], LossFn]:
    def build(device: torch.device) -> LossFn:
        return _liger_fn(accum_dtype)

    return build


def _liger_fn(accum_dtype: Optional[torch.dtype]) -> LossFn:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    # 0.8.5: forward(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
    #   lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False,
    #   accum_dtype=None, ...) -> (loss, z_loss, token_accuracy, predicted_tokens). Defaults otherwise
    #   (accum_dtype=None: dW accumulated in W's dtype).
    params = list(inspect.signature(LigerFusedLinearCrossEntropyFunction.forward).parameters)
    expected = ["_input", "weight", "target", "bias", "ce_weight", "ignore_index", "lse_square_scale",
                "label_smoothing", "reduction", "softcap", "return_z_loss", "accum_dtype"]  # fmt: skip
    if params[1:13] != expected:
        raise RuntimeError(f"unexpected LigerFusedLinearCrossEntropyFunction.forward signature: {params}")

    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if accum_dtype is None:
            out = LigerFusedLinearCrossEntropyFunction.apply(x, w, t, None, None, IGNORE_INDEX)
        else:
            out = LigerFusedLinearCrossEntropyFunction.apply(
                x, w, t, None, None, IGNORE_INDEX, 0.0, 0.0, "mean", None, False, accum_dtype
            )
        return out[0] if isinstance(out, tuple) else out

    return fn


# ----------------------------------------------------------------------------------------------- cce
def _build_cce(filter_eps: Any) -> Callable[[torch.device], LossFn]:
    def build(device: torch.device) -> LossFn:
        from cut_cross_entropy import linear_cross_entropy

        if filter_eps == "default":

            def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return linear_cross_entropy(x, w, t)

        else:

            def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return linear_cross_entropy(x, w, t, filter_eps=filter_eps)

        return fn

    return build


# -------------------------------------------------------------------------------------- torch_native
_TORCH213: Dict[str, Any] = {}
_TORCH213_OP_NAMESPACE = "flce_bench_torch213"


def _load_source_module(name: str, path: Path, replace: Dict[str, str]) -> types.ModuleType:
    """Execute a copied .py file as module ``name`` (text substitutions applied first)."""
    source = path.read_text()
    for old, new in replace.items():
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses look their module up in sys.modules
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _load_torch213_copy(folder: Path) -> Dict[str, Any]:
    """Load torch 2.13's linear_cross_entropy{,_options}.py from ``folder`` (once per process).

    The custom-op namespace ``torch_nn`` is renamed so the copy cannot clash with a torch that already
    registers those ops (this is also how the copy path is tested on torch 2.13 itself).
    """
    if _TORCH213:
        return _TORCH213
    files = [folder / "linear_cross_entropy_options.py", folder / "linear_cross_entropy.py"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"missing {missing}; run benchmarks/fetch_peers.sh and carry .whl")
    opts_mod = _load_source_module("_flce_bench_torch213_lce_options", files[0], {})
    lce_mod = _load_source_module(
        "_flce_bench_torch213_lce", files[1], {'"torch_nn::': f'"{_TORCH213_OP_NAMESPACE}::'}
    )
    _TORCH213.update(options_cls=opts_mod.LinearCrossEntropyOptions, module=lce_mod)
    return _TORCH213


def _torch213_copy_loss(options_cls: Any, module: Any) -> LossFn:
    """Call the copied chunked op the way torch 2.13's F.linear_cross_entropy does for 2-D input,
    int64 targets, no bias, no class weight, reduction="mean", label_smoothing=0, default options."""
    options = options_cls()

    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        resolved = options._adjust(
            num_batches=x.shape[0],
            in_features=x.shape[1],
            num_classes=w.shape[0],
            dtype=x.dtype,
            device=x.device,
        )
        grad_on = torch.is_grad_enabled()
        return module._linear_cross_entropy_batch_chunked(
            x,
            w,
            t,
            None,  # linear_bias
            None,  # class weight
            "mean",
            IGNORE_INDEX,
            0.0,  # label_smoothing
            resolved.batch_chunk_size,
            resolved.acc_policy,
            resolved.acc_dtype,
            resolved.allow_retain_graph,
            x.requires_grad and grad_on,
            w.requires_grad and grad_on,
            False,  # no bias grad
        )[0]

    return fn


def _builtin_torch_lce() -> Optional[LossFn]:
    lce = getattr(F, "linear_cross_entropy", None)
    if lce is None or "options" not in inspect.signature(lce).parameters:
        return None
    from torch.nn import LinearCrossEntropyOptions

    options = LinearCrossEntropyOptions()

    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return lce(x, w, t, ignore_index=IGNORE_INDEX, options=options)

    return fn


def make_torch_native_builder(folder: Path, force_copy: bool) -> Callable[[torch.device], LossFn]:
    def build(device: torch.device) -> LossFn:
        if not force_copy:
            builtin = _builtin_torch_lce()
            if builtin is not None:
                TORCH_NATIVE_SOURCE["source"] = f"torch {torch.__version__} built-in"
                return builtin
        loaded = _load_torch213_copy(folder)
        version_file = folder / "SOURCE_TORCH_VERSION"
        src = version_file.read_text().strip() if version_file.is_file() else "2.13?"
        TORCH_NATIVE_SOURCE["source"] = f"copy of torch {src} modules on torch {torch.__version__}"
        return _torch213_copy_loss(loaded["options_cls"], loaded["module"])

    return build


TORCH_NATIVE_SOURCE: Dict[str, str] = {}


# --------------------------------------------------------------------------------------------- flce
def _build_flce(kwargs: Dict[str, Any]) -> Callable[[torch.device], LossFn]:
    def build(device: torch.device) -> LossFn:
        from _common import resolve_flce_kwargs

        from lightning_flce import fused_linear_cross_entropy

        def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return fused_linear_cross_entropy(x, w, t, **resolve_flce_kwargs(kwargs, w.dtype))

        return fn

    return build


def _build_flce_compensated(variant: Dict[str, Any]) -> Callable[[torch.device], LossFn]:
    """``logits_precision="fp32_compensated"`` (or ``variant["precision"]``) with the compensated GEMM's launch
    configuration changed, the engine's LSE-from-GEMM switch set and/or the chunk kernel's exponentials chosen
    otherwise, for the duration of each call (the library has none of them as an option: its configuration is
    the measured one)."""

    def build(device: torch.device) -> LossFn:
        from lightning_flce import engine
        from lightning_flce.kernels import compensated_gemm
        from lightning_flce.kernels import cross_entropy as chunk_kernel

        precision = variant.get("precision", "fp32_compensated")
        plain = _build_flce({"logits_precision": precision})(device)
        measured = compensated_gemm.launch_config
        replace = variant.get("config", {})
        lse_from_gemm = variant.get("lse_from_gemm", engine.LSE_FROM_LOGITS_GEMM)
        relative = variant.get("relative", engine.RELATIVE_16BIT_LOGITS)
        rule = chunk_kernel.exp_precision
        exp_rule = {
            "precise": lambda logits_dtype, grad_dtype: (logits_dtype == torch.float32,) * 2,
            "fast": lambda logits_dtype, grad_dtype: (False, False),
        }.get(variant.get("exp"), rule)

        def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            default, default_relative = engine.LSE_FROM_LOGITS_GEMM, engine.RELATIVE_16BIT_LOGITS
            compensated_gemm.launch_config = lambda dev: measured(dev)._replace(**replace)
            engine.LSE_FROM_LOGITS_GEMM = lse_from_gemm
            engine.RELATIVE_16BIT_LOGITS = relative
            chunk_kernel.exp_precision = exp_rule
            try:
                return plain(x, w, t)
            finally:
                compensated_gemm.launch_config = measured
                engine.LSE_FROM_LOGITS_GEMM = default
                engine.RELATIVE_16BIT_LOGITS = default_relative
                chunk_kernel.exp_precision = rule

        return fn

    return build


def _build_flce_token_weighted(device: torch.device) -> LossFn:
    """The op with ``token_weight=`` (issue 18: the fast path, gradients computed in forward)."""
    from lightning_flce import fused_linear_cross_entropy

    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(x, w, t, token_weight=tw)

    return fn


def _build_flce_none_times_weight(device: torch.device) -> LossFn:
    """What a user writes without ``token_weight=``: per-token losses (the recompute path), then the weights."""
    from lightning_flce import fused_linear_cross_entropy

    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
        per_token = fused_linear_cross_entropy(x, w, t, reduction="none")
        return (per_token * tw).sum() / (t != IGNORE_INDEX).sum()

    return fn


# ------------------------------------------------------------------------------------------ flce_base
# Where benchmarks/make_baseline.py writes the renamed copy (an ignored folder, carried to the GPU).
DEFAULT_BASELINE_DIR = Path(__file__).resolve().parent.parent / ".baseline"


def _build_flce_base(baseline_dir: Path, baseline_commit: Optional[str]) -> Callable[[torch.device], LossFn]:
    """The op of another commit with defaults, as package ``lightning_flce_base`` in this process.

    With ``baseline_commit`` the package is materialized from git first (into a temporary folder); otherwise
    it is read from ``baseline_dir`` (written by ``make_baseline.py``; the device machine has no git history).
    """

    def build(device: torch.device) -> LossFn:
        import tempfile

        import make_baseline

        folder = baseline_dir
        if baseline_commit:
            folder = Path(tempfile.mkdtemp(prefix="flce_base_"))
            make_baseline.materialize(baseline_commit, folder)
        module = make_baseline.import_baseline(folder)
        BASELINE_SOURCE["source"] = make_baseline.describe(folder)

        def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return module.fused_linear_cross_entropy(x, w, t)

        return fn

    return build


BASELINE_SOURCE: Dict[str, str] = {}


# ---------------------------------------------------------------------------------------- registry
def make_providers(
    flce_variants: Optional[Dict[str, Dict[str, Any]]] = None,
    torch213_dir: Path = DEFAULT_TORCH213_DIR,
    force_torch213_copy: bool = False,
    baseline_dir: Path = DEFAULT_BASELINE_DIR,
    baseline_commit: Optional[str] = None,
) -> List[Provider]:
    """All providers in table order."""
    variants = dict(FLCE_VARIANTS if flce_variants is None else flce_variants)
    for name, kwargs in FLCE_NAMED_VARIANTS.items():
        variants.setdefault(name, kwargs)
    providers = [
        Provider("naive", "F.cross_entropy(F.linear(x, W).float(), t): full [N, V] logits", _build_naive),
        Provider(
            "liger", "Liger-Kernel LigerFusedLinearCrossEntropyFunction (defaults)", _build_liger(None), True
        ),
        Provider(
            "liger_fp32acc",
            "Liger-Kernel with accum_dtype=torch.float32 (dW accumulated in fp32); only when named",
            _build_liger(torch.float32),
            True,
            default=False,
        ),
        Provider(
            "cce",
            "cut-cross-entropy linear_cross_entropy (default filter_eps='high')",
            _build_cce("default"),
            True,
        ),
        Provider(
            "cce_exact", "cut-cross-entropy linear_cross_entropy(filter_eps=None)", _build_cce(None), True
        ),
        Provider(
            "torch_native",
            "torch 2.13 F.linear_cross_entropy(options=LinearCrossEntropyOptions())",
            make_torch_native_builder(torch213_dir, force_torch213_copy),
        ),
    ]
    for name, kwargs in variants.items():
        desc = (
            "lightning_flce.fused_linear_cross_entropy("
            + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            + ")"
        )
        providers.append(
            Provider(
                name,
                desc,
                _build_flce(kwargs),
                default=name not in FLCE_NAMED_VARIANTS,
                max_samples=FLCE_MAX_SAMPLES.get(name),
            )
        )
    for name, variant in FLCE_COMPENSATED_VARIANTS.items():
        desc = (
            "lightning_flce.fused_linear_cross_entropy(logits_precision="
            f"{variant.get('precision', 'fp32_compensated')!r}) with {variant}; only when named"
        )
        providers.append(Provider(name, desc, _build_flce_compensated(variant), True, default=False))
    providers += [
        Provider(
            "flce_base",
            "lightning_flce.fused_linear_cross_entropy() of the baseline commit (lightning_flce_base); only when"
            " named",
            _build_flce_base(baseline_dir, baseline_commit),
            default=False,
        ),
        Provider(
            "naive_tw",
            "(F.cross_entropy(F.linear(x, W).float(), t, reduction='none') * w).sum() / n_valid; only when named",
            _build_naive_token_weighted,
            default=False,
            weighted=True,
        ),
        Provider(
            "flce_tw",
            "lightning_flce.fused_linear_cross_entropy(x, W, t, token_weight=w); only when named",
            _build_flce_token_weighted,
            default=False,
            weighted=True,
        ),
        Provider(
            "flce_none_x_w",
            "(lightning_flce.fused_linear_cross_entropy(x, W, t, reduction='none') * w).sum() / n_valid; only"
            " when named",
            _build_flce_none_times_weight,
            default=False,
            weighted=True,
        ),
    ]
    return providers


def build_all(providers: List[Provider], device: torch.device) -> None:
    """Build each provider once; record why one is unavailable instead of raising."""
    from _common import short_error

    for p in providers:
        if p.needs_cuda and device.type != "cuda":
            p.error = "skipped: needs CUDA"
            continue
        try:
            p.fn = p.build(device)
        except Exception as exc:  # noqa: BLE001 - a missing peer library disables only its rows
            p.error = "unavailable: " + short_error(exc)
        if p.name == "torch_native":
            p.note = TORCH_NATIVE_SOURCE.get("source")
        if p.name == "flce_base":
            p.note = BASELINE_SOURCE.get("source")
