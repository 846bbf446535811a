"""The old name of eval/harness/quality.py, kept so that ``python -m eval.quality`` and ``import eval.quality`` keep working.

Importing it gives the module ``eval.harness.quality`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import quality as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
