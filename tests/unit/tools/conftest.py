"""tools/ on the import path: the scripts import their ``study_reports`` package as siblings."""

import sys
from pathlib import Path

TOOLS = str(Path(__file__).resolve().parents[3] / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
