"""The fast tier, ``make test-fast``, runs ``-m "not install and not slow"`` with FAST_SKIP's paths
left out. It must run no ``torch.compile`` and start no other process. This file checks that every
test doing either carries the ``slow`` (or ``install``) mark (setup.cfg).

The check reads the test files' source with ``ast``; nothing runs and nothing is mocked. A test
counts as slow when it calls ``torch.compile``, passes ``compile=`` a value other than False or
None, or starts a subprocess or another process (subprocess, torch.multiprocessing's
``start_processes`` / ``spawn``, multiprocessing's ``Process`` / ``Pool``). The call can be in the
test itself, in a function or fixture of its module, in what it imports from tests/helpers.py or
tests/packaging.py, or in a fixture of tests/conftest.py. A call hidden in a library, or in another
test module's code, is not seen.
"""
import ast
import os
import re
import textwrap
from typing import Dict, List, Optional, Set

import pytest

from .helpers import ROOT

TESTS = os.path.join(ROOT, "tests")
SHARED = ("helpers", "packaging")  # tests/<name>.py, imported by test modules
PROCESS_CALLS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output"},
    "multiprocessing": {"start_processes", "spawn", "Process", "Pool"},
    "mp": {"start_processes", "spawn", "Process", "Pool"},
    "torch": {"compile"},
}


# ---------------------------------------------------------------------------- the scan
def _dotted(node) -> List[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _starts_work(fn) -> bool:
    """Whether ``fn``'s own code (its nested functions included) calls torch.compile, compiles a
    model (``compile=``) or starts a process."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if len(name) >= 2 and name[-1] in PROCESS_CALLS.get(name[-2], ()):
            return True
        for kw in node.keywords:
            if kw.arg == "compile" and not (isinstance(kw.value, ast.Constant) and kw.value.value in (False, None)):
                return True
    return False


def _functions(tree) -> Dict[str, ast.FunctionDef]:
    """A module's functions, methods included (by their own name)."""
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _calls(fn) -> Set[str]:
    return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _arguments(fn) -> Set[str]:
    args = fn.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}


def _slow_names(functions: Dict[str, ast.FunctionDef], known: Set[str]) -> Set[str]:
    """The names of ``functions`` that start work themselves, or call or ask (as a fixture) for a
    function that does; ``known``: such names from elsewhere (shared helpers, conftest fixtures)."""
    slow = set(known) | {name for name, fn in functions.items() if _starts_work(fn)}
    while True:
        more = {name for name, fn in functions.items()
                if name not in slow and (_calls(fn) | _arguments(fn)) & slow}
        if not more:
            return slow
        slow |= more


def _marked(expr, names: Set[str]) -> bool:
    """Whether a decorator or ``pytestmark`` value carries the slow or install mark (``names``:
    module-level aliases of those marks)."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Attribute) and node.attr in ("slow", "install") and _dotted(node)[-2:-1] == ["mark"]:
            return True
        if isinstance(node, ast.Name) and node.id in names:
            return True
    return False


def _parse(path: str):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _shared_slow() -> Dict[str, Set[str]]:
    """Per shared module (tests/helpers.py, tests/packaging.py), its slow functions' names;
    ``"conftest"``: tests/conftest.py's slow fixtures."""
    out = {}
    for name in SHARED + ("conftest",):
        tree = _parse(os.path.join(TESTS, f"{name}.py"))
        out[name] = _slow_names(_functions(tree), _imported(tree, out))
    return out


def _imported(tree, shared: Dict[str, Set[str]]) -> Set[str]:
    """The slow functions a module imports from the shared ones (at its top or in a function),
    under its names for them."""
    return {a.asname or a.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level and node.module in shared
            for a in node.names if a.name in shared[node.module]}


def unmarked_slow_tests(path: str, shared: Optional[Dict[str, Set[str]]] = None) -> List[str]:
    """The names (``Class::test`` for methods) of the tests of the file at ``path`` that are slow
    and carry neither the slow nor the install mark."""
    shared = _shared_slow() if shared is None else shared
    tree = _parse(path)
    # conftest's fixtures are asked for by name; the shared helpers are called under the names imported
    slow = _slow_names(_functions(tree), set(shared["conftest"]) | _imported(tree, {m: shared[m] for m in SHARED}))
    aliases = {t.id for node in tree.body if isinstance(node, ast.Assign) and _marked(node.value, set())
               for t in node.targets if isinstance(t, ast.Name) and t.id != "pytestmark"}

    def marked_by_pytestmark(body) -> bool:
        return any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                        for t in node.targets) and _marked(node.value, aliases)
                   for node in body)

    if marked_by_pytestmark(tree.body):
        return []
    found = []

    def visit(body, prefix, in_marked_class):
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                marked = in_marked_class or any(_marked(d, aliases) for d in node.decorator_list) \
                    or marked_by_pytestmark(node.body)
                visit(node.body, f"{prefix}{node.name}::", marked)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                if in_marked_class or any(_marked(d, aliases) for d in node.decorator_list):
                    continue
                if node.name in slow or _starts_work(node) or (_calls(node) | _arguments(node)) & slow:
                    found.append(prefix + node.name)

    visit(tree.body, "", False)
    return found


