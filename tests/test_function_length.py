"""No function in maxmoe/ is over MAX_LINES lines unless its docstring says why.

A long function is hard to read and to change one piece of; when one must stay long, its
docstring holds the marker LONG_BECAUSE followed by the reason. Functions, methods and nested
functions all count, from the `def` line to the last line of the body. Read with `ast`, so
nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "maxmoe"
MAX_LINES = 80
LONG_BECAUSE = "Long because:"


def long_functions(source: str, filename: str) -> list[str]:
    """'file:line name is N lines' for every function of `source` over MAX_LINES lines whose
    docstring lacks LONG_BECAUSE."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length > MAX_LINES and LONG_BECAUSE not in (ast.get_docstring(node) or ""):
            found.append(f"{filename}:{node.lineno} {node.name} is {length} lines")
    return found


def test_no_function_in_the_package_is_long_without_a_reason():
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             for hit in long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, (f"over {MAX_LINES} lines: split them, or say why in the docstring "
                       f"('{LONG_BECAUSE} ...'):\n" + "\n".join(found))


def _function(lines: int, docstring: str, nested: bool = False) -> str:
    """Source of a function of exactly `lines` lines (nested in a short outer one if asked)."""
    body = [f'    """{docstring}"""'] + ["    x = 1"] * (lines - 2)
    inner = ["def f():", *body]
    if nested:
        return "\n".join(["def outer():", *("    " + line for line in inner), "    return f"])
    return "\n".join(inner)


def test_the_check_flags_long_functions_and_accepts_a_reason():
    assert long_functions(_function(MAX_LINES, "short enough"), "m.py") == []
    assert long_functions(_function(MAX_LINES + 1, "too long"), "m.py") == [
        f"m.py:1 f is {MAX_LINES + 1} lines"]
    nested = long_functions(_function(MAX_LINES + 1, "too long", nested=True), "m.py")
    assert f"m.py:2 f is {MAX_LINES + 1} lines" in nested  # outer is flagged as well
    assert long_functions(_function(MAX_LINES + 1, f"{LONG_BECAUSE} one table"), "m.py") == []
