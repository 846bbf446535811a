"""The validated configuration tree of podkit's attention schemes.

:class:`SparseAttentionConfig` holds ``prefill_scheme``, ``decode_scheme`` and one section per
registered scheme that owns a config dataclass (``schemes/<method>.py``: ``pod``, ``tidal``, ...): the sections
come from the scheme registry (``sparse_models/schemes/registry.py``, ``config_sections()``), so a new scheme's
config needs no edit here. Every
dataclass checks its fields in ``__post_init__`` and raises :class:`ConfigError` with a message that
names the field, the value and what is allowed. The tree round-trips through ``to_dict`` /
``from_dict`` so that it can live in a checkpoint's ``config.json`` under the key
``sparse_attention``, and it accepts flat load-time overrides such as
``decode_scheme="tidal", tidal_budget=256`` (:meth:`SparseAttentionConfig.with_overrides`).

Defaults are the papers' (see each sub-config's docstring).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import field
from pathlib import Path
from typing import Any

from kernels.fp8_kv import KV_CACHE_DTYPES

from .schemes import registry
from .validation import ConfigError, fail

# The built-in scheme names at import time (validation reads the live registry).
PREFILL_SCHEMES = registry.scheme_names("prefill")
DECODE_SCHEMES = registry.scheme_names("decode")
# Config sections: fixed once the built-in schemes are registered (schemes registered later own none).
_SECTIONS = registry.config_sections()


class _SparseAttentionConfigBase:
    """Methods of :class:`SparseAttentionConfig` (whose fields come from the registry)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fail("kv_cache_dtype", self.kv_cache_dtype, f"expected one of {', '.join(KV_CACHE_DTYPES)} (the KV cache's "
                 f"storage: the model's dtype, or FP8 E4M3 with one fp32 scale per token and KV head, kernels/fp8_kv.py)")
        recent = self.kv_cache_recent_keys
        if isinstance(recent, bool) or not isinstance(recent, int) or recent < 0:
            fail("kv_cache_recent_keys", recent, "expected an int >= 0 (the newest positions whose keys an FP8 cache "
                 "also keeps in the model's dtype; 0 = every key in FP8)")
        if recent and self.kv_cache_dtype != "fp8_e4m3":
            fail("kv_cache_recent_keys", recent, f"expected 0 with kv_cache_dtype={self.kv_cache_dtype!r}: the option "
                 f"keeps an FP8 cache's newest keys in the model's dtype, and this cache stores every key in it already")
        registry.get_scheme(self.prefill_scheme, "prefill")
        registry.get_scheme(self.decode_scheme, "decode")
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _build(cls, value, name))
            elif not isinstance(value, cls):
                fail(name, value, f"expected a {cls.__name__} or a mapping of its fields")

    @property
    def uses_pod_cache(self) -> bool:
        """Whether the KV cache drops distant keys of non-anchor layers (POD's real memory saving)."""
        return registry.get_scheme(self.decode_scheme).cache.pod_keys

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

        Keys are ``prefill_scheme``, ``decode_scheme``, ``kv_cache_dtype``, ``kv_cache_recent_keys`` or ``<section>_<field>`` for a config section
        (one per registered scheme with parameters, ``schemes.registry.config_sections()``). Unknown keys raise
        ConfigError.
        """
        data = self.to_dict()
        for key, value in overrides.items():
            target = _override_target(key)
            if target is None:
                raise unknown_option_error(key, value)
            section, name = target
            if section is None:
                data[name] = value
            else:
                data[section][name] = value
        return SparseAttentionConfig.from_dict(data)


SparseAttentionConfig = dataclasses.make_dataclass(
    "SparseAttentionConfig",
    [("prefill_scheme", str, field(default="dense")), ("decode_scheme", str, field(default="dense")),
     ("kv_cache_dtype", str, field(default="bfloat16")), ("kv_cache_recent_keys", int, field(default=0))]
    + [(key, cls, field(default_factory=cls)) for key, cls in _SECTIONS.items()],
    bases=(_SparseAttentionConfigBase,),
    namespace={"__doc__": """Which scheme runs in each phase, and every method's parameters.

    ``prefill_scheme`` / ``decode_scheme``: a registered scheme that runs in that phase
    (``sparse_models.schemes.registry.scheme_names(phase)``; "pod+tidal" = POD's shared-key cache with
    TidalDecode selection on top). ``kv_cache_dtype`` (vLLM's and transformers' name): "bfloat16" (default: K/V in
    the model's dtype) or "fp8_e4m3" (K/V, POD's ring, FP8 with one fp32 scale per token and KV head; kernels/fp8_kv.py).
    ``kv_cache_recent_keys`` (FP8 caches only, default 0): the newest positions whose keys the cache also keeps in the
    model's dtype, read instead of their FP8 copy (KIVI's full-precision residual, arXiv 2402.02750; kernels/fp8_kv.py
    "Recent keys").
    One field per config section of the registered schemes.
    """},
)
SparseAttentionConfig.__module__ = __name__


def is_override_key(key: str) -> bool:
    """Whether ``key`` is a flat override understood by :meth:`SparseAttentionConfig.with_overrides`."""
    return _override_target(key) is not None


def override_keys() -> list[str]:
    """Every flat override :meth:`SparseAttentionConfig.with_overrides` understands, sorted."""
    keys = list(_TOP_LEVEL)
    for section, cls in _SECTIONS.items():
        keys += [f"{section}_{f.name}" for f in dataclasses.fields(cls)]
    return sorted(keys)


def looks_like_override(key: str) -> bool:
    """Whether ``key`` is meant as a flat override (``<method>_...``, ``prefill_...``, ``decode_...``), valid or
    not: ``from_pretrained`` sends such keys to validation instead of transformers' keyword arguments."""
    prefixes = ("prefill_", "decode_", "kv_cache_") + tuple(f"{section}_" for section in _SECTIONS)
    return key.startswith(prefixes)


