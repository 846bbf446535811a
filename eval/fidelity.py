"""The old name of eval/harness/fidelity.py, kept so that ``python -m eval.fidelity`` and ``import eval.fidelity`` keep working.

Importing it gives the module ``eval.harness.fidelity`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import fidelity as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
