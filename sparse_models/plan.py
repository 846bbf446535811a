"""The per-layer plan: what each layer does in prefill and in decode, computed once from the config.

Roles (strings, so that reports and tests read naturally):

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

from .config import ConfigError, SparseAttentionConfig, default_reselection_layer

PREFILL_ROLES = ("dense", "token-sparse", "pod-anchor", "pod-shared")
DECODE_ROLES = ("dense", "full", "full+select", "sparse-over-selected", "pod-anchor", "pod-shared", "quest",
                "streaming")


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


def tidal_selection_layers(config: SparseAttentionConfig, num_layers: int, family: str | None = None) -> list[int]:
    """The TidalDecode selection layers: the configured ones, else layer 2 + the re-selection layer."""
    tidal = config.tidal
    if tidal.selection_layers is not None:
        bad = [layer for layer in tidal.selection_layers if layer >= num_layers]
        if bad:
            raise ConfigError(f"tidal.selection_layers={tidal.selection_layers} is invalid: layers {bad} do not exist "
                              f"in a model with {num_layers} layers")
        return sorted(tidal.selection_layers)
    candidates = {2, default_reselection_layer(num_layers, family)}
    layers = sorted(layer for layer in candidates if layer < num_layers and layer not in tidal.full_layers)
    if not layers:
        first_free = next((layer for layer in range(num_layers) if layer not in tidal.full_layers), None)
        if first_free is None:
            raise ConfigError(f"tidal.full_layers={tidal.full_layers} is invalid: it covers all {num_layers} layers, "
                              f"leaving none for selection")
        layers = [first_free]
    return layers


def _check_layers(name: str, layers, num_layers: int) -> None:
    bad = [layer for layer in (layers or []) if layer >= num_layers]
    if bad:
        raise ConfigError(f"{name}={list(layers)} is invalid: layers {bad} do not exist in a model with {num_layers} layers")


def token_sparse_layers(config: SparseAttentionConfig, num_layers: int) -> list[int]:
    """Token Sparse layers: the configured list, else the second half (METHODS.md C.2 fallback)."""
    layers = config.token_sparse.sparse_layers
    if layers is None:
        return list(range(num_layers // 2, num_layers))
    _check_layers("token_sparse.sparse_layers", layers, num_layers)
    return sorted(layers)


def build_plan(config: SparseAttentionConfig, num_layers: int, num_kv_heads: int,
               family: str | None = None) -> list[LayerPlan]:
    """One :class:`LayerPlan` per layer. Raises ConfigError if the config does not fit the model."""
    uses_pod = config.prefill_scheme == "pod" or config.decode_scheme in ("pod", "pod+tidal")
    anchors = config.pod.anchor_map(num_layers, num_kv_heads) if uses_pod else [[layer] * num_kv_heads
                                                                                for layer in range(num_layers)]
    if config.pod.sharing == "scores" and config.decode_scheme == "pod+tidal":
        raise ConfigError("pod.sharing='scores' is invalid with decode_scheme='pod+tidal': TidalDecode selects over "
                          "one key per position, score sharing has none; use pod.sharing='keys' or decode_scheme='pod'")
    if config.decode_scheme == "pod+tidal" and config.tidal.correction_period is not None:
        raise ConfigError(f"tidal.correction_period={config.tidal.correction_period} is invalid with "
                          f"decode_scheme='pod+tidal': re-running past tokens needs their proximal keys, which POD's "
                          f"ring has already overwritten; use null (no correction) or decode_scheme='tidal'")
    sparse_prefill = set(token_sparse_layers(config, num_layers)) if config.prefill_scheme == "token_sparse" else set()
    tidal_like = config.decode_scheme in ("tidal", "pod+tidal")
    if tidal_like:
        _check_layers("tidal.full_layers", config.tidal.full_layers, num_layers)
        selection = tidal_selection_layers(config, num_layers, family)
    if config.decode_scheme == "quest":
        _check_layers("quest.dense_layers", config.quest.dense_layers, num_layers)
    plan = []
    for layer in range(num_layers):
        row = tuple(anchors[layer])
        shared = any(a != layer for a in row)
        if config.prefill_scheme == "pod":
            prefill = "pod-shared" if shared else "pod-anchor"
        elif layer in sparse_prefill:
            prefill = "token-sparse"
        else:
            prefill = "dense"
        source = None
        if config.decode_scheme == "dense":
            decode = "dense"
        elif config.decode_scheme == "pod":
            decode = "pod-shared" if shared else "pod-anchor"
        elif tidal_like:
            below = [s for s in selection if s <= layer]
            if layer in config.tidal.full_layers:
                decode = "full"
            elif layer in selection:
                decode = "full+select"
            elif below:
                decode, source = "sparse-over-selected", below[-1]
            else:
                decode = "full"  # no selection layer below yet: nothing to be sparse over
        elif config.decode_scheme == "quest":
            decode = "dense" if layer in config.quest.dense_layers else "quest"
        else:
            decode = "streaming"
        plan.append(LayerPlan(layer, prefill, decode, row, config.uses_pod_cache, source))
    return plan


def describe_plan(plan: list[LayerPlan]) -> str:
    """A small table, one line per layer (for logs and reports)."""
    lines = ["layer  prefill        decode                  anchors"]
    for p in plan:
        decode = p.decode + (f"<-{p.selection_source}" if p.selection_source is not None else "")
        lines.append(f"{p.layer:5d}  {p.prefill:13s}  {decode:22s}  {list(p.anchors)}")
    return "\n".join(lines)
