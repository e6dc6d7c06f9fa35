"""The package stays light: `import agentrl` must not pull in plotting, HF or IPython."""
import subprocess
import sys

from conftest import REPO

HEAVY = ("matplotlib", "transformers", "IPython")


def test_import_is_light():
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import agentrl"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # `import time: self | cumulative | module`; the module column is indented by nesting.
    modules = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
               if line.startswith("import time:")}
    assert "agentrl" in modules
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"import agentrl imports {heavy}"
