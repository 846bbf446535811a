"""The old name of eval/harness/lm_eval_model.py, kept so that ``import eval.lm_eval_model`` keeps working.

Importing it gives the module ``eval.harness.lm_eval_model`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import lm_eval_model as _module

sys.modules[__name__] = _module
