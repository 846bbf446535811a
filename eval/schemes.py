"""Named scheme settings for sweeps: a label and the flat overrides that load it.

One place maps a human setting ("tidal@128", "token_sparse@0.005") to the load-time overrides of
sparse_models.config, so the fidelity sweep, ``eval.quality`` and the lm-eval model agree on what a
"budget" means for each decode method. The meaning itself is the scheme's
(``sparse_models.schemes.registry.budget_overrides``, each scheme's ``Budget``): the number of cached positions
one decode query reads, current token included (e.g. TidalDecode's ``tidal_budget``; StreamingLLM's 4 sink
tokens + ``budget - 4`` most recent). Which methods a sweep covers (:func:`budget_sweep_methods`), their order in
tables and plots (:func:`method_rank`) and their display names come from the registry too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sparse_models.config import is_override_key, parse_override_value
from sparse_models.schemes.registry import SCHEMES, budgeted_schemes
from sparse_models.schemes.registry import budget_overrides as _scheme_budget_overrides

BUDGETED_DECODE_SCHEMES = budgeted_schemes()


def method_rank(method: str) -> tuple[int, int, str]:
    """Sort key of a method or setting name in tables and plots, by the registry's ``Scheme.order``. A name that is
    not a scheme but starts with one and ``_`` (``pod_zero_shot``, ``pod_adapted``) sorts right after it; other
    names (kvpress's presses) after every scheme."""
    if method in SCHEMES:
        return SCHEMES[method].order, 0, ""
    base = max((name for name in SCHEMES if method.startswith(name + "_")), key=len, default=None)
    return (SCHEMES[base].order, 1, method) if base is not None else (1 << 30, 0, method)


def budget_sweep_methods() -> tuple[str, ...]:
    """The decode schemes a budget sweep covers (the fidelity sweep, the leaderboard), in display order: every
    budgeted scheme that needs no POD anchor map (a map is a calibration; ``pod+tidal`` would need one per row)."""
    names = [name for name in budgeted_schemes() if not SCHEMES[name].uses_anchors]
    return tuple(sorted(names, key=method_rank))


def display_name(method: str) -> str:
    """The scheme's ``display_name`` for a method name (``tidal`` -> TidalDecode); other names unchanged."""
    return SCHEMES[method].title if method in SCHEMES else method


@dataclass(frozen=True)
class Setting:
    """A scheme setting: ``label`` for tables, ``method`` for grouping, ``overrides`` for loading."""

    label: str
    method: str
    overrides: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    coverage: float | None = None

    @property
    def phase(self) -> str:
        """Which phase the setting makes sparse: "decode", "prefill", "both" or "none" (dense)."""
        prefill = self.overrides.get("prefill_scheme", "dense") != "dense"
        decode = self.overrides.get("decode_scheme", "dense") != "dense"
        return {(False, False): "none", (True, False): "prefill", (False, True): "decode"}.get((prefill, decode), "both")


def budget_overrides(decode_scheme: str, budget: int) -> dict[str, Any]:
    """The overrides that give ``decode_scheme`` a budget of ``budget`` keys per query (the scheme's
    one meaning; a ``ValueError`` naming the allowed values otherwise)."""
    return _scheme_budget_overrides(decode_scheme, budget)


def dense() -> Setting:
    """Dense attention in both phases, also for a model whose own config is sparse (a POD export loads
    with POD: no overrides would evaluate POD under the label "dense")."""
    return Setting("dense", "dense", {"prefill_scheme": "dense", "decode_scheme": "dense"})


def budgeted(method: str, budget: int, **extra: Any) -> Setting:
    return Setting(f"{method}@{budget}", method, budget_overrides(method, budget) | extra, budget=budget)


def token_sparse(coverage: float, **extra: Any) -> Setting:
    return Setting(f"token_sparse@{coverage:g}", "token_sparse",
                   {"prefill_scheme": "token_sparse", "token_sparse_coverage": coverage} | extra, coverage=coverage)


def pod_zero_shot(blocks_file: str | None, **extra: Any) -> Setting:
    """POD applied without training: blocks from the similarity calibration, both phases POD."""
    overrides = {"prefill_scheme": "pod", "decode_scheme": "pod"} | extra
    if blocks_file:
        overrides["pod_blocks_file"] = str(blocks_file)
    return Setting("pod_zero_shot", "pod", overrides)


def setting_forms(budget: str = "B") -> list[str]:
    """The label forms :func:`parse_setting` reads, budgeted schemes from the registry: ``["dense",
    "tidal@B", ..., "token_sparse@TAU", "pod"]`` (``budget``: how the help names a budget)."""
    return ["dense", *(f"{name}@{budget}" for name in BUDGETED_DECODE_SCHEMES), "token_sparse@TAU", "pod"]


def parse_setting(label: str, **extra: Any) -> Setting:
    """A label of :func:`setting_forms` -> its Setting: ``"dense"``, ``"tidal@128"``, ``"token_sparse@0.005"``,
    ``"pod"``."""
    if label == "dense":
        return dense()
    if label in ("pod", "pod_zero_shot"):
        return pod_zero_shot(extra.pop("pod_blocks_file", None), **extra)
    method, _, value = label.partition("@")
    if method == "token_sparse" and value:
        return token_sparse(float(value), **extra)
    if method in BUDGETED_DECODE_SCHEMES and value.isdigit():
        return budgeted(method, int(value), **extra)
    raise ValueError(f"setting={label!r} is not understood: expected one of {', '.join(setting_forms('BUDGET'))}")


def variant(setting: Setting, name: str, **overrides: Any) -> Setting:
    """``setting`` with ``overrides`` on top, labelled ``<label>[<name>]`` (e.g. ``tidal@128[2,16]``)."""
    return replace(setting, label=f"{setting.label}[{name}]", overrides=setting.overrides | overrides)


def parse_variant(spec: str) -> Setting:
    """``"quest@128:quest_page_size=1"`` -> quest@128 with that flat override, labelled
    ``quest@128[quest_page_size=1]``; several overrides are joined by ``+``."""

    base, _, rest = spec.partition(":")
    overrides: dict[str, Any] = {}
    for item in rest.split("+") if rest else []:
        key, equals, value = item.partition("=")
        if not equals or not is_override_key(key):
            raise ValueError(f"setting variant {spec!r} is invalid: {item!r} is not <flat override>=<value> "
                             f"(e.g. quest_page_size=1, tidal_selection_layers=2,16)")
        overrides[key] = parse_override_value(value)
    if not overrides:
        raise ValueError(f"setting variant {spec!r} is invalid: expected <setting>:<key>=<value>[+<key>=<value>...], "
                         f"e.g. quest@128:quest_page_size=1")
    return variant(parse_setting(base), rest, **overrides)
