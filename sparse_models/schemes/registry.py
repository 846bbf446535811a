"""The scheme registry: scheme name -> :class:`~sparse_models.schemes.base.Scheme`.

Everything that needs to know which schemes exist (the config's validation and sections, the plan,
the model's attention, the engine, ``generate --budget``, ``eval.schemes``, the benchmarks) asks
here. To add a method, write ``schemes/<method>.py`` defining ``SCHEME`` and add its module name to
``BUILTIN`` below (ARCHITECTURE.md, "How to add a scheme").
"""

from __future__ import annotations

import importlib

from ..validation import ConfigError
from .base import Scheme

# One line per scheme module (each defines SCHEME); the order is the order of names in messages.
BUILTIN = (
    "dense",
    "pod",
    "tidal",
    "pod_tidal",
    "token_sparse",
    "quest",
    "streaming",
)

SCHEMES: dict[str, Scheme] = {}


_BUILTIN_LOADED = False


def register(scheme: Scheme) -> Scheme:
    """Add a scheme (its name must be new, and a config section it owns must not be taken).

    The config's sections are fixed when ``sparse_models.config`` is imported, i.e. after the
    ``BUILTIN`` modules: a scheme registered later (a plug-in, a test) may read existing sections but
    cannot own one."""
    if not isinstance(scheme, Scheme):
        raise TypeError(f"register() expects a Scheme, got {type(scheme).__name__}")
    if scheme.name in SCHEMES:
        raise ConfigError(f"scheme {scheme.name!r} is already registered")
    if scheme.config_key is not None and _BUILTIN_LOADED:
        raise ConfigError(f"scheme {scheme.name!r} owns config section {scheme.config_key!r}: a scheme with its own "
                          f"section must be a module listed in sparse_models/schemes/registry.py BUILTIN")
    if scheme.config_key is not None and scheme.config_key in config_sections():
        raise ConfigError(f"scheme {scheme.name!r}: config section {scheme.config_key!r} is already owned by "
                          f"another scheme")
    if not scheme.phases:
        raise ConfigError(f"scheme {scheme.name!r} has neither prefill_roles nor decode_roles")
    SCHEMES[scheme.name] = scheme
    return scheme


def unregister(name: str) -> None:
    """Remove a scheme added with :func:`register` (tests)."""
    SCHEMES.pop(name, None)


def get_scheme(name: str, phase: str | None = None) -> Scheme:
    """The scheme called ``name`` (that runs in ``phase`` if given), or a ConfigError naming the choices."""
    names = scheme_names(phase)
    if name not in names:
        key = f"{phase}_scheme" if phase else "scheme"
        raise ConfigError(f"{key}={name!r} is invalid: expected one of {', '.join(names)}")
    return SCHEMES[name]


def scheme_names(phase: str | None = None) -> tuple[str, ...]:
    """Registered names, all or those that run in ``phase`` ("prefill" or "decode")."""
    return tuple(name for name, s in SCHEMES.items() if phase is None or phase in s.phases)


def budgeted_schemes() -> tuple[str, ...]:
    """Decode schemes that take a ``--budget``."""
    return tuple(name for name, s in SCHEMES.items() if s.budget is not None)


def budget_overrides(decode_scheme: str, budget, given=None) -> dict:
    """The flat overrides that give ``decode_scheme`` a budget of ``budget`` (its one meaning)."""
    scheme = get_scheme(decode_scheme, "decode")
    if scheme.budget is None:
        raise ConfigError(f"decode_scheme={decode_scheme!r} has no budget: expected one of "
                          f"{', '.join(budgeted_schemes())}")
    return scheme.budget.overrides(decode_scheme, budget, given)


def budget_beyond_context(config, max_positions: int | None) -> str | None:
    """The one-line notice for a decode budget (:attr:`Budget.reads`) at or beyond the model's context, or None:
    every decode step then reads every position, at dense cost (``schemes/base.covers_cache``: the scheme runs
    exact attention instead of building position lists sized by the budget)."""
    budget = get_scheme(config.decode_scheme).budget
    if budget is None or budget.reads is None or not max_positions:
        return None
    reads = budget.reads(config)
    if reads < max_positions:
        return None
    return (f"decode_scheme={config.decode_scheme!r} budget {reads} covers the model's whole context "
            f"(max_position_embeddings={max_positions}): every decode step reads every cached position, "
            f"as dense attention does, at dense cost")


def scheme_notices(config) -> list[str]:
    """The configured schemes' ``Scheme.config_notice`` notices (one per notice function, naming every phase that
    runs a scheme with it)."""
    phases_by_notice: dict = {}
    for phase, name in (("prefill", config.prefill_scheme), ("decode", config.decode_scheme)):
        notice = get_scheme(name).config_notice
        if notice is not None:
            phases_by_notice.setdefault(notice, []).append(f"{phase}_scheme={name!r}")
    return [text for notice, phases in phases_by_notice.items() if (text := notice(config, phases))]


def warn_config_notices(config, max_positions: int | None) -> None:
    """Say :func:`budget_beyond_context` and :func:`scheme_notices` as RuntimeWarnings, from this one line for
    the model (``set_sparse_attention``) and the engine alike, so warnings' default filter prints each once."""
    import warnings

    for notice in (budget_beyond_context(config, max_positions), *scheme_notices(config)):
        if notice:
            warnings.warn(notice, RuntimeWarning, stacklevel=1)


def config_sections() -> dict[str, type]:
    """Config section name -> its dataclass, for every registered scheme that owns one."""
    return {s.config_key: s.config_cls for s in SCHEMES.values() if s.config_key is not None}


for _module in BUILTIN:
    register(importlib.import_module(f"{__package__}.{_module}").SCHEME)
_BUILTIN_LOADED = True
