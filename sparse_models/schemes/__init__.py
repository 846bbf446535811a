"""One module per attention method; each is a few functions over ``kernels`` ops.

dense.py (causal prefill / dense decode), pod.py (POD, arXiv 2412.02252), tidal.py (TidalDecode,
arXiv 2410.05076), token_sparse.py (Token Sparse Attention, arXiv 2602.03216), quest.py (Quest,
arXiv 2406.10774), streaming.py (StreamingLLM). ``sparse_models.attention`` routes each layer to them
by its :class:`~sparse_models.plan.LayerPlan`.
"""
