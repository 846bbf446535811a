"""Calibration analyses shared by train/ and eval/ (each module writes a small JSON and a PNG).

- ``pod_similarity``: POD inter-layer attention similarity (JS) and greedy per-KV-head blocks.
"""
