"""podkit's Mistral: transformers' Mistral with podkit's decoder loop.

# diff with Mistral: the config carries ``sparse_attention``; ``MistralModel.forward`` is replaced by
# podkit's loop (``PodkitModelMixin``); ``MistralForCausalLM`` gains scheme overrides in
# ``from_pretrained``, a ``SparseKVCache`` in ``generate()`` and ``token_sparse_stats``.
# Parameter names are unchanged, so plain Mistral checkpoints load as they are.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralForCausalLM, MistralModel, MistralPreTrainedModel

from .config import SparseAttentionConfig
from .modeling_common import PodkitCausalLMMixin, PodkitModelMixin


@strict
class PodkitMistralConfig(MistralConfig):
    """MistralConfig + ``sparse_attention`` (a SparseAttentionConfig as a dict; validated)."""

    model_type = "podkit_mistral"
    sparse_attention: dict | None = None

    def __post_init__(self, **kwargs):
        self.sparse_attention = SparseAttentionConfig.from_dict(self.sparse_attention).to_dict()
        super().__post_init__(**kwargs)


class PodkitMistralModel(PodkitModelMixin, MistralModel):
    config_class = PodkitMistralConfig

    def __init__(self, config: PodkitMistralConfig):
        MistralModel.__init__(self, config)
        self._podkit_init(config)


class PodkitMistralForCausalLM(PodkitCausalLMMixin, MistralForCausalLM):
    config_class = PodkitMistralConfig

    def __init__(self, config: PodkitMistralConfig):
        MistralPreTrainedModel.__init__(self, config)
        self.model = PodkitMistralModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
