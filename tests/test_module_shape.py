"""The shape of the generated modules of chapters 18 and 19: no function (or method) longer
than MAX_LINES, so that each reads as one named step."""
import ast

import pytest

from conftest import REPO

MAX_LINES = 80
MODULES = ('agentrl/wal_rollout.py', 'agentrl/long_trajectories.py')


def function_lengths(path):
    """{'name (line n)': lines from `def` to its last line} of every function and method."""
    return {f'{node.name} (line {node.lineno})': node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize('module', MODULES)
def test_no_function_is_longer_than_80_lines(module):
    lengths = function_lengths(REPO / module)
    assert lengths                                   # the file was parsed
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert too_long == {}, f'{module}: functions over {MAX_LINES} lines: {too_long}'
