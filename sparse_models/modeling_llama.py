"""podkit's Llama (2, 3, 3.1 with rope scaling): transformers' Llama with podkit's decoder loop.

# diff with Llama: the config carries ``sparse_attention``; ``LlamaModel.forward`` is replaced by
# podkit's loop (``PodkitModelMixin``); ``LlamaForCausalLM`` gains scheme overrides in
# ``from_pretrained``, a ``SparseKVCache`` in ``generate()`` and ``token_sparse_stats``.
# Parameter names are unchanged, so plain Llama checkpoints load as they are.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel, LlamaPreTrainedModel

from .config import SparseAttentionConfig
from .modeling_common import PodkitCausalLMMixin, PodkitModelMixin


@strict
class PodkitLlamaConfig(LlamaConfig):
    """LlamaConfig + ``sparse_attention`` (a SparseAttentionConfig as a dict; validated)."""

    model_type = "podkit_llama"
    sparse_attention: dict | None = None

    def __post_init__(self, **kwargs):
        self.sparse_attention = SparseAttentionConfig.from_dict(self.sparse_attention).to_dict()
        super().__post_init__(**kwargs)


class PodkitLlamaModel(PodkitModelMixin, LlamaModel):
    config_class = PodkitLlamaConfig

    def __init__(self, config: PodkitLlamaConfig):
        LlamaModel.__init__(self, config)
        self._podkit_init(config)


class PodkitLlamaForCausalLM(PodkitCausalLMMixin, LlamaForCausalLM):
    config_class = PodkitLlamaConfig

    def __init__(self, config: PodkitLlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        self.model = PodkitLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
