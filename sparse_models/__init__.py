"""podkit's sparse-attention models: config, per-layer plan, cache, schemes and model classes.

Importing this package registers ``podkit_llama``, ``podkit_mistral`` and ``podkit_qwen2`` with
transformers' ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import SparseKVCache
from .capture import capture_attention_inputs, capture_residual_stream
from .config import ConfigError, SparseAttentionConfig
from .kv_bytes import KVBytes
from .modeling_llama import PodkitLlamaConfig, PodkitLlamaForCausalLM, PodkitLlamaModel
from .modeling_mistral import PodkitMistralConfig, PodkitMistralForCausalLM, PodkitMistralModel
from .modeling_qwen2 import PodkitQwen2Config, PodkitQwen2ForCausalLM, PodkitQwen2Model
from .plan import LayerPlan, build_plan, describe_plan
from .schemes.token_sparse import TokenSparseStats
from .smollm2 import default_model_path, load_default_model, load_default_tokenizer

for _config, _model, _lm in ((PodkitLlamaConfig, PodkitLlamaModel, PodkitLlamaForCausalLM),
                             (PodkitMistralConfig, PodkitMistralModel, PodkitMistralForCausalLM),
                             (PodkitQwen2Config, PodkitQwen2Model, PodkitQwen2ForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

PODKIT_CLASSES = {"llama": PodkitLlamaForCausalLM, "mistral": PodkitMistralForCausalLM, "qwen2": PodkitQwen2ForCausalLM}

__all__ = [
    "SparseAttentionConfig", "ConfigError", "SparseKVCache", "KVBytes", "LayerPlan", "build_plan", "describe_plan",
    "PodkitLlamaConfig", "PodkitLlamaModel", "PodkitLlamaForCausalLM",
    "PodkitMistralConfig", "PodkitMistralModel", "PodkitMistralForCausalLM",
    "PodkitQwen2Config", "PodkitQwen2Model", "PodkitQwen2ForCausalLM", "PODKIT_CLASSES",
    "TokenSparseStats", "capture_attention_inputs", "capture_residual_stream",
    "load_default_model", "load_default_tokenizer", "default_model_path",
]
