"""The old name of eval/harness/leaderboard_records.py, kept so that ``import eval.leaderboard_records`` keeps working.

Importing it gives the module ``eval.harness.leaderboard_records`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import leaderboard_records as _module

sys.modules[__name__] = _module
