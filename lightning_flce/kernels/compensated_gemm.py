"""Triton kernel: ``out[M, N] = x[M, K] @ w[N, K].T (+ bias)`` in fp32 from 16-bit operands, with the sum over
K kept in short tensor-core chains, against the long one whose rounding is "fp32"'s error
(``logits_precision="fp32_compensated"``).

Why: a 16-bit GEMM with an fp32 output (cuBLAS's ``torch.mm(..., out_dtype=torch.float32)``, or a plain Triton
GEMM) forms every product exactly, but the tensor cores accumulate the K = H products of an output in fp32
along one chain, and that chain's rounding is the whole error of ``logits_precision="fp32"``: on an H200 the
logits are off by up to 6.9e-5 (H = 4096) and the per-token loss by 5e-5 / 2.8e-5 at 16384x4096x32000 /
8192x2304x256000 (bf16 inputs, bias, softcap 30; cuBLAS and a plain Triton GEMM bit-identical;
``benchmarks/experiments/fp32_logits_accuracy.py``, ``benchmarks/results/2026-12-01_h200_torch2.11_triton3.6_run72_*``).

How: each program owns a [BM, BN] output tile and keeps the tensor cores' fp32 chains short: every
``chain_blocks`` BK-long blocks of K (the measured configuration: 8 x 64 = 512 products) are summed by the
tensor cores from a zero accumulator, and the chains' sums are added into a running fp32 sum, plainly (the
default) or Kahan-compensated (``GemmConfig.kahan``: ``y = part - comp; t = acc + y; comp = (t - acc) - y;
acc = t``). The error follows the chain's length (run79: chains of 128 / 256 / 512 give per-token loss errors of
1.8-1.9e-6 / 2.8-3.2e-6 / 4.4-5.3e-6 at the four benchmark shapes' chunks, bias and softcap 30; "fp32"'s one
chain over H: 2.5-4.9e-5), while the plain sum of the K / 512 chains adds at most half an ulp per addition.
The operand blocks come through the tensor-memory accelerator where the GPU has one (``GemmConfig.tma``,
:func:`tma_usable`): Triton's pointer-load GEMM was itself 1.20-1.49x cuBLAS, its TMA one 1.07-1.15x (run80).
Measured (run80, the GEMM of one chunk, against cuBLAS's fp32-output GEMM): 1.10-1.27x, where Kahan's sum of
128-long chains with pointer loads (the default until then) took 1.97-2.07x. With one program per SM and the
copy engine's stores (``GemmConfig.persistent``, ``tma_store``; run84 on another H200): 1.19-1.33x, against
1.26-1.33x one program per tile in the same run; the op with ``logits_precision="fp32_compensated"``
1.11-1.17x the default's time with chains of 2 x 128 (run85); with chains of 4 x 128 (run86) 1.06-1.12x at
4.4-5.2e-6 per token. Chains of 8 x 128 were barely faster and past 1e-5 per token (run87: 1.24e-5). The same
512 products as 8 blocks of BK = 64 with 5 stages (half the shared memory per stage; run88): the GEMM
1.08-1.29x cuBLAS, within 1-4% of Triton's own one-chain GEMM in the same loop, against 1.20-1.37x for 4 x 128
with 3 stages in that run; the op 1.08-1.14x the default, within the run's spread of 4 x 128's. Triton's
automatic warp specialization of the tile loop (``tl.range(..., warp_specialize=True)``, commit cd9f10c)
compiled on Hopper and gained nothing (run88), so the kernel does without it. Those 128 x 128 tiles over two
warp groups stall each program's MMAs through its epilogue and at every chain's end; 64 x 128 tiles over one
warp group, two persistent programs per SM and four stages each (``GemmConfig.programs_per_sm``; the measured
configuration since run89) let one program's MMAs run while the other adds a chain or stores a tile: the GEMM
1.12-1.22x cuBLAS in three runs where the 128 x 128 tiles took 1.15-1.30x, the op 1.07-1.12x the default's
time. Row groups of 4 / 16 / 32 tiles, three stages, 128 x 64 or 64 x 256 tiles, three programs per SM and
BK = 128 were slower there; the warps' masked stores were faster at two shapes and 1.41x at the fourth. Writing
each row's LSE partials in the epilogue (:class:`TileLse`) cost the GEMM more than the chunk kernel's saved
read with libdevice's exp (the op 0.8-4.6% slower, run86); with ``tl.exp`` the op is 0-1.7% faster (run88),
inside the spread, so it stays off (``engine.LSE_FROM_LOGITS_GEMM``).

What the op hands the chunk kernel (``engine.RELATIVE_16BIT_LOGITS``): where the loss needs only each row's LSE
and target logit, the epilogue writes the LSE partials in fp32 (:class:`TileLse`) and stores each logit minus its
row's tile maximum in the operands' 16-bit dtype, for the gradient only, and :func:`target_logits` computes the
target logits in fp32 apart (in the epilogue, the target's column search cost the GEMM 0.4 ms a chunk at
8192x2304x256000, the separate kernel 0.01 ms; run90). The chunk's buffer is the default's (no fp32 [C, V] one) and
is read once, and the rounding of a stored value, 2^-8 |z - max| in bf16, is small where the gradient is large
(the logits near the maximum).

What the configurations measured (``benchmarks/experiments/compensated_gemm_configs.py``, run76 / run79 / run80):

- Triton's combine pass folds ``acc = acc + tl.dot(a, b)`` back into ``tl.dot(a, b, acc)`` (one chain again,
  the error of the plain GEMM), so a plain sum needs chains of two blocks or more (``kahan=False`` with
  ``chain_blocks=1`` is refused); Kahan's ``part - comp`` is not folded. The chain's reset under a condition is
  the pattern Triton turns into the MMA's "no accumulator" flag.
- Kahan's two fp32 [BM, BN] tiles beside the chain's break the MMA pipeline at every addition: chained Kahan
  configurations were 1.5-3x cuBLAS. The plain sum holds one tile less; 128 x 256 tiles spill either way (3.2-3.8x).
- A stage of 64 x 128 tiles holds (64 + 128) x 64 x 2 bytes = 24 KiB of shared memory: each of two programs per
  SM takes four stages and the TMA store's 16 KiB half tile, 112 of an H100/H200's 227 KiB (128 x 128 tiles: 32
  KiB per stage, five stages and a 32 KiB half tile, one program). A GPU with less gets fewer stages, or BK = 32 /
  16 with as many more blocks per chain where two stages do not fit (:func:`cuda_config`).

Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) the blocks are 16 wide and the operands are
widened to fp32 before ``tl.dot``: the interpreter's bf16 dot is wrong. fp32 products of 16-bit values are
exact either way.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lightning_flce._compat import TRITON_INTERPRET
from lightning_flce.kernels.triton_math import transform_logits

#: The operand dtypes the kernel takes.
OPERAND_DTYPES = (torch.bfloat16, torch.float16)


class GemmConfig(NamedTuple):
    """Launch parameters of :func:`_compensated_mm_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: K blocks summed by the tensor cores in one chain (``chain_blocks x block_k`` products) before the
    #: chain's sum goes into the compensated fp32 sum. Longer chains pipeline better and round more.
    chain_blocks: int = 1
    #: Add the chains' sums with Kahan's compensation (two fp32 [BM, BN] register tiles beside the chain's);
    #: False: a plain fp32 sum (one tile; K / (chain_blocks x block_k) round-to-nearest additions, each at
    #: most half an ulp of the running sum). False needs ``chain_blocks >= 2``: with one block per chain the
    #: sum is ``acc + tl.dot(a, b)``, the pattern Triton's combine pass folds back into one chain over K (see
    #: below: the error of "fp32").
    kahan: bool = True
    #: Load the operand blocks with the Hopper tensor-memory accelerator (``TensorDescriptor``: one copy
    #: engine request per block, asynchronous, out-of-bounds zeros, no address arithmetic in the warps) instead
    #: of per-thread pointer loads. Needs 16-byte aligned operands and row strides (K a multiple of 8 for
    #: 16-bit operands): :func:`compensated_logits_mm` falls back to the pointer kernel otherwise.
    tma: bool = False
    #: With ``tma``: one program per SM walking its tiles (tile ``pid``, ``pid + programs``, ...) instead of one
    #: program per tile, so a program's next tile starts loading while its last one is being stored.
    persistent: bool = False
    #: With ``tma``: each tile stored by the copy engine from shared memory (two [BM, BN / 2] halves: 32 KiB
    #: of shared memory beside the stages) instead of the warps' masked stores. Needs a 16-byte aligned ``out``
    #: (base and row stride: N a multiple of 4 for a whole buffer); the masked store otherwise.
    tma_store: bool = False
    #: Row tiles per group of :func:`grouped_tile`'s program order: each column tile's [BN, K] block of the
    #: weight is read from memory once per group of ``group_m`` row tiles (and from L2 by the others).
    group_m: int = 8
    #: With ``persistent``: programs per SM. Two let one program's epilogue overlap the other's MMAs where
    #: both fit an SM's registers and shared memory (small tiles).
    programs_per_sm: int = 1

    @property
    def chain_products(self) -> int:
        """Products per tensor-core chain (``chain_blocks x block_k``): what the error follows."""
        return self.block_k * self.chain_blocks


#: The measured configuration on Hopper (H200, results/*_run80_*, *_run84_*, *_run88_*, *_run89_*): chains of
#: 8 x 64 = 512 products summed plainly, the blocks through TMA four stages deep, 64-row tiles over one warp group
#: with two persistent programs per SM (one program's epilogue, an fp32 tile through the copy engine, overlaps the
#: other's MMAs), the copy engine's stores. In three runs of run89 1.12-1.22x cuBLAS's fp32-output GEMM at the
#: op's chunk shapes, against 1.15-1.30x for 128-row tiles over two warp groups, one program per SM
#: (:data:`POINTER_CONFIG`'s tiles, the configuration of run88) and 1.09-1.24x for Triton's own one-chain GEMM;
#: per-token loss within 4.4-5.2e-6 of float64 ("fp32"'s one chain over H: 2.5-4.9e-5), inside issue 23's 1e-5.
MEASURED_CONFIG = GemmConfig(
    block_m=64,
    block_n=128,
    block_k=64,
    num_warps=4,
    num_stages=4,
    chain_blocks=8,
    kahan=False,
    tma=True,
    persistent=True,
    tma_store=True,
    programs_per_sm=2,
)
#: GPUs without the tensor-memory accelerator (pointer loads, one program per tile, masked stores): the same
#: chains in 128 x 128 tiles over two warp groups, five stages (Hopper's measured configuration until run89; the
#: pointer kernel is not measured on such a GPU here).
POINTER_CONFIG = GemmConfig(
    block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=5, chain_blocks=8, kahan=False
)
#: The interpreter's: tl.dot's smallest blocks (each program is a Python loop there).
INTERPRET_CONFIG = GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


def cuda_config(shared_memory_bytes: Optional[int], tma: bool = True) -> GemmConfig:
    """The measured configuration (:data:`MEASURED_CONFIG` on a GPU with the tensor-memory accelerator, compute
    capability 9+; :data:`POINTER_CONFIG` without it), with fewer pipeline stages (or a smaller BK: 32, 16)
    where a GPU's shared memory per block (``shared_memory_per_block_optin``; None: unknown, assumed an
    H100/H200's) holds fewer than its stages for each of its programs per SM. Each stage holds a [BM, BK] block
    of x and a [BN, BK] block of w in 16 bits; the TMA store's fp32 half tile ([BM, BN / 2]) is kept beside
    them. A smaller BK chains more blocks, so the tensor cores' chains (and the error) stay as long. Whether
    TMA reads given operands is :func:`tma_usable`'s call at launch."""
    config = MEASURED_CONFIG if tma else POINTER_CONFIG
    if shared_memory_bytes is None:
        return config
    chain = config.chain_products  # kept whatever BK becomes: the error's size
    per_program = shared_memory_bytes // (config.programs_per_sm if config.persistent else 1)
    for_stages = per_program - (config.block_m * config.block_n * 2 if config.tma_store else 0)
    block_k = config.block_k
    while True:
        stages = min(config.num_stages, for_stages // ((config.block_m + config.block_n) * block_k * 2))
        if stages >= 2 or block_k == 16:  # 16: tl.dot's smallest K for 16-bit operands
            break
        block_k //= 2
    return config._replace(block_k=block_k, num_stages=max(stages, 2), chain_blocks=chain // block_k)


@functools.cache
def _device_config(device_index: int) -> GemmConfig:
    properties = torch.cuda.get_device_properties(device_index)
    return cuda_config(getattr(properties, "shared_memory_per_block_optin", None), tma=properties.major >= 9)


def launch_config(device: torch.device) -> GemmConfig:
    """The configuration for tensors on ``device``."""
    if TRITON_INTERPRET or device.type != "cuda":
        return INTERPRET_CONFIG
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_config(index)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) tile of program ``pid`` in grouped order: GROUP_M row tiles take each column tile in
    turn, so a [BLOCK_N, K] block of the second operand is read from L2 by GROUP_M programs in a row."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def chain_step(a, b, part, acc, comp, k, k_blocks, CHAIN_BLOCKS: tl.constexpr, KAHAN: tl.constexpr):
    """One K block: its products into the tensor cores' chain ``part`` and, at a chain's end (every
    CHAIN_BLOCKS blocks, and the last block), the chain's sum into the running sum ``acc`` (Kahan-compensated
    by ``comp``, or plainly) and the chain restarted from zero. Returns (part, acc, comp)."""
    # CHAIN_BLOCKS blocks' products summed by the tensor cores from zero (a chain of CHAIN_BLOCKS x BLOCK_K
    # products, not K: see the module docstring), then added into the running sum. The reset of `part` under
    # a condition is the pattern Triton turns into the MMA's "no accumulator" flag (as in its persistent
    # matmul).
    part = tl.dot(a, b, part)
    if (k % CHAIN_BLOCKS == CHAIN_BLOCKS - 1) | (k == k_blocks - 1):
        if KAHAN:
            y = part - comp
            t = acc + y
            comp = (t - acc) - y
            acc = t
        else:  # a plain fp32 sum of the K / (CHAIN_BLOCKS BLOCK_K) chain sums: one register tile less
            acc += part
        part = tl.zeros_like(part)
    return part, acc, comp


@triton.jit
def tma_blocks(x_desc, w_desc, off_m, off_n, k, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """K block ``k`` of the tile at (off_m, off_n) through the tensor descriptors: x's [BLOCK_M, BLOCK_K] and
    w's block transposed to [BLOCK_K, BLOCK_N] (zeros past M, N and K), widened to fp32 under the interpreter."""
    a = x_desc.load([off_m, k * BLOCK_K])
    b = w_desc.load([off_n, k * BLOCK_K]).T
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def store_tile(acc, out_ptr, M, N, out_row_stride, rm, rn):
    """``acc`` into out's rows rm and columns rn that exist (the warps' masked stores)."""
    out_tile = out_ptr + rm.to(tl.int64)[:, None] * out_row_stride + rn[None, :]
    tl.store(out_tile, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def store_tile_tma(acc, out_desc, off_m, off_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`store_tile` through out's tensor descriptor (blocks [BLOCK_M, BLOCK_N // 2]): the copy engine
    writes the tile from shared memory and drops what lies past M and N. In halves, so the epilogue's shared
    buffer is a [BLOCK_M, BLOCK_N / 2] fp32 block (16 KiB at 64 x 128, 32 KiB at 128 x 128) beside the stages."""
    left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
    out_desc.store([off_m, off_n], left)
    out_desc.store([off_m, off_n + BLOCK_N // 2], right)


@triton.jit
def epilogue(
    acc,
    bias_ptr,
    out_ptr,
    out_desc,
    tile_max_ptr,
    tile_sum_ptr,
    tile_row_stride,
    softcap,
    M,
    N,
    out_row_stride,
    pid_m,
    pid_n,
    HAS_BIAS: tl.constexpr,
    TILE_LSE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    RELATIVE: tl.constexpr,
    TMA_STORE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A finished tile: the bias added in fp32 (rounded once, as out.add_(bias) after the GEMM); with TILE_LSE,
    each row's log-sum-exp partial over the tile's columns (see :class:`TileLse`); then the store: the fp32 tile,
    or with RELATIVE each (softcapped) logit minus its row's tile maximum, rounded to out's 16-bit dtype."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + tl.minimum(rn, N - 1))[None, :]
    if TILE_LSE:
        # the chunk kernel's transform of the same fp32 value (no re-mask: the next line masks every column past N)
        z, _ = transform_logits(acc, True, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
        z = tl.where(rn[None, :] < N, z, float("-inf"))
        row_max = tl.max(z, 1)
        # A row whose columns here are all -inf (a bias mask) sums exp(z - 0) = 0 instead of NaN.
        row_ref = tl.where(row_max == float("-inf"), 0.0, row_max)
        # tl.exp (ex2.approx), not libdevice's ~10-instruction exp between two tiles' MMAs: run88 measured the
        # same LSE error either way in the chunk kernel's first pass (0.75-1.0e-6 at the benchmark shapes'
        # chunks, benchmarks/experiments/chunk_kernel_exp.py), and the op 0-1.7% faster than with libdevice's.
        row_sum = tl.sum(tl.exp(z - row_ref[:, None]), 1)
        partial = rm.to(tl.int64) * tile_row_stride + pid_n
        tl.store(tile_max_ptr + partial, row_max, mask=rm < M)
        tl.store(tile_sum_ptr + partial, row_sum, mask=rm < M)
        if RELATIVE:
            # The 16-bit value's rounding is relative to z - max, not to z: absolute 2^-8 |z - max| (bf16), so
            # the logits that carry the gradient (within a few units of the maximum) keep ~fp32's softmax error.
            acc = (z - row_ref[:, None]).to(out_ptr.dtype.element_ty)  # rounded to nearest on the GPU
    if TMA_STORE:
        store_tile_tma(acc, out_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N)
    else:
        store_tile(acc, out_ptr, M, N, out_row_stride, rm, rn)


@triton.jit
def _compensated_mm_kernel(
    x_ptr,  # [M, K] bf16/fp16, unit stride along K
    w_ptr,  # [N, K] same dtype, unit stride along K
    bias_ptr,  # [N] fp32 (read only with HAS_BIAS)
    out_ptr,  # [M, N] out (fp32, or with RELATIVE the operands' 16-bit dtype), unit stride along N
    tile_max_ptr,  # [M, cdiv(N, BLOCK_N)] fp32 out (written only with TILE_LSE), row stride tile_row_stride
    tile_sum_ptr,  # the same shape
    M,
    N,
    K,
    x_row_stride,
    w_row_stride,
    out_row_stride,
    tile_row_stride,
    softcap,
    HAS_BIAS: tl.constexpr,
    TILE_LSE: tl.constexpr,  # write each row's log-sum-exp partials over each tile's columns
    HAS_SOFTCAP: tl.constexpr,  # ... of softcap * tanh(logit / softcap)
    RELATIVE: tl.constexpr,  # with TILE_LSE: store z - its row's tile max in out's 16-bit dtype
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    UPCAST: tl.constexpr,  # widen the operands to fp32 before tl.dot (the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHAIN_BLOCKS: tl.constexpr,  # K blocks per tensor-core chain between two compensated additions
    KAHAN: tl.constexpr,  # the chains' sums added with Kahan's compensation (else a plain fp32 sum)
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows past M / N load row M - 1 / N - 1 again (in bounds, no load mask); only the store is masked.
    # int64 offsets: out has M N elements, 4e9 at 16384 x 256000 (past int32), w up to N K.
    x_rows = tl.minimum(rm, M - 1).to(tl.int64)
    w_rows = tl.minimum(rn, N - 1).to(tl.int64)
    x_tile = x_ptr + x_rows[:, None] * x_row_stride + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_tile = w_ptr + w_rows[None, :] * w_row_stride + rk[:, None]  # [BLOCK_K, BLOCK_N]: w's block, transposed

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_blocks = tl.cdiv(K, BLOCK_K)
    for k in range(0, k_blocks):
        if EVEN_K:
            a = tl.load(x_tile)
            b = tl.load(w_tile)
        else:  # the K tail: zeros past K add nothing to the block's dot
            k_left = K - k * BLOCK_K
            a = tl.load(x_tile, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(w_tile, mask=rk[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        part, acc, comp = chain_step(a, b, part, acc, comp, k, k_blocks, CHAIN_BLOCKS, KAHAN)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    # out_ptr stands in for the descriptor: never read without TMA_STORE
    epilogue(
        acc, bias_ptr, out_ptr, out_ptr, tile_max_ptr, tile_sum_ptr, tile_row_stride, softcap, M, N,
        out_row_stride, pid_m, pid_n, HAS_BIAS, TILE_LSE, HAS_SOFTCAP, RELATIVE, False, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _compensated_mm_tma_kernel(
    x_desc,  # TensorDescriptor of x [M, K], blocks [BLOCK_M, BLOCK_K]
    w_desc,  # TensorDescriptor of w [N, K], blocks [BLOCK_N, BLOCK_K]
    out_desc,  # TensorDescriptor of out [M, N], blocks [BLOCK_M, BLOCK_N // 2] (read only with TMA_STORE)
    bias_ptr,  # [N] fp32 (read only with HAS_BIAS)
    out_ptr,  # [M, N] out, unit stride along N (the masked store: N like 32003 is no TMA row)
    tile_max_ptr,  # as _compensated_mm_kernel's
    tile_sum_ptr,
    M,
    N,
    K,
    out_row_stride,
    tile_row_stride,
    softcap,
    num_programs,  # the grid: one program per tile, or (persistent) fewer, each walking tiles
    HAS_BIAS: tl.constexpr,
    TILE_LSE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    RELATIVE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHAIN_BLOCKS: tl.constexpr,
    KAHAN: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """:func:`_compensated_mm_kernel` with the operand blocks loaded by the tensor-memory accelerator: the
    copy engine fills blocks past M, N and K with zeros, so there is no mask and no tail case. Program ``pid``
    computes tiles pid, pid + num_programs, ... in grouped order: launched with one program per tile that is
    one tile each; with one per SM (``GemmConfig.persistent``) a program's next tile is loading while its last
    one is stored (run83: with the TMA store, 1.08-1.25x cuBLAS where one program per tile took 1.26-1.39x)."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    # Not tl.range(flatten=True): Triton's flattened, pipelined nest was 1.3-1.7x slower here (run83).
    for tile in range(tl.program_id(0), num_tiles, num_programs):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_blocks):
            a, b = tma_blocks(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k, BLOCK_K, UPCAST)
            part, acc, comp = chain_step(a, b, part, acc, comp, k, k_blocks, CHAIN_BLOCKS, KAHAN)
        epilogue(
            acc, bias_ptr, out_ptr, out_desc, tile_max_ptr, tile_sum_ptr, tile_row_stride, softcap, M, N,
            out_row_stride, pid_m, pid_n, HAS_BIAS, TILE_LSE, HAS_SOFTCAP, RELATIVE, TMA_STORE, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def _target_logits_kernel(
    x_ptr,  # [M, K] 16-bit, unit stride along K
    w_ptr,  # [N, K] same dtype, unit stride along K
    bias_ptr,  # [N] fp32 (read only with HAS_BIAS)
    target_ptr,  # [M] int64: a column of w, or any value outside [0, N) (the row is skipped)
    out_ptr,  # [M] fp32 out
    N,
    x_row_stride,
    w_row_stride,
    softcap,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row's logit at its target column, ``x[r] . w[t] (+ b[t])`` through the softcap, in fp32: exact
    products, a running fp32 sum per lane over the K / BLOCK_K blocks and a tree sum over the lanes (a few ulps)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    if (target >= 0) & (target < N):
        offsets = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + offsets
            a = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < K, other=0.0).to(tl.float32)
            b = tl.load(w_ptr + target * w_row_stride + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc += a * b
        z = tl.sum(acc, 0)
        if HAS_BIAS:
            z += tl.load(bias_ptr + target)
        # through the softcap as the epilogue's partials and the chunk kernel see it
        z, _ = transform_logits(z, True, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
        tl.store(out_ptr + row, z)


def target_logits(
    x_c: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    softcap: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[r] = softcap(x_c[r] . weight[target[r]] (+ bias[target[r]]))`` in fp32 for the rows whose target is a
    column of ``weight`` (the others, e.g. ``ignore_index``, are left as they were): the target logits of
    :class:`TileLse`, one [H] dot product a row (C H 16-bit reads of each operand, next to the GEMM's C H V)."""
    m, k = x_c.shape
    if m == 0:
        return out
    block_k = 16 if TRITON_INTERPRET else min(1024, triton.next_power_of_2(k))
    _target_logits_kernel[(m,)](
        x_c,
        weight,
        bias if bias is not None else out,  # a dummy pointer without HAS_BIAS
        target,
        out,
        weight.shape[0],
        x_c.stride(0),
        weight.stride(0),
        softcap,
        K=k,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap > 0.0,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


@functools.cache
def _tensor_descriptor():
    """Triton's host-side ``TensorDescriptor`` (Triton >= 3.3), or None on older Tritons (no TMA kernel there)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def tma_usable(x_c: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the TMA kernel can read these operands: a Triton with host-side tensor descriptors, a Hopper-class
    GPU (or the interpreter), 16-byte aligned base addresses and row strides, unit stride along K."""
    if _tensor_descriptor() is None:
        return False
    if not TRITON_INTERPRET and (
        x_c.device.type != "cuda" or torch.cuda.get_device_capability(x_c.device)[0] < 9
    ):
        return False
    return _tma_aligned(x_c) and _tma_aligned(weight)


def tma_store_usable(out: torch.Tensor) -> bool:
    """Whether the copy engine can write ``out`` (fp32 [M, N]): aligned as TMA reads need (N a multiple of 4
    for a whole buffer; the launcher checks :func:`tma_usable` first)."""
    return _tma_aligned(out)


def _tma_aligned(t: torch.Tensor) -> bool:
    """A 2-D tensor the copy engine can address: unit stride along its rows, base and row stride 16-byte
    aligned."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Programs of a persistent launch under the interpreter: a few, so each walks several tiles.
INTERPRET_PROGRAMS = 3


def persistent_programs(device: torch.device, tiles: int, per_sm: int = 1) -> int:
    """Programs of a persistent launch: ``per_sm`` per SM (at most one per tile)."""
    if TRITON_INTERPRET or device.type != "cuda":
        return min(tiles, INTERPRET_PROGRAMS)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(tiles, per_sm * _multiprocessors(index))


class TileLse(NamedTuple):
    """Each row's log-sum-exp partials over the GEMM's column tiles, written by its epilogue (the
    ``tile_lse`` argument of :func:`compensated_logits_mm`): for row r and tile t (columns [t BN, (t + 1) BN),
    ``block_n`` = BN), ``max[r, t]`` is the largest z there and ``sum_exp[r, t] = sum(exp(z - max[r, t]))``,
    where z are the fp32 logits (bias included), through ``softcap * tanh(z / softcap)`` when ``softcap > 0``.
    The chunk kernel combines them into the row's LSE instead of reading the row for it (its first pass).
    ``target_logit`` (optional, fp32 [rows]): z at each row's target column, written (:func:`target_logits`) when
    the GEMM is given the targets (rows whose target is no column, e.g. ``ignore_index``, are left as they were).

    ``max`` and ``sum_exp`` are fp32 [rows, tiles], unit stride along tiles, with at least the GEMM's M rows
    (:func:`empty_tile_lse` sizes them for a GEMM's config; :meth:`rows` slices a chunk's).
    """

    max: torch.Tensor
    sum_exp: torch.Tensor
    softcap: float
    block_n: int
    target_logit: Optional[torch.Tensor] = None

    def rows(self, n: int) -> TileLse:
        """The partials of the first ``n`` rows (a chunk of a buffer sized for the largest one)."""
        target_logit = self.target_logit[:n] if self.target_logit is not None else None
        return self._replace(max=self.max[:n], sum_exp=self.sum_exp[:n], target_logit=target_logit)


def empty_tile_lse(
    rows: int,
    n: int,
    device: torch.device,
    softcap: float = 0.0,
    config: Optional[GemmConfig] = None,
    with_target_logit: bool = False,
) -> TileLse:
    """Buffers for :class:`TileLse` of GEMMs of up to ``rows`` rows and ``n`` columns, at ``config``'s tiles
    (default: :func:`launch_config`'s); ``with_target_logit``: with the target logits' buffer."""
    config = config or launch_config(device)
    tiles = triton.cdiv(n, config.block_n)
    return TileLse(
        torch.empty(rows, tiles, dtype=torch.float32, device=device),
        torch.empty(rows, tiles, dtype=torch.float32, device=device),
        float(softcap),
        config.block_n,
        torch.empty(rows, dtype=torch.float32, device=device) if with_target_logit else None,
    )


def tile_lse_bytes(rows: int, n: int, device: torch.device, with_target_logit: bool = False) -> int:
    """The bytes of :func:`empty_tile_lse`'s buffers at :func:`launch_config`'s tiles (the memory model's)."""
    tiles = triton.cdiv(n, launch_config(device).block_n)
    return rows * (tiles * 2 * 4 + (4 if with_target_logit else 0))


def kernel_constants(
    config: GemmConfig,
    has_bias: bool,
    tile_lse: Optional[TileLse] = None,
    *,
    relative: bool = False,
) -> dict:
    """The compile-time arguments (and launch options) the kernels take for ``config``."""
    return {
        "HAS_BIAS": has_bias,
        "TILE_LSE": tile_lse is not None,
        "HAS_SOFTCAP": tile_lse is not None and tile_lse.softcap > 0.0,
        "RELATIVE": relative,
        "UPCAST": TRITON_INTERPRET,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "CHAIN_BLOCKS": config.chain_blocks,
        "KAHAN": config.kahan,
        "GROUP_M": config.group_m,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def compensated_logits_mm(
    x_c: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[GemmConfig] = None,
    tile_lse: Optional[TileLse] = None,
    target: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out = x_c @ weight.T (+ bias)`` in fp32 with the compensated sum over K (see the module docstring).

    ``x_c`` [M, K] and ``weight`` [N, K] are bf16 or fp16 (the same dtype), ``out`` an fp32 [M, N] tensor with
    unit stride along N (a row slice of a larger buffer is fine), ``bias`` an optional [N] tensor (added in
    fp32). Operands whose last dimension is not unit-stride are made contiguous (a copy). ``config``
    overrides :func:`launch_config`. ``tile_lse``: buffers (:func:`empty_tile_lse`, at this config) that the
    epilogue fills with the rows' log-sum-exp partials (:class:`TileLse`); with them ``target`` (int64 [M]:
    each row's target column, or any value outside [0, N)) fills ``tile_lse.target_logit`` (:func:`target_logits`),
    and ``out`` may be of the operands' 16-bit dtype: it then holds each logit (softcapped) minus its row's
    maximum over its column tile, ``z - tile_lse.max[r, t]`` (0 in place of a -inf maximum), rounded once: the
    gradient's values, whose rounding is then relative to their distance from the maximum. Returns ``out``.
    """
    _check(x_c, weight, out, bias, tile_lse, target)
    config = config or launch_config(x_c.device)
    if tile_lse is not None:
        _check_tile_lse(tile_lse, x_c.shape[0], weight.shape[0], config, x_c.device)
    if not config.kahan and config.chain_blocks < 2:
        raise ValueError(
            "compensated_logits_mm: kahan=False needs chain_blocks >= 2 (a plain sum of one-block dots is the"
            f" pattern Triton folds back into one chain over K), got {config}"
        )
    if x_c.stride(1) != 1:
        x_c = x_c.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    m, k = x_c.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    grid = (tiles,)
    constants = kernel_constants(
        config,
        has_bias=bias is not None,
        tile_lse=tile_lse,
        relative=out.dtype != torch.float32,
    )
    bias_arg = bias if bias is not None else out  # a dummy pointer, never read without HAS_BIAS
    # dummy pointers and stride without TILE_LSE (never read or written)
    tile_max, tile_sum = (tile_lse.max, tile_lse.sum_exp) if tile_lse is not None else (out, out)
    tile_row_stride = tile_max.stride(0)
    softcap = tile_lse.softcap if tile_lse is not None else 0.0
    if config.tma and tma_usable(x_c, weight):
        TensorDescriptor = _tensor_descriptor()  # noqa: N806  (the class)
        x_desc = TensorDescriptor.from_tensor(x_c, [config.block_m, config.block_k])
        tma_store = config.tma_store and tma_store_usable(out)
        programs = (
            persistent_programs(x_c.device, tiles, config.programs_per_sm) if config.persistent else tiles
        )
        _compensated_mm_tma_kernel[(programs,)](
            x_desc,
            TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k]),
            # out's descriptor, or a stand-in never read without TMA_STORE
            TensorDescriptor.from_tensor(out, [config.block_m, config.block_n // 2]) if tma_store else x_desc,
            bias_arg,
            out,
            tile_max,
            tile_sum,
            m,
            n,
            k,
            out.stride(0),
            tile_row_stride,
            softcap,
            programs,
            TMA_STORE=tma_store,
            **constants,
        )
    else:
        _compensated_mm_kernel[grid](
            x_c,
            weight,
            bias_arg,
            out,
            tile_max,
            tile_sum,
            m,
            n,
            k,
            x_c.stride(0),
            weight.stride(0),
            out.stride(0),
            tile_row_stride,
            softcap,
            EVEN_K=k % config.block_k == 0,
            **constants,
        )
    # The target logits in their own small kernel: in the epilogue the column search cost the GEMM more (run90).
    if target is not None:
        target_logits(x_c, weight, target.contiguous(), bias, softcap, out=tile_lse.target_logit[:m])
    return out


def _check(
    x_c: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    bias: Optional[torch.Tensor],
    tile_lse: Optional[TileLse] = None,
    target: Optional[torch.Tensor] = None,
) -> None:
    """Python errors for arguments the kernel would misread (before it runs)."""
    if x_c.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"compensated_logits_mm: x_c and weight must be 2-D, got {tuple(x_c.shape)} and {tuple(weight.shape)}"
        )
    if x_c.shape[1] != weight.shape[1]:
        raise ValueError(
            f"compensated_logits_mm: x_c [M, K] and weight [N, K] differ in K: {tuple(x_c.shape)} and"
            f" {tuple(weight.shape)}"
        )
    if x_c.dtype not in OPERAND_DTYPES or weight.dtype != x_c.dtype:
        raise TypeError(
            "compensated_logits_mm: x_c and weight must both be bfloat16 or both float16, got"
            f" {x_c.dtype} and {weight.dtype}"
        )
    expected = (x_c.shape[0], weight.shape[0])
    relative_ok = tile_lse is not None and out.dtype == x_c.dtype
    if tuple(out.shape) != expected or not (out.dtype == torch.float32 or relative_ok):
        raise ValueError(
            f"compensated_logits_mm: out must be float32 of shape {expected}, or {x_c.dtype} with tile_lse (the"
            f" logits relative to their tiles' maxima, which only tile_lse records), got {out.dtype}"
            f" {tuple(out.shape)}"
        )
    if target is not None:
        if tile_lse is None or tile_lse.target_logit is None:
            raise ValueError("compensated_logits_mm: target needs tile_lse with a target_logit buffer")
        if target.dtype != torch.int64 or tuple(target.shape) != (x_c.shape[0],):
            raise ValueError(
                f"compensated_logits_mm: target must be int64 [M]=[{x_c.shape[0]}], got {target.dtype}"
                f" {tuple(target.shape)}"
            )
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError("compensated_logits_mm: out needs unit stride along its last dimension")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"compensated_logits_mm: bias must be [N]=[{weight.shape[0]}], got {tuple(bias.shape)}"
        )
    for name, tensor in (("weight", weight), ("out", out), ("bias", bias), ("target", target)):
        if tensor is not None and tensor.device != x_c.device:
            raise ValueError(
                f"compensated_logits_mm: {name} is on {tensor.device} but x_c is on {x_c.device}"
            )


def _check_tile_lse(tile_lse: TileLse, m: int, n: int, config: GemmConfig, device: torch.device) -> None:
    """Python errors for partial buffers the epilogue would overrun or misread."""
    tiles = triton.cdiv(n, config.block_n)
    for name, t in (("max", tile_lse.max), ("sum_exp", tile_lse.sum_exp)):
        if (
            t.dtype != torch.float32
            or t.dim() != 2
            or t.shape[0] < m
            or t.shape[1] != tiles
            or t.stride(1) != 1
        ):
            raise ValueError(
                f"compensated_logits_mm: tile_lse.{name} must be float32 [>= {m}, {tiles}] (cdiv(N, block_n ="
                f" {config.block_n})) with unit stride along tiles, got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(
                f"compensated_logits_mm: tile_lse.{name} is on {t.device} but x_c is on {device}"
            )
    if tile_lse.max.stride(0) != tile_lse.sum_exp.stride(0):
        raise ValueError("compensated_logits_mm: tile_lse.max and .sum_exp need the same row stride")
    if tile_lse.block_n != config.block_n:
        raise ValueError(
            f"compensated_logits_mm: tile_lse is of {tile_lse.block_n}-wide tiles, the config's are {config.block_n}"
        )
    target_logit = tile_lse.target_logit
    if target_logit is not None and (
        target_logit.dtype != torch.float32
        or target_logit.dim() != 1
        or target_logit.shape[0] < m
        or target_logit.stride(0) != 1
        or target_logit.device != device
    ):
        raise ValueError(
            f"compensated_logits_mm: tile_lse.target_logit must be float32 [>= {m}] with unit stride on {device},"
            f" got {target_logit.dtype} {tuple(target_logit.shape)} on {target_logit.device}"
        )
