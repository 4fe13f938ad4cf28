"""The compensated logits GEMM (``lightning_flce/kernels/compensated_gemm.py``, ``logits_precision=
"fp32_compensated"``): the kernel through Triton's interpreter against the float64 product, the op's Triton path
with it, and the launcher's argument checks (those run in the normal invocation: they raise before any launch).

The interpreter tests run as test_triton_interpret.py's do (TRITON_INTERPRET must be set before triton is
imported):

    TRITON_INTERPRET=1 pytest -m interpret tests/test_compensated_gemm.py

Tolerance of the kernel: the products of bf16/fp16 values are exact in fp32 (8 + 8 and 11 + 11 significant
bits), so the error is the sums' rounding: each 16-long block's fp32 dot, the Kahan-compensated sum of the
blocks (about one rounding of the result, 0.5 ulp) and the bias add (0.5 ulp). 4 ulps of fp32 at max |logit|
bounds them with room; a wrong mask, stride or tail shows as an error of the size of the logits themselves.
"""

from __future__ import annotations

import pytest
import torch
from reference import grads_of, reference_loss, relative_error

from lightning_flce import fused_linear_cross_entropy

# (M, N, K): tails along all three (37 rows, 203 columns, K = 4 blocks + 6), a divisible one, K past many
# blocks with a tail (the compensated sum over 65 blocks), and single rows / columns / K = 1.
SHAPES = [(37, 203, 70), (32, 64, 48), (20, 40, 1030), (5, 3, 1), (1, 17, 33)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ULPS = 4


def fp32_ulp(value: torch.Tensor) -> float:
    """The spacing of fp32 numbers at |value| (2^(e - 24) for |value| in [2^(e - 1), 2^e))."""
    return 2.0 ** (torch.frexp(value.abs().max().double()).exponent.item() - 24)


def gemm_problem(m, n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5 * 4).to(dtype)
    b = torch.randn(n, generator=gen)
    return x, w, b


@pytest.mark.interpret
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_float64(shape, dtype_name, with_bias):
    from lightning_flce.kernels.compensated_gemm import compensated_logits_mm

    m, n, k = shape
    x, w, b = gemm_problem(m, n, k, DTYPES[dtype_name])
    bias = b if with_bias else None
    out = torch.full((m, n), float("nan"))
    assert compensated_logits_mm(x, w, out, bias) is out
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0.0)
    error = (out.double() - exact).abs().max().item()
    assert error <= ULPS * fp32_ulp(exact), (error, fp32_ulp(exact))


@pytest.mark.interpret
@pytest.mark.parametrize("chain_blocks", [2, 3])
@pytest.mark.parametrize("shape", [(37, 203, 70), (20, 40, 1030)], ids=lambda s: "x".join(map(str, s)))
def test_kernel_chains_blocks_and_flushes_the_last_chain(shape, chain_blocks):
    """``chain_blocks`` > 1: the MMA chains that many K blocks before each compensated addition, and the last,
    shorter chain (K = 70: 5 blocks of 16; K = 1030: 65) is added too. A chain not reset after its addition
    counts blocks twice, a last chain not added drops them: both errors of the size of the logits."""
    from lightning_flce.kernels.compensated_gemm import INTERPRET_CONFIG, compensated_logits_mm

    m, n, k = shape
    x, w, b = gemm_problem(m, n, k, torch.bfloat16, seed=2)
    out = torch.full((m, n), float("nan"))
    compensated_logits_mm(x, w, out, b, config=INTERPRET_CONFIG._replace(chain_blocks=chain_blocks))
    exact = x.double() @ w.double().T + b.double()
    error = (out.double() - exact).abs().max().item()
    assert error <= ULPS * fp32_ulp(exact), (error, fp32_ulp(exact))


