"""The validated configuration tree of podkit's attention schemes.

One dataclass per method, gathered in :class:`SparseAttentionConfig`. Every dataclass checks its
fields in ``__post_init__`` and raises :class:`ConfigError` with a message that names the field, the
value and what is allowed. The tree round-trips through ``to_dict`` / ``from_dict`` so that it can
live in a checkpoint's ``config.json`` under the key ``sparse_attention``, and it accepts flat
load-time overrides such as ``decode_scheme="tidal", tidal_budget=256``
(:meth:`SparseAttentionConfig.with_overrides`).

Defaults are the papers' (see each sub-config's docstring).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFILL_SCHEMES = ("dense", "token_sparse", "pod")
DECODE_SCHEMES = ("dense", "tidal", "pod", "pod+tidal", "quest", "streaming")


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field, the value and what is allowed."""


def _fail(field_name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{field_name}={value!r} is invalid: {allowed}")


def _check_int(field_name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(field_name, value, f"expected an integer >= {minimum}")


def _check_layer_list(field_name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        _fail(field_name, value, "expected a list of non-negative layer indices")
    if len(set(value)) != len(value):
        _fail(field_name, value, "layer indices must be unique")


@dataclass
class PodConfig:
    """POD: Proximal tokens Over Distant tokens (Ma et al., arXiv 2412.02252).

    A query attends to *proximal* keys (the first ``sink_tokens`` positions plus the last
    ``recent_window`` positions up to itself) with the layer's own keys, and to every other
    (*distant*) position with the keys of its block's anchor layer; both parts go through one
    softmax, i.e. a log-sum-exp merge with the parameter-free gate g = sigmoid(lse_P - lse_D).

    ``anchor_layers[layer][kv_head]`` is the anchor layer of that (layer, KV head); blocks are
    consecutive layers whose lowest layer is the anchor, so each entry equals either ``layer``
    or the entry of ``layer - 1`` for the same head. ``None`` means every layer is its own anchor
    (exactly dense attention). ``blocks_file`` points to the JSON written by the exploration
    (``sparse_models.calibration.pod_similarity``) and is resolved by the model at load time.

    ``sharing="keys"`` is the paper's v2 (own query, anchor keys; default); ``"scores"`` is v1
    (the anchor layer's distant logits reused with the layer's own values).
    ``gate_tau``: if set, a query whose estimated proximal gate is >= tau skips distant attention
    (paper: 0.7). ``gate_estimate`` says how the gate is pre-evaluated under key sharing:
    ``"exact"`` computes both parts and then discards the distant one (for testing), ``"anchor"``
    reuses the gate the anchor layer computed for the same query (METHODS.md A.4, reading ii).
    """

    sink_tokens: int = 16
    recent_window: int = 4080
    anchor_layers: list[list[int]] | None = None
    blocks_file: str | None = None
    sharing: str = "keys"
    gate_tau: float | None = None
    gate_estimate: str = "anchor"

    def __post_init__(self) -> None:
        _check_int("pod.sink_tokens", self.sink_tokens, 0)
        _check_int("pod.recent_window", self.recent_window, 1)
        if self.sharing not in ("keys", "scores"):
            _fail("pod.sharing", self.sharing, "expected 'keys' (paper v2, default) or 'scores' (paper v1)")
        if self.gate_tau is not None and (isinstance(self.gate_tau, bool) or not isinstance(self.gate_tau, (int, float))
                                          or not 0.0 < float(self.gate_tau) <= 1.0):
            _fail("pod.gate_tau", self.gate_tau, "expected null or a number in (0, 1] (paper: 0.7)")
        if self.gate_estimate not in ("anchor", "exact"):
            _fail("pod.gate_estimate", self.gate_estimate, "expected 'anchor' or 'exact'")
        if self.anchor_layers is not None:
            validate_anchor_layers(self.anchor_layers)

    def anchor_map(self, num_layers: int, num_kv_heads: int) -> list[list[int]]:
        """The [num_layers][num_kv_heads] anchor map, checked against the model's shape."""
        if self.anchor_layers is None:
            return [[layer] * num_kv_heads for layer in range(num_layers)]
        if len(self.anchor_layers) != num_layers or any(len(row) != num_kv_heads for row in self.anchor_layers):
            _fail("pod.anchor_layers", f"<{len(self.anchor_layers)} rows>",
                  f"expected {num_layers} rows (layers) of {num_kv_heads} entries (KV heads) for this model")
        return [list(row) for row in self.anchor_layers]


def validate_anchor_layers(anchor_layers: Any) -> None:
    """Check that an anchor map describes blocks of consecutive layers anchored at their lowest layer."""
    if not isinstance(anchor_layers, (list, tuple)) or not anchor_layers:
        _fail("pod.anchor_layers", anchor_layers, "expected a non-empty list (layers) of lists (KV heads)")
    width = None
    for layer, row in enumerate(anchor_layers):
        if not isinstance(row, (list, tuple)) or not row:
            _fail(f"pod.anchor_layers[{layer}]", row, "expected a non-empty list with one anchor layer per KV head")
        if width is None:
            width = len(row)
        elif len(row) != width:
            _fail(f"pod.anchor_layers[{layer}]", row, f"expected {width} entries, like row 0")
        for head, anchor in enumerate(row):
            previous = anchor_layers[layer - 1][head] if layer > 0 else 0
            if isinstance(anchor, bool) or not isinstance(anchor, int) or anchor not in (layer, previous):
                _fail(f"pod.anchor_layers[{layer}][{head}]", anchor,
                      f"a block is consecutive layers anchored at its lowest layer: expected {layer} (new block)"
                      + (f" or {previous} (the anchor of layer {layer - 1})" if layer > 0 else ""))


@dataclass
class TidalConfig:
    """TidalDecode: position-persistent sparse decode (Yang et al., arXiv 2410.05076).

    ``full_layers`` run dense decode; each of ``selection_layers`` runs full attention and selects
    the top-(budget-1) past positions plus the current one; every other layer attends only to the
    positions selected by the closest selection layer below it. ``selection_layers=None`` means
    layer 2 and the model family's re-selection layer (13 for Llama-3/3.1, 7 for Llama-2; for other
    families the layer at the same relative depth, 13/32, unless a calibration file says otherwise:
    ``sparse_models.calibration.tidal_reselection``). ``budget`` counts the current token.
    ``selection="query_head"`` is the paper's (each query head its own list); ``"kv_group"`` selects
    one list per KV head from the summed probabilities of its query heads (fewer bytes read).
    ``correction_period``: every T decode steps, recompute the K/V of the last T sparse-decoded tokens
    with full attention (paper §3.3, "KV cache correction"); ``None`` disables it (paper default).
    """

    budget: int = 2048
    full_layers: list[int] = field(default_factory=lambda: [0, 1])
    selection_layers: list[int] | None = None
    selection: str = "query_head"
    correction_period: int | None = None

    def __post_init__(self) -> None:
        _check_int("tidal.budget", self.budget, 2)
        _check_layer_list("tidal.full_layers", self.full_layers)
        _check_layer_list("tidal.selection_layers", self.selection_layers)
        if self.selection_layers is not None:
            if not self.selection_layers:
                _fail("tidal.selection_layers", self.selection_layers, "expected at least one selection layer, or null")
            overlap = set(self.selection_layers) & set(self.full_layers)
            if overlap:
                _fail("tidal.selection_layers", self.selection_layers,
                      f"layers {sorted(overlap)} are also in tidal.full_layers; a layer is full or selection, not both")
        if self.selection not in ("query_head", "kv_group"):
            _fail("tidal.selection", self.selection, "expected 'query_head' (paper) or 'kv_group'")
        if self.correction_period is not None:
            _check_int("tidal.correction_period", self.correction_period, 1)


@dataclass
class TokenSparseConfig:
    """Token Sparse Attention: per-head token compression in prefill (Jo et al., arXiv 2602.03216).

    On each sparse layer, the last ``window`` queries score every prefix key (mean softmax
    probability), scores are smoothed by an average pool of width ``pool_kernel``, the layer keeps
    the smallest prefix set whose dropped tail mass stays below ``coverage`` (at least
    ``min_tokens``), each head picks its own top tokens plus the window, attention runs on the
    compressed tokens and outputs scatter back with zeros elsewhere. ``sparse_layers=None`` takes
    the calibration file if given, else the second half of the layers. ``coverage=0`` is dense.
    """

    coverage: float = 0.005
    window: int = 128
    min_tokens: int = 1024
    pool_kernel: int = 7
    sparse_layers: list[int] | None = None
    calibration_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.coverage, bool) or not isinstance(self.coverage, (int, float)) or not 0.0 <= self.coverage < 1.0:
            _fail("token_sparse.coverage", self.coverage, "expected a number in [0, 1) (paper: 0.005)")
        _check_int("token_sparse.window", self.window, 1)
        _check_int("token_sparse.min_tokens", self.min_tokens, 0)
        _check_int("token_sparse.pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            _fail("token_sparse.pool_kernel", self.pool_kernel, "expected an odd width so the pooling stays centred")
        _check_layer_list("token_sparse.sparse_layers", self.sparse_layers)


@dataclass
class QuestConfig:
    """Quest: query-aware page selection (Tang et al., arXiv 2406.10774), a decode baseline.

    Pages of ``page_size`` tokens keep per-channel key min/max; each head keeps the top
    ``budget // page_size`` pages by the upper bound sum_i max(q_i M_i, q_i m_i), the current page
    always included. ``dense_layers`` run dense decode (paper: the first two).
    """

    page_size: int = 16
    budget: int = 2048
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])

    def __post_init__(self) -> None:
        _check_int("quest.page_size", self.page_size, 1)
        _check_int("quest.budget", self.budget, 1)
        if self.budget < self.page_size:
            _fail("quest.budget", self.budget, f"expected at least one page (quest.page_size={self.page_size})")
        _check_layer_list("quest.dense_layers", self.dense_layers)


@dataclass
class StreamingConfig:
    """StreamingLLM (Xiao et al., 2023): decode attends to ``sink_tokens`` + the ``recent_window`` latest."""

    sink_tokens: int = 4
    recent_window: int = 2044

    def __post_init__(self) -> None:
        _check_int("streaming.sink_tokens", self.sink_tokens, 0)
        _check_int("streaming.recent_window", self.recent_window, 1)


_SUBCONFIGS = {
    "pod": PodConfig,
    "tidal": TidalConfig,
    "token_sparse": TokenSparseConfig,
    "quest": QuestConfig,
    "streaming": StreamingConfig,
}


@dataclass
class SparseAttentionConfig:
    """Which scheme runs in each phase, and every method's parameters.

    ``prefill_scheme`` in ``PREFILL_SCHEMES``; ``decode_scheme`` in ``DECODE_SCHEMES``
    ("pod+tidal" = POD's shared-key cache with TidalDecode selection on top).
    """

    prefill_scheme: str = "dense"
    decode_scheme: str = "dense"
    pod: PodConfig = field(default_factory=PodConfig)
    tidal: TidalConfig = field(default_factory=TidalConfig)
    token_sparse: TokenSparseConfig = field(default_factory=TokenSparseConfig)
    quest: QuestConfig = field(default_factory=QuestConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)

    def __post_init__(self) -> None:
        if self.prefill_scheme not in PREFILL_SCHEMES:
            _fail("prefill_scheme", self.prefill_scheme, f"expected one of {', '.join(PREFILL_SCHEMES)}")
        if self.decode_scheme not in DECODE_SCHEMES:
            _fail("decode_scheme", self.decode_scheme, f"expected one of {', '.join(DECODE_SCHEMES)}")
        for name, cls in _SUBCONFIGS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _build(cls, value, name))
            elif not isinstance(value, cls):
                _fail(name, value, f"expected a {cls.__name__} or a mapping of its fields")

    @property
    def uses_pod_cache(self) -> bool:
        """Whether the KV cache drops distant keys of non-anchor layers (POD's real memory saving)."""
        return self.decode_scheme in ("pod", "pod+tidal")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SparseAttentionConfig":
        return _build(cls, dict(data or {}), "sparse_attention")

    @classmethod
    def from_json(cls, path: str | Path) -> "SparseAttentionConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def with_overrides(self, **overrides: Any) -> "SparseAttentionConfig":
        """A copy with flat overrides applied, e.g. ``decode_scheme="tidal", tidal_budget=256``.

        Keys are ``prefill_scheme``, ``decode_scheme`` or ``<method>_<field>`` for a method in
        pod, tidal, token_sparse, quest, streaming. Unknown keys raise ConfigError.
        """
        data = self.to_dict()
        for key, value in overrides.items():
            target = _override_target(key)
            if target is None:
                raise ConfigError(f"{key}={value!r} is not a sparse-attention option: expected prefill_scheme, "
                                  f"decode_scheme or <method>_<field> with method in {', '.join(_SUBCONFIGS)} "
                                  f"(e.g. tidal_budget, pod_recent_window)")
            section, name = target
            if section is None:
                data[name] = value
            else:
                data[section][name] = value
        return SparseAttentionConfig.from_dict(data)


