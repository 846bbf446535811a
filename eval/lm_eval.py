"""The old name of eval/harness/lm_eval.py, kept so that ``python -m eval.lm_eval`` and ``import eval.lm_eval`` keep working.

Importing it gives the module ``eval.harness.lm_eval`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import lm_eval as _module

if __name__ == "__main__":
    sys.exit(_module.main())
else:
    sys.modules[__name__] = _module
