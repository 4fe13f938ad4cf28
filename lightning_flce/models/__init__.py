"""Ready-made LightningModules that compute their LM loss with :class:`~lightning_flce.mixin.FLCEMixin`."""

from lightning_flce.models.distill import DistillationModule
from lightning_flce.models.gpt import TinyGPT
from lightning_flce.models.hf import HFCausalLM, compile_decoder_layers
from lightning_flce.models.litgpt import LitGPTCausalLM, litgpt_hidden_states
from lightning_flce.models.teacher_cache import TeacherTopKModule

__all__ = [
    "DistillationModule",
    "HFCausalLM",
    "LitGPTCausalLM",
    "TeacherTopKModule",
    "TinyGPT",
    "compile_decoder_layers",
    "litgpt_hidden_states",
]
