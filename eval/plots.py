"""The old name of eval/harness/plots.py, kept so that ``import eval.plots`` keeps working.

Importing it gives the module ``eval.harness.plots`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import plots as _module

sys.modules[__name__] = _module
