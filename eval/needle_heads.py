"""The old name of eval/studies/needle_heads.py, kept so that ``python -m eval.needle_heads`` and ``import eval.needle_heads`` keep working.

Importing it gives the module ``eval.studies.needle_heads`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.studies import needle_heads as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
