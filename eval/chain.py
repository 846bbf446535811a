"""The old name of eval/harness/chain.py, kept so that ``python -m eval.chain`` and ``import eval.chain`` keep working.

Importing it gives the module ``eval.harness.chain`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import chain as _module

if __name__ == "__main__":
    sys.exit(_module.main())
else:
    sys.modules[__name__] = _module