@pytest.mark.interpret
@pytest.mark.parametrize("chain_blocks", [2, 3])
@pytest.mark.parametrize("shape", [(37, 203, 70), (20, 40, 1030)], ids=lambda s: "x".join(map(str, s)))
def test_kernel_plain_sum_of_chains(shape, chain_blocks):
    """``kahan=False``: the chains' sums added plainly. Each of the ceil(K / (16 chain_blocks)) additions
    rounds by at most half an ulp of the running sum, so the bound grows by that many half ulps; a chain
    added twice or dropped is still an error of the size of the logits."""
    from lightning_flce.kernels.compensated_gemm import INTERPRET_CONFIG, compensated_logits_mm

    m, n, k = shape
    x, w, b = gemm_problem(m, n, k, torch.bfloat16, seed=3)
    out = torch.full((m, n), float("nan"))
    config = INTERPRET_CONFIG._replace(chain_blocks=chain_blocks, kahan=False)
    compensated_logits_mm(x, w, out, b, config=config)
    exact = x.double() @ w.double().T + b.double()
    additions = -(-k // (INTERPRET_CONFIG.block_k * chain_blocks))
    bound = (ULPS + 0.5 * additions) * fp32_ulp(exact)
    assert (out.double() - exact).abs().max().item() <= bound


def spy_on_tma_kernel(gemm, monkeypatch):
    """Replace the TMA kernel by a spy that launches it and records (grid, TMA_STORE) of every launch."""
    launched = []
    kernel = gemm._compensated_mm_tma_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((grid, kwargs["TMA_STORE"]))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(gemm, "_compensated_mm_tma_kernel", Spy())
    return launched


# How the TMA kernel walks and stores its tiles: one program per tile with masked stores (the plain launch),
# one program per SM (the interpreter: 3) walking several tiles, and that with the copy engine's stores.
TILE_LOOPS = {
    "per-tile": {},
    "persistent": {"persistent": True},
    "persistent-store": {"persistent": True, "tma_store": True},
}


@pytest.mark.interpret
@pytest.mark.parametrize("loop", list(TILE_LOOPS))
@pytest.mark.parametrize(
    ("chain_blocks", "kahan"), [(1, True), (3, True), (2, False)], ids=["kahan", "kahan-c3", "plain-c2"]
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    "shape", [(37, 203, 72), (32, 64, 48), (20, 40, 1032), (1, 17, 8), (45, 52, 24)], ids=str
)
def test_tma_kernel_matches_float64(shape, with_bias, chain_blocks, kahan, loop, monkeypatch):
    """``tma=True``: the operand blocks through tensor descriptors (the copy engine's zero fill past M, N and
    K instead of masks: tails along all three here, K a multiple of 8 as TMA needs), the same chains and sums
    as the pointer kernel and the same bound against float64, for each way of walking and storing the tiles
    (a persistent program that does not reset its sums between tiles, or skips or repeats one, is off by the
    logits' size). The TMA kernel must be the one that ran, with the store asked for where out's rows are
    16-byte aligned (N = 64, 40, 52 here) and the masked store where not (N = 203, 17)."""
    import lightning_flce.kernels.compensated_gemm as gemm

    launched = spy_on_tma_kernel(gemm, monkeypatch)
    m, n, k = shape
    x, w, b = gemm_problem(m, n, k, torch.bfloat16, seed=4)
    bias = b if with_bias else None
    out = torch.full((m, n), float("nan"))
    config = gemm.INTERPRET_CONFIG._replace(
        tma=True, chain_blocks=chain_blocks, kahan=kahan, **TILE_LOOPS[loop]
    )
    gemm.compensated_logits_mm(x, w, out, bias, config=config)
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    programs = min(tiles, gemm.INTERPRET_PROGRAMS) if config.persistent else tiles
    assert launched == [((programs,), config.tma_store and n % 4 == 0)]
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0.0)
    additions = 0 if kahan else -(-k // (config.block_k * chain_blocks))
    bound = (ULPS + 0.5 * additions) * fp32_ulp(exact)
    assert (out.double() - exact).abs().max().item() <= bound


@pytest.mark.interpret
def test_tma_config_without_tensor_descriptors_takes_the_pointer_kernel(monkeypatch):
    """A Triton without host-side tensor descriptors (before 3.3; the package supports older ones): the TMA
    configuration runs the pointer kernel, with the same result bound, instead of failing to import."""
    import lightning_flce.kernels.compensated_gemm as gemm

    def refuse(*args, **kwargs):
        raise AssertionError("the TMA kernel launched")

    monkeypatch.setattr(gemm, "_tensor_descriptor", lambda: None)
    monkeypatch.setattr(gemm, "_compensated_mm_tma_kernel", refuse)
    x, w, b = gemm_problem(37, 203, 72, torch.bfloat16, seed=5)
    assert not gemm.tma_usable(x, w)
    out = torch.full((37, 203), float("nan"))
    config = gemm.INTERPRET_CONFIG._replace(tma=True, chain_blocks=2, kahan=False)
    gemm.compensated_logits_mm(x, w, out, b, config=config)
    exact = x.double() @ w.double().T + b.double()
    additions = -(-72 // (config.block_k * config.chain_blocks))
    assert (out.double() - exact).abs().max().item() <= (ULPS + 0.5 * additions) * fp32_ulp(exact)


@pytest.mark.interpret
def test_tma_needs_aligned_rows():
    """TMA reads 16-byte aligned rows from a 16-byte aligned base: rows of K = 70 bf16 values (140 bytes) or a
    base one element off are neither, and the launcher takes the pointer kernel there."""
    from lightning_flce.kernels.compensated_gemm import tma_usable

    x, w, _ = gemm_problem(8, 16, 72, torch.bfloat16)
    if not tma_usable(x, w):
        pytest.skip("no TMA on this device (the interpreter or a Hopper GPU has it)")
    x70, w70, _ = gemm_problem(8, 16, 70, torch.bfloat16)
    assert not tma_usable(x70, w70)
    off_by_one = torch.cat([x.view(-1), x.view(-1)])[1 : 1 + 8 * 72].view(8, 72)
    assert not tma_usable(off_by_one, w)


@pytest.mark.interpret
def test_tma_store_writes_only_the_rows_of_a_slice(monkeypatch):
    """The copy engine's store into ``out``, a row slice of a larger buffer with M and N tails (37 x 52: 12
    tiles of 16 x 16 over 3 persistent programs): every element of the slice is the product, and the rows
    around it are not written (the descriptor's shape, not the buffer's, bounds the store)."""
    import lightning_flce.kernels.compensated_gemm as gemm

    launched = spy_on_tma_kernel(gemm, monkeypatch)
    m, n, k = 37, 52, 40
    x, w, b = gemm_problem(m, n, k, torch.bfloat16, seed=6)
    buffer = torch.full((m + 4, n), float("nan"))
    out = buffer[1 : m + 1]
    config = gemm.INTERPRET_CONFIG._replace(
        tma=True, chain_blocks=2, kahan=False, persistent=True, tma_store=True
    )
    gemm.compensated_logits_mm(x, w, out, b, config=config)
    assert launched == [((3,), True)]
    exact = x.double() @ w.double().T + b.double()
    additions = -(-k // (config.block_k * config.chain_blocks))
    assert (out.double() - exact).abs().max().item() <= (ULPS + 0.5 * additions) * fp32_ulp(exact)
    assert buffer[0].isnan().all() and buffer[m + 1 :].isnan().all()


def tile_lse_reference(out, n_tiles, block_n, softcap):
    """float64 max and sum(exp(z - max)) per row and block_n-wide column tile of the stored fp32 logits."""
    z = out.double()
    if softcap > 0.0:
        z = softcap * torch.tanh(z / softcap)
    pad = n_tiles * block_n - z.shape[1]
    z = torch.nn.functional.pad(z, (0, pad), value=float("-inf")).view(z.shape[0], n_tiles, block_n)
    tile_max = z.amax(dim=2)
    ref = torch.where(tile_max == float("-inf"), torch.zeros_like(tile_max), tile_max)
    return tile_max, (z - ref[..., None]).exp().sum(dim=2)


@pytest.mark.interpret
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize("loop", ["per-tile", "persistent-store", "pointer"])
def test_epilogue_writes_each_tiles_lse_partials(loop, softcap):
    """``tile_lse``: per row and 16-wide column tile, the max and sum(exp(z - max)) of the logits as stored
    (bias included, through the softcap), against float64 from ``out`` itself: 37 x 203 (M and N tails: the
    last tile has 11 columns), a bias masking one whole tile to -inf (its max -inf, its sum 0, no NaN; -softcap
    through a softcap), a
    row slice of a larger partial buffer (rows past M untouched). The TMA kernel per tile and persistent with
    the store, and the pointer kernel (K = 70: no TMA)."""
    import lightning_flce.kernels.compensated_gemm as gemm

    m, n = 37, 203
    k = 70 if loop == "pointer" else 72
    x, w, b = gemm_problem(m, n, k, torch.bfloat16, seed=7)
    b[16:32] = float("-inf")
    config = gemm.INTERPRET_CONFIG._replace(chain_blocks=2, kahan=False)
    if loop != "pointer":
        config = config._replace(tma=True, **TILE_LOOPS[loop])
    buffers = gemm.empty_tile_lse(m + 3, n, x.device, softcap, config=config)
    buffers.max.fill_(float("nan"))
    buffers.sum_exp.fill_(float("nan"))
    out = torch.full((m, n), float("nan"))
    gemm.compensated_logits_mm(x, w, out, b, config=config, tile_lse=buffers.rows(m))
    n_tiles = -(-n // config.block_n)
    want_max, want_sum = tile_lse_reference(out, n_tiles, config.block_n, softcap)
    got_max, got_sum = buffers.max[:m].double(), buffers.sum_exp[:m].double()
    if softcap == 0.0:  # (a softcap maps -inf to -softcap, in the chunk kernel as here)
        assert (got_max[:, 1] == float("-inf")).all() and (got_sum[:, 1] == 0).all()
    finite = want_max != float("-inf")
    assert torch.allclose(got_max[finite], want_max[finite], rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_sum, want_sum, rtol=1e-5, atol=0)
    assert buffers.max[m:].isnan().all() and buffers.sum_exp[m:].isnan().all()


# The chunk kernel's options of the tests below (the "options" parameter) and their problem.
CHUNK_OPTIONS = [{}, {"softcap": 15.0, "lse_square_scale": 1e-3}, {"class_weight": True}]


def chunk_problem(options, seed):
    """37 x 203 (M and N tails), K = 72, bf16, every 7th target ignored, the options as the chunk kernel takes
    them, and the TMA kernel's persistent configuration with the copy engine's stores."""
    import lightning_flce.kernels.compensated_gemm as gemm
    from lightning_flce.losses.cross_entropy import kernel_options

    m, n, k = 37, 203, 72
    x, w, b = gemm_problem(m, n, k, torch.bfloat16, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, n, (m,), generator=gen)
    target[::7] = -100
    class_weight = torch.rand(n, generator=gen) + 0.5 if options.get("class_weight") else None
    opts = kernel_options(
        -100,
        0.0,
        options.get("lse_square_scale", 0.0),
        options.get("softcap", 0.0),
        class_weight,
        torch.bfloat16,
    )
    config = gemm.INTERPRET_CONFIG._replace(
        chain_blocks=2, kahan=False, tma=True, persistent=True, tma_store=True
    )
    return x, w, b, target, opts, config


@pytest.mark.interpret
@pytest.mark.parametrize("options", CHUNK_OPTIONS, ids=["plain", "softcap-zloss", "class-weight"])
def test_chunk_kernel_takes_the_lse_from_the_tiles(options):
    """The chunk kernel with the GEMM's partials (no first pass over the logits) gives the loss, LSE and
    gradient it gives from the logits (fp32 sums in another order: within 2e-6), ignored rows included; and
    refuses partials of another softcap or with label smoothing or statistics (they need the first pass)."""
    import lightning_flce.kernels.compensated_gemm as gemm
    from lightning_flce.kernels.cross_entropy import cross_entropy_chunk_triton

    m, n = 37, 203
    x, w, b, target, opts, config = chunk_problem(options, seed=8)
    partials = gemm.empty_tile_lse(m, n, x.device, opts.softcap, config=config)
    logits = torch.empty(m, n)
    gemm.compensated_logits_mm(x, w, logits, b, config=config, tile_lse=partials)
    scale = torch.ones(1)
    kwargs = {"ce_scale": scale, "z_scale": scale, "compute_grad": True, "compute_stats": False}
    from_rows = logits.clone()
    want = cross_entropy_chunk_triton(from_rows, target, opts, **kwargs)
    from_tiles = logits.clone()
    got = cross_entropy_chunk_triton(from_tiles, target, opts, tile_lse=partials, **kwargs)
    assert (got.lse - want.lse).abs().max() <= 2e-6
    assert (got.loss - want.loss).abs().max() <= 2e-6
    assert (from_tiles - from_rows).abs().max() <= 2e-6  # the gradients, in place
    with pytest.raises(ValueError, match="first pass"):
        cross_entropy_chunk_triton(
            logits.clone(), target, opts._replace(label_smoothing=0.1), tile_lse=partials, **kwargs
        )
    with pytest.raises(ValueError, match="first pass"):
        cross_entropy_chunk_triton(
            logits.clone(), target, opts, tile_lse=partials, **{**kwargs, "compute_stats": True}
        )
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy_chunk_triton(
            logits.clone(), target, opts._replace(softcap=opts.softcap + 1.0), tile_lse=partials, **kwargs
        )


@pytest.mark.interpret
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize("loop", ["per-tile", "persistent-store", "pointer"])
def test_epilogue_stores_relative_16bit_logits_and_target_logits(loop, softcap, dtype_name):
    """A 16-bit ``out`` with ``tile_lse`` and ``target``: every stored value is the fp32 logit (bias, softcap)
    minus its row's tile maximum, rounded once to out's dtype (within half its ulp of the float64 difference, plus
    a few fp32 ulps of the logits), a tile masked to -inf by the bias stores -inf (its maximum -inf: 0 subtracted);
    the partials are those of the same GEMM into fp32, and ``target_logit`` is each row's logit at its target
    column (through the softcap) within 1e-6 of float64's, rows with target -100 untouched. 37 x 203 (M and N tails), the TMA kernel per
    tile and persistent with the copy engine's store, and the pointer kernel (K = 70: no TMA)."""
    import lightning_flce.kernels.compensated_gemm as gemm

    dtype = DTYPES[dtype_name]
    m, n = 37, 203
    k = 70 if loop == "pointer" else 72
    x, w, b = gemm_problem(m, n, k, dtype, seed=11)
    b[16:32] = float("-inf")
    gen = torch.Generator().manual_seed(12)
    target = torch.randint(0, n, (m,), generator=gen)
    target[::6] = -100
    target[1] = 20  # a target in the masked tile: its logit is -inf (or -softcap)
    config = gemm.INTERPRET_CONFIG._replace(chain_blocks=2, kahan=False)
    if loop != "pointer":
        config = config._replace(tma=True, **TILE_LOOPS[loop])
    fp32_partials = gemm.empty_tile_lse(m, n, x.device, softcap, config=config)
    exact = gemm.compensated_logits_mm(x, w, torch.empty(m, n), b, config=config, tile_lse=fp32_partials)
    partials = gemm.empty_tile_lse(m, n, x.device, softcap, config=config, with_target_logit=True)
    partials.target_logit.fill_(float("nan"))
    out = torch.full((m, n), float("nan"), dtype=dtype)
    gemm.compensated_logits_mm(x, w, out, b, config=config, tile_lse=partials, target=target)

    assert torch.equal(partials.max, fp32_partials.max) and torch.equal(
        partials.sum_exp, fp32_partials.sum_exp
    )
    z = exact.double()
    if softcap > 0.0:
        z = softcap * torch.tanh(z / softcap)
    tile_max = partials.max.double().repeat_interleave(config.block_n, dim=1)[:, :n]
    relative = z - torch.where(tile_max == float("-inf"), torch.zeros_like(tile_max), tile_max)
    finite = relative.isfinite()
    # One rounding: half an ulp of the 16-bit value, a whole one for bf16 here (Triton's interpreter truncates
    # fp32 -> bf16; the GPU rounds to nearest, test_cuda_compensated_gemm_relative_logits_and_target_logits).
    rounding = torch.finfo(dtype).eps / (1 if dtype == torch.bfloat16 else 2)
    bound = rounding * relative[finite].abs() + ULPS * fp32_ulp(z[finite])
    assert ((out.double()[finite] - relative[finite]).abs() <= bound).all()
    assert torch.equal(out[~finite].double(), relative[~finite])  # the masked tile's -inf
    if softcap == 0.0:
        assert (~finite[:, 16:32]).all()
    valid = target != -100
    # target_logits' own fp32 dot product against float64's (exact products, a few ulps of rounding)
    want = (x[valid].double() * w[target[valid]].double()).sum(-1) + b[target[valid]].double()
    if softcap > 0.0:
        want = softcap * torch.tanh(want / softcap)
    got = partials.target_logit[valid].double()
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.allclose(got[want.isfinite()], want[want.isfinite()], rtol=1e-6, atol=1e-6)
    assert partials.target_logit[~valid].isnan().all()


@pytest.mark.interpret
@pytest.mark.parametrize("options", CHUNK_OPTIONS, ids=["plain", "softcap-zloss", "class-weight"])
def test_chunk_kernel_on_relative_logits(options):
    """The chunk kernel on the GEMM's 16-bit relative logits (its epilogue's partials, target_logits' logits):
    loss and LSE within 2e-6 of the kernel on the same GEMM's fp32 logits (fp32 values throughout), ignored rows
    included; the gradient within bf16's rounding of the relative values (an ulp of |z - tile max| times each
    element's probability term, plus the bf16 output's own ulp) of the fp32 logits' gradient; and refused without the
    target logits (the row holds no exact one)."""
    import lightning_flce.kernels.compensated_gemm as gemm
    from lightning_flce.kernels.cross_entropy import cross_entropy_chunk_triton

    m, n = 37, 203
    x, w, b, target, opts, config = chunk_problem(options, seed=13)
    fp32_partials = gemm.empty_tile_lse(m, n, x.device, opts.softcap, config=config)
    logits = gemm.compensated_logits_mm(x, w, torch.empty(m, n), b, config=config, tile_lse=fp32_partials)
    partials = gemm.empty_tile_lse(m, n, x.device, opts.softcap, config=config, with_target_logit=True)
    relative = torch.empty(m, n, dtype=torch.bfloat16)
    gemm.compensated_logits_mm(x, w, relative, b, config=config, tile_lse=partials, target=target)
    scale = torch.full((1,), 1.0 / m)
    kwargs = {"ce_scale": scale, "z_scale": scale, "compute_grad": True, "compute_stats": False}
    fp32_grad = torch.empty(m, n)
    want = cross_entropy_chunk_triton(logits.clone(), target, opts, grad_out=fp32_grad, **kwargs)
    got = cross_entropy_chunk_triton(relative, target, opts, tile_lse=partials, **kwargs)
    assert (got.lse - want.lse).abs().max() <= 2e-6
    assert (got.loss - want.loss).abs().max() <= ULPS * fp32_ulp(want.loss)  # fp32 sums in another order
    z = logits.double()
    if opts.softcap > 0.0:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    tile_max = partials.max.double().repeat_interleave(config.block_n, dim=1)[:, :n]
    # bf16 rounding of the relative value (carried into exp) and of the gradient itself, a whole ulp each (2^-7
    # relative: the interpreter truncates fp32 -> bf16, the GPU rounds to nearest), plus the fp32 path's own ulps.
    prob_term = (z - want.lse.double()[:, None]).exp() / m * (2 if opts.class_weight is not None else 1)
    # The softcap's factor 1 - (z / c)^2 moves by 2 |z| / c^2 per unit of z as well.
    ulp = torch.finfo(torch.bfloat16).eps
    slope = 1.0 + (2.0 * z.abs() / opts.softcap**2 if opts.softcap > 0.0 else 0.0)
    bound = ulp * ((z - tile_max).abs() * slope + 1.0) * prob_term + ulp * fp32_grad.double().abs() + 1e-7
    assert ((relative.double() - fp32_grad.double()).abs() <= bound).all()
    assert (relative[::7] == 0).all()  # ignored rows: zero gradient
    with pytest.raises(ValueError, match="needs target_logit"):
        cross_entropy_chunk_triton(
            relative.clone(), target, opts, tile_lse=partials._replace(target_logit=None), **kwargs
        )


def op_problem(seed, reduction):
    """A small bf16 head problem for the op's Triton path: 40 tokens (every 9th ignored), H = 48, V = 203 (an N
    tail), logits of std ~3, a bias; a grad_output for "none"."""
    gen = torch.Generator().manual_seed(seed)
    n, h, v = 40, 48, 203
    x = torch.randn(n, h, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=gen) / h**0.5 * 3).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(v, generator=gen)).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    t[::9] = -100
    grad_output = torch.randn(n, generator=gen) if reduction == "none" else None
    return x, w, b, t, grad_output


def op_grads(problem, **kwargs):
    """(loss, (dX, dW, d bias)) of the op in chunks of 16 rows."""
    x, w, b, t, grad_output = problem
    return grads_of(
        lambda *a: fused_linear_cross_entropy(*a[:2], t, a[2], chunk_size=16, **kwargs),
        x,
        w,
        b,
        grad_output=grad_output,
    )


def float64_grads(problem, **options):
    """The float64 reference's (loss, gradients)."""
    x, w, b, t, grad_output = problem
    return grads_of(
        lambda *a: reference_loss(*a[:2], t, a[2], **options),
        x.double(),
        w.double(),
        b.double(),
        grad_output=grad_output,
    )


@pytest.mark.interpret
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_op_can_take_the_lse_from_the_gemm(monkeypatch, reduction):
    """With ``engine.LSE_FROM_LOGITS_GEMM`` on (and the fp32 buffer: ``RELATIVE_16BIT_LOGITS`` off),
    ``"fp32_compensated"`` on the Triton path hands every chunk's GEMM partials to the chunk kernel (softcap, bias,
    ignored rows, three chunks; "none" recomputes in its backward): per-token loss within 1e-5 of float64 and
    within 2e-6 of the same op without them, gradients as accurate. Label smoothing or statistics keep the first
    pass (no partials made)."""
    import lightning_flce.engine as engine
    import lightning_flce.kernels.cross_entropy as ce

    monkeypatch.setattr(engine, "RELATIVE_16BIT_LOGITS", False)
    monkeypatch.setattr(engine, "LSE_FROM_LOGITS_GEMM", True)
    handed = []
    launch = ce.cross_entropy_chunk_triton

    def spy(*args, tile_lse=None, **kwargs):
        handed.append(tile_lse is not None)
        return launch(*args, tile_lse=tile_lse, **kwargs)

    monkeypatch.setattr(ce, "cross_entropy_chunk_triton", spy)
    problem = op_problem(10, reduction)
    options = {"softcap": 15.0, "reduction": reduction}

    def fused(**extra):
        return op_grads(problem, logits_precision="fp32_compensated", impl="triton", **options, **extra)

    want = float64_grads(problem, **options)
    got = fused()
    assert handed and all(handed)
    assert (got[0].double() - want[0]).abs().max() <= 1e-5
    handed.clear()
    monkeypatch.setattr(engine, "LSE_FROM_LOGITS_GEMM", False)
    two_pass = fused()
    assert handed and not any(handed)
    assert (got[0] - two_pass[0]).abs().max() <= 2e-6
    for g, d, ref in zip(got[1], two_pass[1], want[1]):
        assert relative_error(g, ref) <= 1.01 * relative_error(d, ref) + 1e-6
    monkeypatch.setattr(engine, "LSE_FROM_LOGITS_GEMM", True)
    handed.clear()
    fused(label_smoothing=0.05)
    assert handed and not any(handed)


@pytest.mark.interpret
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_op_runs_on_relative_16bit_logits(monkeypatch, reduction):
    """``"fp32_compensated"`` on the Triton path (``engine.RELATIVE_16BIT_LOGITS``, the default): every chunk's
    buffer is 16-bit (the default's, no fp32 [C, V] buffer) and the chunk kernel gets the GEMM's partials with the
    target logits (softcap, z-loss, bias, ignored rows, three chunks; "none" recomputes in its backward). The
    per-token loss is within 1e-5 of float64 and within 2e-6 of the fp32 buffer's (``RELATIVE_16BIT_LOGITS``
    off), dX / dW / d bias within 1.05x its error and no worse than the default's (all rounded to bf16 at the
    end). Label smoothing and statistics take the fp32 buffer (their sums need every logit), as vocabularies under
    ``engine.RELATIVE_MIN_VOCAB`` do."""
    import lightning_flce.engine as engine
    import lightning_flce.kernels.cross_entropy as ce

    monkeypatch.setattr(engine, "RELATIVE_MIN_VOCAB", 0)  # the problem's V = 203
    seen = []
    launch = ce.cross_entropy_chunk_triton

    def spy(logits, *args, tile_lse=None, **kwargs):
        seen.append((logits.dtype, tile_lse is not None and tile_lse.target_logit is not None))
        return launch(logits, *args, tile_lse=tile_lse, **kwargs)

    monkeypatch.setattr(ce, "cross_entropy_chunk_triton", spy)
    problem = op_problem(15, reduction)
    options = {"softcap": 15.0, "lse_square_scale": 1e-3, "reduction": reduction}

    def fused(**extra):
        seen.clear()
        out = op_grads(problem, logits_precision="fp32_compensated", impl="triton", **options, **extra)
        return out, list(seen)

    want = float64_grads(problem, **options)
    got, chunks = fused()
    assert len(chunks) == (3 if reduction == "mean" else 6)
    assert chunks == [(torch.bfloat16, True)] * len(chunks)
    assert (got[0].double() - want[0]).abs().max() <= 1e-5
    monkeypatch.setattr(engine, "RELATIVE_16BIT_LOGITS", False)
    rows, chunks = fused()
    assert chunks and all(dtype == torch.float32 for dtype, _ in chunks)
    monkeypatch.setattr(engine, "RELATIVE_16BIT_LOGITS", True)
    default = op_grads(problem, impl="triton", **options)
    assert (got[0] - rows[0]).abs().max() <= 2e-6
    for g, r, d, ref in zip(got[1], rows[1], default[1], want[1]):
        assert relative_error(g, ref) <= 1.05 * relative_error(r, ref) + 1e-6
        # as test_logits_precision's "no worse" than the default, up to the final rounding to bf16
        assert relative_error(g, ref) <= 1.05 * relative_error(d, ref) + 1e-3
    _, chunks = fused(label_smoothing=0.05)
    assert chunks and all(dtype == torch.float32 and not target for dtype, target in chunks)
    monkeypatch.setattr(
        engine, "RELATIVE_MIN_VOCAB", 204
    )  # a vocabulary under the threshold: the fp32 buffer
    _, chunks = fused()
    assert chunks and all(dtype == torch.float32 for dtype, _ in chunks)


@pytest.mark.interpret
def test_memory_model_counts_the_relative_buffer():
    """The memory callback's model of the fused head follows the op: ``"fp32_compensated"`` on the Triton path
    holds the 16-bit chunk buffer plus the LSE partials (8 bytes a row and column tile) and target logits (4 a
    row); with label smoothing, or under ``engine.RELATIVE_MIN_VOCAB``, the fp32 buffer (twice the 16-bit one)."""
    from lightning_flce import engine
    from lightning_flce.callbacks.memory_model import HeadMemoryModel
    from lightning_flce.kernels.compensated_gemm import launch_config

    n, h, v = 4096, 256, engine.RELATIVE_MIN_VOCAB + 3000
    rows = engine.chunk_rows(None, n, n, v, h, torch.bfloat16, True)
    tiles = -(-v // launch_config(torch.device("cpu")).block_n)

    def chunk_bytes(**options):
        model = HeadMemoryModel("bf16-true", torch.bfloat16, h, impl="triton", **options)
        return model.estimate(n, v).chunk_bytes

    assert chunk_bytes(logits_precision="fp32_compensated") == rows * v * 2 + rows * (tiles * 8 + 4)
    assert chunk_bytes(logits_precision="fp32_compensated", label_smoothing=0.1) == rows * v * 4
    assert chunk_bytes(logits_precision="fp32") == rows * v * 4
    assert chunk_bytes() == rows * v * 2
    small = engine.RELATIVE_MIN_VOCAB - 1000  # a vocabulary under the 16-bit buffer's threshold: the fp32 one
    small_rows = engine.chunk_rows(None, n, n, small, h, torch.bfloat16, True)
    model = HeadMemoryModel(
        "bf16-true", torch.bfloat16, h, impl="triton", logits_precision="fp32_compensated"
    )
    assert model.estimate(n, small).chunk_bytes == small_rows * small * 4


def test_plain_sum_needs_chains_of_two_blocks():
    """One block per chain with a plain sum would compile back into one chain over K: refused up front."""
    from lightning_flce.kernels.compensated_gemm import INTERPRET_CONFIG, compensated_logits_mm

    x, w, _ = gemm_problem(4, 8, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="kahan=False needs chain_blocks >= 2"):
        compensated_logits_mm(x, w, torch.empty(4, 8), config=INTERPRET_CONFIG._replace(kahan=False))


@pytest.mark.interpret
def test_kernel_takes_row_strides_and_copies_other_layouts():
    """x as columns of a wider tensor (row stride > K), out a row slice of a larger buffer (only its rows are
    written), W stored transposed (not unit-stride along K: made contiguous) and an fp16 bias (added in fp32)."""
    from lightning_flce.kernels.compensated_gemm import compensated_logits_mm

    m, n, k = 21, 50, 40
    x_full, w, b = gemm_problem(m, n, k + 9, torch.bfloat16, seed=1)
    x = x_full[:, 3 : k + 3]
    w_t = w[:, :k].T.contiguous().T  # [n, k] with strides (1, n)
    assert x.stride() == (k + 9, 1) and w_t.stride(1) != 1
    buffer = torch.full((m + 4, n), float("nan"))
    out = buffer[1 : m + 1]
    compensated_logits_mm(x, w_t, out, b.half())
    exact = x.double() @ w_t.double().T + b.half().double()
    assert (out.double() - exact).abs().max().item() <= ULPS * fp32_ulp(exact)
    assert buffer[0].isnan().all() and buffer[m + 1 :].isnan().all()


@pytest.mark.interpret
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_op_runs_the_kernel_on_the_triton_path(monkeypatch, reduction):
    """impl="triton", bf16: every chunk's logits come from the compensated kernel (in the forward, and in the
    recompute of "none"'s backward); per-token loss within 1e-5 of float64 (fp32 softmax of logits within a few
    ulps), the gradients no less accurate than the default's (both rounded to bf16 at the end). impl="torch"
    runs the float64 fallback instead."""
    import lightning_flce.kernels.compensated_gemm as gemm

    calls = []
    launch = gemm.compensated_logits_mm

    def spy(x_c, weight, out, bias=None, config=None, tile_lse=None, target=None):
        calls.append(x_c.shape[0])
        return launch(x_c, weight, out, bias, config, tile_lse, target)

    monkeypatch.setattr(gemm, "compensated_logits_mm", spy)
    problem = op_problem(4, reduction)
    t = problem[3]
    options = {"softcap": 15.0, "label_smoothing": 0.05, "reduction": reduction}

    def fused(precision, impl="triton"):
        return op_grads(problem, logits_precision=precision, impl=impl, **options)

    want = float64_grads(problem, **options)
    got = fused("fp32_compensated")
    n_valid = int((t != -100).sum())
    chunks = [16, 16, n_valid - 32]
    assert calls == (chunks if reduction == "mean" else chunks * 2)  # "none": forward, then backward
    default = fused("input")
    assert (got[0].double() - want[0]).abs().max() <= 1e-5
    for index, (g, d, ref) in enumerate(zip(got[1], default[1], want[1])):
        assert relative_error(g, ref) <= 1.05 * relative_error(d, ref) + 1e-3, index
    calls.clear()
    torch_path = fused("fp32_compensated", impl="torch")
    assert calls == []
    assert (torch_path[0].double() - want[0]).abs().max() <= 1e-5


def test_cuda_config_fits_the_shared_memory():
    """The measured config (64-row tiles, BK = 64, two programs per SM, each with 4 stages of 24 KiB and the TMA
    store's 16 KiB half tile) where it fits, fewer stages or a smaller BK where not; a GPU without TMA gets the
    pointer kernel's config (128 x 128 tiles, no TMA flags, no store buffer, 5 stages of 32 KiB)."""
    pytest.importorskip("triton")
    from lightning_flce.kernels.compensated_gemm import MEASURED_CONFIG, POINTER_CONFIG, cuda_config

    pointer = POINTER_CONFIG
    assert not (pointer.tma or pointer.persistent or pointer.tma_store)
    assert cuda_config(None) == MEASURED_CONFIG
    assert cuda_config(227 * 1024) == MEASURED_CONFIG  # H100 / H200: 2 x (4 x 24 + 16 KiB)
    assert cuda_config(191 * 1024) == MEASURED_CONFIG._replace(
        num_stages=3
    )  # no room for two programs of 4 stages and the store
    assert cuda_config(163 * 1024, tma=False) == pointer  # A100: 5 stages, no store buffer
    # a smaller BK chains more blocks: the tensor cores' chains (the error) stay as many products long
    chain = pointer.block_k * pointer.chain_blocks
    assert MEASURED_CONFIG.chain_products == chain
    assert cuda_config(99 * 1024, tma=False) == pointer._replace(num_stages=3)  # sm86/89
    assert cuda_config(48 * 1024, tma=False) == pointer._replace(
        block_k=32, num_stages=3, chain_blocks=chain // 32
    )
    assert cuda_config(24 * 1024, tma=False) == pointer._replace(
        block_k=16, num_stages=3, chain_blocks=chain // 16
    )
    assert cuda_config(8 * 1024, tma=False) == pointer._replace(
        block_k=16, num_stages=2, chain_blocks=chain // 16
    )  # the smallest BK, two stages, whatever the GPU holds
    # the TMA config halves its BK too where two programs' two stages do not fit
    assert cuda_config(80 * 1024) == MEASURED_CONFIG._replace(
        block_k=32, num_stages=2, chain_blocks=chain // 32
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"x": torch.zeros(4, 8)}, TypeError, "both be bfloat16 or both float16"),
        ({"w": torch.zeros(6, 8, dtype=torch.float16)}, TypeError, "both be bfloat16 or both float16"),
        ({"w": torch.zeros(6, 7, dtype=torch.bfloat16)}, ValueError, "differ in K"),
        ({"x": torch.zeros(4, 8, 1, dtype=torch.bfloat16)}, ValueError, "must be 2-D"),
        (
            {"out": torch.zeros(4, 6, dtype=torch.bfloat16)},
            ValueError,
            r"out must be float32 of shape \(4, 6\)",
        ),
        ({"out": torch.zeros(4, 7)}, ValueError, r"out must be float32 of shape \(4, 6\)"),
        ({"out": torch.zeros(6, 4).T}, ValueError, "unit stride"),
        ({"bias": torch.zeros(5)}, ValueError, r"bias must be \[N\]=\[6\]"),
        ({"w": torch.zeros(6, 8, dtype=torch.bfloat16, device="meta")}, ValueError, "weight is on meta"),
    ],
)
def test_bad_arguments_raise_before_the_kernel(monkeypatch, change, error, message):
    pytest.importorskip("triton")
    import lightning_flce.kernels.compensated_gemm as gemm

    def no_launch(*args, **kwargs):
        raise AssertionError("the launch was prepared: the arguments passed the checks")

    monkeypatch.setattr(gemm, "launch_config", no_launch)
    args = {
        "x": torch.zeros(4, 8, dtype=torch.bfloat16),
        "w": torch.zeros(6, 8, dtype=torch.bfloat16),
        "out": torch.zeros(4, 6),
        "bias": None,
    }
    args.update(change)
    with pytest.raises(error, match=message):
        gemm.compensated_logits_mm(args["x"], args["w"], args["out"], args["bias"])
