"""The old name of eval/studies/learning_curves.py, kept so that ``python -m eval.learning_curves`` and ``import eval.learning_curves`` keep working.

Importing it gives the module ``eval.studies.learning_curves`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.studies import learning_curves as _module

if __name__ == "__main__":
    sys.exit(_module.main())
else:
    sys.modules[__name__] = _module
