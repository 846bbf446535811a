"""The old name of eval/harness/leaderboard.py, kept so that ``python -m eval.leaderboard`` and ``import eval.leaderboard`` keep working.

Importing it gives the module ``eval.harness.leaderboard`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import leaderboard as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
