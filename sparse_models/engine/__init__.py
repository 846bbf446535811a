"""podkit's fast generation engine: static caches + CUDA-graph decode for every scheme.

See :class:`GenerationEngine` (engine.py) and the CLI ``python -m sparse_models.generate``.
"""

from .engine import GenerationEngine, GenerationResult
from .errors import EngineError
from .sampling import SamplingConfig, sample_next
from .static_cache import StaticCache

__all__ = ["GenerationEngine", "GenerationResult", "EngineError", "SamplingConfig", "sample_next", "StaticCache"]
