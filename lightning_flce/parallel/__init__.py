"""Vocab parallelism: the LM head's ``[V, H]`` weight sharded over V across a process group.

- :mod:`~lightning_flce.parallel.op`: the vocab-parallel op (``vocab_parallel_fused_linear_cross_entropy``,
  ``..._with_stats``), a front end of the chunk engine (:mod:`lightning_flce.engine`);
- :mod:`~lightning_flce.parallel.distill`: vocab-parallel distillation (``vocab_parallel_fused_linear_distillation``:
  the student's and the teacher's heads sharded alike; ``..._from_top_k``: a cached teacher), the same engine and
  distillation chunk loss;
- :mod:`~lightning_flce.parallel.top_k`: a sharded head's top k per token (``vocab_parallel_fused_linear_top_k``: a
  tensor-parallel teacher's cache);
- :mod:`~lightning_flce.parallel.agreement`: the ranks' agreement on the call (one all-reduce, first);
- :mod:`~lightning_flce.parallel.head`: :class:`VocabParallelHead` and the default shard layout.

The FSDP2 helpers that used to live here are in :mod:`lightning_flce.fsdp` (still importable from here).
"""

from lightning_flce.fsdp import fully_shard_lm, register_fsdp_method, register_fsdp_step_methods
from lightning_flce.parallel.distill import (
    vocab_parallel_fused_linear_distillation,
    vocab_parallel_fused_linear_distillation_from_top_k,
)
from lightning_flce.parallel.head import VocabParallelHead, init_rows_like_linear, vocab_shard_range
from lightning_flce.parallel.op import (
    vocab_parallel_fused_linear_cross_entropy,
    vocab_parallel_fused_linear_cross_entropy_with_stats,
)
from lightning_flce.parallel.top_k import vocab_parallel_fused_linear_top_k

__all__ = [
    "VocabParallelHead",
    "fully_shard_lm",
    "init_rows_like_linear",
    "register_fsdp_method",
    "register_fsdp_step_methods",
    "vocab_parallel_fused_linear_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy_with_stats",
    "vocab_parallel_fused_linear_distillation",
    "vocab_parallel_fused_linear_distillation_from_top_k",
    "vocab_parallel_fused_linear_top_k",
    "vocab_shard_range",
]
