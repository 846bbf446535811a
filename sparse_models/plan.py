"""The per-layer plan: what each layer does in prefill and in decode, computed once from the config.

Each scheme names its roles (strings, so that reports and tests read naturally) through its
``prefill_roles`` / ``decode_roles`` (``sparse_models/schemes/<method>.py``); the plan asks the
registry for the config's prefill and decode schemes and stores one :class:`LayerPlan` per layer.
Nothing here names a scheme; the built-in schemes' roles are:

prefill: ``dense`` | ``token-sparse`` (Token Sparse Attention, arXiv 2602.03216) |
         ``pod-anchor`` (every KV head is its own anchor: plain causal attention) |
         ``pod-shared`` (some KV heads read distant keys from an anchor layer, POD arXiv 2412.02252)
decode:  ``dense`` | ``full`` (TidalDecode full layer) | ``full+select`` (TidalDecode selection layer,
         arXiv 2410.05076) | ``sparse-over-selected`` | ``pod-anchor`` | ``pod-shared`` |
         ``quest`` (arXiv 2406.10774) | ``streaming`` (StreamingLLM)

With ``decode_scheme="pod+tidal"`` the decode roles are TidalDecode's and ``LayerPlan.pod_keys`` says
that the keys a layer reads come from POD's shared-key cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import SparseAttentionConfig
from .schemes.registry import get_scheme


@dataclass(frozen=True)
class LayerPlan:
    """One layer's roles.

    Attributes:
        layer: layer index.
        prefill: role in a fresh prefill (and in training forwards).
        decode: role in a one-token decode step.
        anchors: anchor layer per KV head (POD); ``(layer,) * Hkv`` when POD is off.
        pod_keys: the cache keeps this layer's keys POD-style (non-anchor heads: sinks + ring only).
        selection_source: for ``sparse-over-selected``, the TidalDecode selection layer whose indices
            this layer reads; else None.
    """

    layer: int
    prefill: str
    decode: str
    anchors: tuple[int, ...]
    pod_keys: bool
    selection_source: int | None = None

    @property
    def own_anchor_heads(self) -> tuple[int, ...]:
        """KV heads whose anchor is this layer (their keys are kept for every position)."""
        return tuple(h for h, a in enumerate(self.anchors) if a == self.layer)

    @property
    def shared_heads(self) -> tuple[int, ...]:
        """KV heads that read distant keys from an earlier layer (keys kept for sinks + ring only)."""
        return tuple(h for h, a in enumerate(self.anchors) if a != self.layer)


def model_family(model_config) -> str | None:
    """``llama3`` / ``llama2`` for the TidalDecode re-selection defaults, else None."""
    if getattr(model_config, "model_type", "").replace("podkit_", "") != "llama":
        return None
    rope = getattr(model_config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type") == "llama3" or getattr(model_config, "vocab_size", 0) >= 128000:
        return "llama3"
    if getattr(model_config, "vocab_size", 0) == 32000:
        return "llama2"
    return None


def build_plan(config: SparseAttentionConfig, num_layers: int, num_kv_heads: int,
               family: str | None = None) -> list[LayerPlan]:
    """One :class:`LayerPlan` per layer. Raises ConfigError if the config does not fit the model."""
    prefill, decode = get_scheme(config.prefill_scheme, "prefill"), get_scheme(config.decode_scheme, "decode")
    uses_anchors = prefill.uses_anchors or decode.uses_anchors
    anchors = config.pod.anchor_map(num_layers, num_kv_heads) if uses_anchors else [[layer] * num_kv_heads
                                                                                    for layer in range(num_layers)]
    for scheme in (prefill, decode):
        if scheme.check is not None:
            scheme.check(config, num_layers)
    prefill_roles = prefill.prefill_roles(config, num_layers, anchors)
    decode_roles = decode.decode_roles(config, num_layers, anchors, family)
    return [LayerPlan(layer, prefill_roles[layer], decode_roles[layer][0], tuple(anchors[layer]), decode.cache.pod_keys,
                      decode_roles[layer][1]) for layer in range(num_layers)]


def describe_plan(plan: list[LayerPlan]) -> str:
    """A small table, one line per layer (for logs and reports)."""
    lines = ["layer  prefill        decode                  anchors"]
    for p in plan:
        decode = p.decode + (f"<-{p.selection_source}" if p.selection_source is not None else "")
        lines.append(f"{p.layer:5d}  {p.prefill:13s}  {decode:22s}  {list(p.anchors)}")
    return "\n".join(lines)
