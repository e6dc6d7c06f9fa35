"""Make the book tools (tools/*.py, plain scripts) importable by the tests."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

# The book's models are tiny: one torch thread is as fast as two on an idle machine and does not
# spin-wait against a busy core (chapter 1, "Threads").
import torch  # noqa: E402

torch.set_num_threads(1)
