"""The chunk losses (:class:`~lightning_flce.chunk_loss.ChunkLoss` plug-ins of the chunk engine), one module each:
:mod:`~lightning_flce.losses.cross_entropy` (the op's loss), :mod:`~lightning_flce.losses.logprobs` (per-token
log-probabilities and entropy with their gradients for any upstream gradient), :mod:`~lightning_flce.losses.policy`
(the clipped policy-gradient family, its gradients computed in forward), :mod:`~lightning_flce.losses.distillation`
(a frozen teacher's divergence from the student, the teacher an auxiliary head of the engine); and
:mod:`~lightning_flce.losses.autograd`, a chunk loss derived by autograd from a PyTorch formula of the chunk's logits
(a new loss's prototype before its kernels, and the tests' oracle of the hand-written ones)."""
