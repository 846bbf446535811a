"""The old name of eval/studies/pod_gate_skip.py, kept so that ``python -m eval.pod_gate_skip`` and ``import eval.pod_gate_skip`` keep working.

Importing it gives the module ``eval.studies.pod_gate_skip`` itself (one module object, so patches and globals agree).
"""

import sys

from eval.studies import pod_gate_skip as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
