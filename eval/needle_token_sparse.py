"""The old name of eval/studies/needle_token_sparse.py, kept so that ``python -m eval.needle_token_sparse`` and ``import eval.needle_token_sparse`` keep working.

Importing it gives the module ``eval.studies.needle_token_sparse`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.studies import needle_token_sparse as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
