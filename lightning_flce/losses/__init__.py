"""The chunk losses (:class:`~lightning_flce.chunk_loss.ChunkLoss` plug-ins of the chunk engine), one module each:
:mod:`~lightning_flce.losses.cross_entropy` (the op's loss) and :mod:`~lightning_flce.losses.logprobs` (per-token
log-probabilities and entropy with their gradients for any upstream gradient)."""
