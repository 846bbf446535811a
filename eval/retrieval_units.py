"""The old name of eval/studies/retrieval_units.py, kept so that ``python -m eval.retrieval_units`` and ``import eval.retrieval_units`` keep working.

Importing it gives the module ``eval.studies.retrieval_units`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.studies import retrieval_units as _module

if __name__ == "__main__":
    sys.exit(_module.main())
else:
    sys.modules[__name__] = _module
