"""The shape of the generated package: no function (or method) longer than MAX_LINES in any
module, so that each reads as one named step."""
import ast

import pytest

from conftest import REPO

MAX_LINES = 80
MODULES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / 'agentrl').glob('*.py')
                 if p.name != '__init__.py')              # __init__ defines no function


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
