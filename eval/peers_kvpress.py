"""The old name of eval/harness/peers_kvpress.py, kept so that ``python -m eval.peers_kvpress`` and ``import eval.peers_kvpress`` keep working.

Importing it gives the module ``eval.harness.peers_kvpress`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.harness import peers_kvpress as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