def is_override_key(key: str) -> bool:
    """Whether ``key`` is a flat override understood by :meth:`SparseAttentionConfig.with_overrides`."""
    return _override_target(key) is not None


def parse_override_value(text: str) -> Any:
    """A flat override's value from command-line text: JSON first (``1``, ``0.5``, ``true``, ``null``,
    ``[2, 16]``), then a comma list of such values (``2,16`` -> ``[2, 16]``), ``none`` -> None, else
    the text itself (``kv_group``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    if "," in text:
        return [parse_override_value(part.strip()) for part in text.split(",")]
    return None if text.lower() == "none" else text


def _override_target(key: str) -> tuple[str | None, str] | None:
    if key in ("prefill_scheme", "decode_scheme"):
        return None, key
    for section, cls in sorted(_SUBCONFIGS.items(), key=lambda item: -len(item[0])):
        prefix = section + "_"
        if key.startswith(prefix):
            name = key[len(prefix):]
            if name in {f.name for f in dataclasses.fields(cls)}:
                return section, name
    return None


def _build(cls, data: dict[str, Any], where: str):
    if not isinstance(data, dict):
        _fail(where, data, f"expected a mapping of {cls.__name__} fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    if cls is SparseAttentionConfig:
        data = {k: (_build(_SUBCONFIGS[k], v, k) if k in _SUBCONFIGS and isinstance(v, dict) else v)
                for k, v in data.items()}
    return cls(**data)


def default_reselection_layer(num_layers: int, model_family: str | None = None) -> int:
    """TidalDecode's re-selection layer: 13 for Llama-3/3.1 (32 layers), 7 for Llama-2, else 13/32 depth."""
    if model_family == "llama3" and num_layers == 32:
        return 13
    if model_family == "llama2" and num_layers == 32:
        return 7
    return max(3, min(num_layers - 1, math.floor(num_layers * 13 / 32)))
