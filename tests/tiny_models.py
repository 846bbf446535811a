"""The test tree's one factory for tiny random models (plain transformers or podkit; Llama, Mistral, Qwen2).

Every test builds its tiny configs and models here (tests/test_tiny_model_factory.py fails on a ``LlamaConfig(``
anywhere else). Import it as ``from tests.tiny_models import tiny_config, tiny_model`` (the repository root is on
``sys.path``: setup.cfg's ``pythonpath = .``; a child process needs the root on its path or as its cwd).

- ``tiny_config(group, layers, ...)``: a config from a GQA group (``GQA_SHAPES``: query heads, KV heads, hidden),
  overridable by ``heads`` / ``kv_heads`` / ``hidden``; ``intermediate`` defaults to twice the hidden size,
  ``positions`` to 512 (None: the class default), ``rope`` to the class default (for Llama that is
  ``ROPE_DEFAULT``); any other config field goes through ``**extra`` (odd values included, for validation tests).
- ``tiny_model(group, layers, sparse, seed, ...)``: ``torch.manual_seed(seed)`` (None: the caller's RNG state),
  the model of the config's class, ``.eval()`` unless ``eval=False``; ``qk_std`` redraws the q/k projections
  from N(0, qk_std) (``SHARP_QK_STD``: sharper, less uniform attention than the default init), ``scale``
  multiplies every parameter; ``sparse`` (a SparseAttentionConfig or its dict) is set last.
- ``twin_config(config, podkit=...)``: the same fields as the other class (plain <-> podkit) of a family.

Imports of transformers / sparse_models are lazy, so that importing this module costs nothing.
"""

from __future__ import annotations

import torch

# group -> (query heads, KV heads, hidden)
GQA_SHAPES = {1: (4, 4, 64), 3: (6, 2, 48), 4: (8, 2, 64), 8: (8, 1, 64)}
VOCAB = 61
ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}  # LlamaConfig's own default
SHARP_QK_STD = 0.35
FAMILIES = ("llama", "mistral", "qwen2")
# fields of a config's dict that are not constructor arguments of the twin class
_NOT_TWIN = ("sparse_attention", "model_type", "architectures", "transformers_version")


def _classes(family: str, podkit: bool):
    """(config class, model class) of ``family``, podkit's or transformers'."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {FAMILIES}")
    if podkit:
        from sparse_models import PODKIT_CLASSES

        model_cls = PODKIT_CLASSES[family]
        return model_cls.config_class, model_cls
    import transformers

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def _model_class(config):
    for family in FAMILIES:
        for podkit in (True, False):
            config_cls, model_cls = _classes(family, podkit)
            if type(config) is config_cls:
                return model_cls
    raise TypeError(f"no tiny model class for {type(config).__name__}")


def tiny_config(group: int = 3, layers: int = 4, *, vocab: int = VOCAB, heads: int | None = None,
                kv_heads: int | None = None, hidden: int | None = None, intermediate: int | None = None,
                positions: int | None = 512, rope: dict | None = None, family: str = "llama", podkit: bool = True,
                **extra):
    """A tiny config: GQA ``group``'s shape (or ``heads`` / ``kv_heads`` / ``hidden``), ``layers`` layers."""
    shape_heads, shape_kv, shape_hidden = GQA_SHAPES[group]
    heads = shape_heads if heads is None else heads
    kv_heads = shape_kv if kv_heads is None else kv_heads
    hidden = shape_hidden if hidden is None else hidden
    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden if intermediate is None
                  else intermediate, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads)
    if positions is not None:
        fields["max_position_embeddings"] = positions
    if rope is not None:
        fields["rope_parameters"] = rope
    config_cls, _ = _classes(family, podkit)
    return config_cls(**fields, **extra)  # a field in both is a TypeError, not a silent override


def twin_config(config, *, podkit: bool, family: str = "llama"):
    """``config``'s fields as ``family``'s podkit (``podkit=True``) or plain transformers config."""
    config_cls, _ = _classes(family, podkit)
    return config_cls(**{k: v for k, v in config.to_dict().items() if k not in _NOT_TWIN})


def tiny_model(group: int = 3, layers: int = 4, sparse=None, seed: int | None = 0, *, config=None,
               qk_std: float | None = None, scale: float | None = None, eval: bool = True, **config_fields):
    """A tiny random model of ``config`` (default: ``tiny_config(group, layers, **config_fields)``)."""
    if config is None:
        config = tiny_config(group, layers, **config_fields)
    elif config_fields:
        raise TypeError(f"config given, and config fields {sorted(config_fields)} too")
    if seed is not None:
        torch.manual_seed(seed)
    model = _model_class(config)(config)
    if eval:
        model.eval()
    with torch.no_grad():
        if scale is not None:
            for p in model.parameters():
                p.mul_(scale)
        if qk_std is not None:
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.normal_(0, qk_std)
    if sparse is not None:
        from sparse_models import SparseAttentionConfig

        model.set_sparse_attention(sparse if isinstance(sparse, SparseAttentionConfig)
                                   else SparseAttentionConfig.from_dict(sparse))
    return model