def unknown_option_error(key: str, value: Any, *, also_known=(), what: str = "a sparse-attention option",
                         expected: str | None = None) -> ConfigError:
    """The one error for a misspelled or unknown option: it names the key, the value and the close matches
    (difflib) among the flat overrides and ``also_known`` (e.g. a caller's own arguments). Raised by
    :meth:`SparseAttentionConfig.with_overrides`, the model classes' ``from_pretrained`` and the lm-eval model's
    argument check (eval/lm_eval_model.py)."""
    close = difflib.get_close_matches(key, override_keys() + list(also_known), n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    if expected is None:
        expected = (f"expected prefill_scheme, decode_scheme, kv_cache_dtype, kv_cache_recent_keys or <method>_<field> with method in "
                    f"{', '.join(_SECTIONS)} (e.g. tidal_budget, pod_recent_window)")
    return ConfigError(f"{key}={value!r} is not {what}{hint}: {expected}")


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


_TOP_LEVEL = ("prefill_scheme", "decode_scheme", "kv_cache_dtype", "kv_cache_recent_keys")


def _override_target(key: str) -> tuple[str | None, str] | None:
    if key in _TOP_LEVEL:
        return None, key
    for section, cls in sorted(_SECTIONS.items(), key=lambda item: -len(item[0])):
        prefix = section + "_"
        if key.startswith(prefix):
            name = key[len(prefix):]
            if name in {f.name for f in dataclasses.fields(cls)}:
                return section, name
    return None


def _build(cls, data: dict[str, Any], where: str):
    if not isinstance(data, dict):
        fail(where, data, f"expected a mapping of {cls.__name__} fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    if cls is SparseAttentionConfig:
        data = {k: (_build(_SECTIONS[k], v, k) if k in _SECTIONS and isinstance(v, dict) else v) for k, v in data.items()}
    return cls(**data)


def __getattr__(name: str):
    """``from sparse_models.config import TidalConfig``: each section's dataclass, looked up in the
    registry (it is defined in its ``schemes/<method>.py``)."""
    for cls in _SECTIONS.values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
