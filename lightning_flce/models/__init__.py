"""Ready-made LightningModules that compute their LM loss with :class:`~lightning_flce.mixin.FLCEMixin`."""

from lightning_flce.models.gpt import TinyGPT
from lightning_flce.models.hf import HFCausalLM, compile_decoder_layers

__all__ = ["HFCausalLM", "TinyGPT", "compile_decoder_layers"]
