"""POD + TidalDecode (decode): POD's shared-key cache, TidalDecode's selection on top.

The decode roles are TidalDecode's (``sparse_models/schemes/tidal.py``); every key a layer reads
comes from POD's cache (``pod_keys``: sinks + ring for non-anchor units, distant keys from the
anchor layer). Two combinations are rejected: ``pod.sharing="scores"`` (selection needs one key per
position; score sharing has none) and a KV correction period (re-running past tokens needs proximal
keys the ring has already dropped).
"""

from __future__ import annotations

from ..validation import ConfigError
from . import tidal
from .base import CacheNeeds, Footprint, Scheme
from .pod import model_view_pod, pod_chunk, pod_kept, ring_window


def check(config, num_layers: int) -> None:
    if config.pod.sharing == "scores":
        raise ConfigError("pod.sharing='scores' is invalid with decode_scheme='pod+tidal': TidalDecode selects over "
                          "one key per position, score sharing has none; use pod.sharing='keys' or decode_scheme='pod'")
    if config.tidal.correction_period is not None:
        raise ConfigError(f"tidal.correction_period={config.tidal.correction_period} is invalid with "
                          f"decode_scheme='pod+tidal': re-running past tokens needs their proximal keys, which POD's "
                          f"ring has already overwritten; use null (no correction) or decode_scheme='tidal'")


SCHEME = Scheme(
    name="pod+tidal",
    summary="POD's shared-key cache with TidalDecode selection on top (decode)",
    decode_roles=tidal.tidal_decode_roles,
    decode=tidal.DECODE,
    uses_anchors=True,
    cache=CacheNeeds(pod_keys=True, ring_window=ring_window,
                     correction_period=lambda config: config.tidal.correction_period),
    budget=tidal.BUDGET,
    check=check,
    reads=("pod", "tidal"),
    chunk=pod_chunk,
    model_view={"pod": model_view_pod},
    footprint=Footprint(budget_roles=tidal.BUDGET_ROLES, kept=pod_kept),
    display_name="POD + TidalDecode",
    order=60,
)
