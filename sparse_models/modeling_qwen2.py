"""podkit's Qwen2 (q/k/v biases kept by the reused projections): transformers' Qwen2 with podkit's decoder loop.

# diff with Qwen2: the config carries ``sparse_attention``; ``Qwen2Model.forward`` is replaced by
# podkit's loop (``PodkitModelMixin``); ``Qwen2ForCausalLM`` gains scheme overrides in
# ``from_pretrained``, a ``SparseKVCache`` in ``generate()`` and ``token_sparse_stats``.
# Parameter names are unchanged, so plain Qwen2 checkpoints load as they are.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, Qwen2Model, Qwen2PreTrainedModel

from .config import SparseAttentionConfig
from .modeling_common import PodkitCausalLMMixin, PodkitModelMixin


@strict
class PodkitQwen2Config(Qwen2Config):
    """Qwen2Config + ``sparse_attention`` (a SparseAttentionConfig as a dict; validated)."""

    model_type = "podkit_qwen2"
    sparse_attention: dict | None = None

    def __post_init__(self, **kwargs):
        self.sparse_attention = SparseAttentionConfig.from_dict(self.sparse_attention).to_dict()
        super().__post_init__(**kwargs)


class PodkitQwen2Model(PodkitModelMixin, Qwen2Model):
    config_class = PodkitQwen2Config

    def __init__(self, config: PodkitQwen2Config):
        Qwen2Model.__init__(self, config)
        self._podkit_init(config)


class PodkitQwen2ForCausalLM(PodkitCausalLMMixin, Qwen2ForCausalLM):
    config_class = PodkitQwen2Config

    def __init__(self, config: PodkitQwen2Config):
        Qwen2PreTrainedModel.__init__(self, config)
        self.model = PodkitQwen2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
