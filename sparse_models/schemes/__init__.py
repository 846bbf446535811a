"""One module per attention method, each defining one :class:`~sparse_models.schemes.base.Scheme`.

dense.py (causal prefill / dense decode), pod.py (POD, arXiv 2412.02252), tidal.py (TidalDecode,
arXiv 2410.05076), pod_tidal.py (POD's cache + TidalDecode), token_sparse.py (Token Sparse Attention,
arXiv 2602.03216), quest.py (Quest, arXiv 2406.10774), streaming.py (StreamingLLM, arXiv 2309.17453).
``registry.py`` maps names to schemes (its ``BUILTIN`` is the list that counts); ``base.py`` says what a scheme is;
``footprint.py`` turns what a scheme declares it keeps and reads into KV fractions.
"""
