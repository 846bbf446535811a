"""Self-contained copies of podkit models for ``trust_remote_code`` users (see modeling_podkit.py).

Not imported by podkit itself: ``train/export.py`` copies ``modeling_podkit.py`` into exports.
"""
