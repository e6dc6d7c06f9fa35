"""README's plain-script example (chapter 22's Qwen3 model trained with `agentrl`) runs as
written, with a budget of a few steps, so that the example cannot drift from the package."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = '<!-- readme-example: hf-script -->'
BUDGET = re.compile(r'^SFT_STEPS, RL_STEPS = \d+, \d+', re.M)


def readme_script():
    """The fenced Python block that follows MARK in README.md."""
    text = (REPO / 'README.md').read_text(encoding='utf-8')
    assert text.count(MARK) == 1, f'README.md must hold {MARK} once'
    block = re.search(r'```python\n(.*?)```', text[text.index(MARK):], re.S)
    assert block, f'no ```python block after {MARK}'
    return block.group(1)


def test_readme_example_is_short_and_self_contained():
    script = readme_script()
    assert len(script.splitlines()) < 40
    assert BUDGET.search(script), 'the budget line the test shrinks is missing'
    assert 'import agentrl as arl' in script


def test_readme_example_runs(tmp_path):
    pytest.importorskip('transformers')
    script = BUDGET.sub('SFT_STEPS, RL_STEPS = 3, 1', readme_script())
    # a smaller RL step and evaluation than chapter 7's, for a test's budget
    script = script.replace("arl.RLConfig(seed=0)",
                            "arl.RLConfig(seed=0, tasks_per_step=4, group_size=2)")
    script = script.replace("arl.make_tasks('heldout')", "arl.make_tasks('heldout')[:10]")
    assert script.count('tasks_per_step=4') == 1 and script.count("[:10]") == 1
    result = subprocess.run([sys.executable, '-c', script], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r'held-out pass rate: \d\.\d{3} after SFT, \d\.\d{3} after RL',
                     result.stdout)
    assert (tmp_path / 'qwen3-agent' / 'config.json').exists()
    assert (tmp_path / 'qwen3-agent' / 'tokenizer.json').exists()
