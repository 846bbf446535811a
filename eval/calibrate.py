"""The old name of eval/harness/calibrate.py, kept so that ``python -m eval.calibrate`` and ``import eval.calibrate`` keep working.

Importing it gives the module ``eval.harness.calibrate`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import calibrate as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
