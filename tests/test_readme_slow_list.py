"""README's list of the tests marked ``slow`` (the ones ``make test`` leaves to ``make test-slow``) is the list the
test files mark: read statically (ast), no test module imported, so it costs nothing in ``make test``."""

from __future__ import annotations

import ast
import re

from paths import REPO

TESTS = REPO / "tests"


def _is_slow(node: ast.AST) -> bool:
    return ast.unparse(node).endswith("mark.slow")


def marked_slow() -> set[str]:
    """``file::test`` (``file::test[id]`` for a slow parameter) for every test marked slow in tests/test_*.py: by a
    decorator, a module's ``pytestmark`` or a ``pytest.param(..., marks=pytest.mark.slow)``."""
    out = set()
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and any(_is_slow(v) for v in ast.walk(n.value)) for n in tree.body)
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
                continue
            if module_slow or any(_is_slow(d) for d in fn.decorator_list):
                out.add(f"{path.name}::{fn.name}")
            for call in (n for d in fn.decorator_list for n in ast.walk(d) if isinstance(n, ast.Call)):
                if ast.unparse(call.func).endswith("param") and any(
                        k.arg == "marks" and any(_is_slow(v) for v in ast.walk(k.value)) for k in call.keywords):
                    ids = [k.value for k in call.keywords if k.arg == "id"]
                    pid = ast.literal_eval(ids[0]) if ids else "-".join(str(ast.literal_eval(a)) for a in call.args)
                    out.add(f"{path.name}::{fn.name}[{pid}]")
    return out


def test_the_scan_finds_the_slow_tests():  # guards the test below against comparing two empty sets
    slow = marked_slow()
    assert "test_ctrl_c.py::test_a_second_ctrl_c_stops_at_once_with_130" in slow  # module pytestmark
    assert "test_parallel_gloo.py::test_layouts_match_single_process[4]" in slow  # a slow parameter
    assert "test_parallel_gloo.py::test_layouts_match_single_process[2]" not in slow


def test_readme_lists_every_slow_test_and_no_other():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`(test_\w+\.py::\w+(?:\[[^\]`]+\])?)`", readme))
    slow = marked_slow()
    assert not slow - listed, f"README.md does not list these slow tests: {sorted(slow - listed)}"
    assert not listed - slow, f"README.md lists tests that are not marked slow (renamed?): {sorted(listed - slow)}"
    count = re.search(r"the (\d+) marked `slow`", readme)
    assert count and int(count.group(1)) == len(slow), "README.md's count of slow tests"