def _makefile_variable(text: str, name: str) -> str:
    match = re.search(rf"^{name} :?= ((?:.*\\\n)*.*)$", text, re.M)
    assert match, f"Makefile: no {name}"
    return match.group(1).replace("\\\n", " ")


def fast_tier_files() -> List[str]:
    """The test files that ``make test-fast`` collects (relative to the checkout): every
    tests/**/test_*.py outside FAST_SKIP's paths."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        skip = _makefile_variable(f.read(), "FAST_SKIP").split()
    files = []
    for folder, _, names in os.walk(TESTS):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
            if name.startswith("test_") and name.endswith(".py") and \
                    not any(rel == s or rel.startswith(s.rstrip("/") + "/") for s in skip):
                files.append(rel)
    return sorted(files)


# ---------------------------------------------------------------------------- the tests
def test_make_test_fast_leaves_out_slow_and_install_and_make_test_keeps_them():
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    recipe = re.search(r"^test-fast:.*\n\t(.*)$", text, re.M).group(1)
    assert '-m "not install and not slow"' in recipe, recipe
    main = re.search(r"^test-main:.*\n\t(.*)$", text, re.M).group(1)
    assert '-m "' not in main, main  # `make test` selects nothing out
    compat = _makefile_variable(text, "COMPAT_PYTEST")
    assert "slow" not in compat, compat
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        assert re.search(r"^    slow: ", f.read(), re.M), "setup.cfg registers no `slow` marker"


def test_every_slow_test_of_the_fast_tier_is_marked():
    shared = _shared_slow()
    unmarked = [f"{rel}::{name}" for rel in fast_tier_files()
                for name in unmarked_slow_tests(os.path.join(ROOT, rel), shared)]
    assert unmarked == [], ("tests that call torch.compile or start a process, without "
                            "@pytest.mark.slow:\n" + "\n".join(unmarked))


def test_the_scan_sees_each_way_a_test_gets_slow(tmp_path):
    # Unmarked, each of these is reported; marked (by decorator, alias or pytestmark) none is.
    (tmp_path / "helpers.py").write_text("")
    source = textwrap.dedent("""
        import subprocess, sys
        import pytest, torch

        def _child(code):
            return subprocess.run([sys.executable, "-c", code], check=True)

        def _twice(code):
            return _child(code) and _child(code)

        @pytest.fixture(scope="module")
        def ranks():
            torch.multiprocessing.start_processes(print, nprocs=2)

        def test_compiles():
            torch.compile(torch.nn.Linear(2, 2))

        def test_compiled_model():
            Model(compile=dict(mode="default"))

        def test_through_helpers():
            _twice("pass")

        def test_through_a_fixture(ranks):
            pass

        def test_through_a_conftest_fixture(toy_data):
            pass

        class TestGroup:
            def test_method(self):
                subprocess.Popen(["true"]).wait()

        def test_eager():
            Model(compile=False)
    """)
    path = tmp_path / "test_sample.py"
    path.write_text(source)
    shared = dict(helpers=set(), packaging=set(), conftest={"toy_data"})
    assert unmarked_slow_tests(str(path), shared) == [
        "test_compiles", "test_compiled_model", "test_through_helpers", "test_through_a_fixture",
        "test_through_a_conftest_fixture", "TestGroup::test_method"]
    marked = source.replace("\ndef test_", "\n@pytest.mark.slow\ndef test_").replace(
        "class TestGroup", "slow = pytest.mark.slow\n\n@slow\nclass TestGroup")
    path.write_text(marked)
    assert unmarked_slow_tests(str(path), shared) == []
    path.write_text(source + "\npytestmark = [pytest.mark.usefixtures('x'), pytest.mark.slow]\n")
    assert unmarked_slow_tests(str(path), shared) == []
    # and on the real tree, what the shared modules make slow
    real = _shared_slow()
    assert {"run_tool", "launch"} <= real["helpers"] and "build_wheel" in real["packaging"]
    assert {"toy_data", "wheel"} <= real["conftest"]
