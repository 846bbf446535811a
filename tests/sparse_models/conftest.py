"""Make this folder's helper modules (sm_oracle, sm_tiny) importable by its tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
