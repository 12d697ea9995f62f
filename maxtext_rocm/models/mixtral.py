"""The Mixtral block (Mistral AI, 2024): Llama's block with its MLP replaced by a mixture of experts.

Attention, norms, residuals and the decoder stack are Llama's own (models/llama.py); only the
feed-forward layer differs, so that is all this file says.
"""

from __future__ import annotations

from flax import linen as nn

from maxtext_rocm.models.llama import LlamaBlock
from maxtext_rocm.models.moe import MoE


class MixtralBlock(LlamaBlock):
    """Pre-norm attention and a sparse mixture of SwiGLU experts, each added to the residual."""

    def feed_forward(self) -> nn.Module:
        return MoE(self.cfg, self.policy, self.expert_exchange, name="moe")
