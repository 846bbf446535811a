"""Configuration errors and the small field checks every config dataclass uses.

The bottom of ``sparse_models``: ``config.py`` and each ``schemes/<method>.py`` (whose config
dataclass validates itself in ``__post_init__``) import it, and it imports nothing of podkit.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field, the value and what is allowed."""


def fail(field_name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{field_name}={value!r} is invalid: {allowed}")


def check_int(field_name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fail(field_name, value, f"expected an integer >= {minimum}")


def check_layer_list(field_name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        fail(field_name, value, "expected a list of non-negative layer indices")
    if len(set(value)) != len(value):
        fail(field_name, value, "layer indices must be unique")


def check_layers_exist(name: str, layers, num_layers: int) -> None:
    """Every listed layer exists in a model with ``num_layers`` layers."""
    bad = [layer for layer in (layers or []) if layer >= num_layers]
    if bad:
        raise ConfigError(f"{name}={list(layers)} is invalid: layers {bad} do not exist in a model with {num_layers} layers")
