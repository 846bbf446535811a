"""Automatic POD unit selection under a KV budget (``pod.protect_units: auto``).

DuoAttention (Xiao et al. 2024, arXiv 2410.10819) adapted to POD (Ma et al. 2024, arXiv 2412.02252): with the
model frozen, each shared (layer, KV head) unit of a candidate block map gets a gate alpha in [0, 1] mixing its
dense attention (own keys) with its POD attention (the block anchor's keys for distant positions); the gates
learn on synthetic recall episodes, not on any evaluated task; the units with the highest gates keep their own
keys while the map still saves ``pod.min_kv_saving``. METHODS.md E.

One responsibility per module:
  gated_forward.py  the gated decoder loop over the model's own modules
  episodes.py       podkit:recall episodes at one length + their answer positions
  optimise.py       the gate optimisation (loss, Adam, clamping)
  budget.py         ranking and selection under the KV budget
  report.py         unit_gates.json + unit_gates.png
  run.py            the pipeline step (candidate map, data, gates, selection, outputs)
"""
