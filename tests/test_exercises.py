"""The exercises, checked at both ends: each stub fails every one of its tests with its
"not implemented" message (never a crash), and the reference functions, copied into
the exercise files, pass them all; the lesson tells the counts the learner will see.
A broken exercise file is reported in a line, and breaks nothing else.  (The C++ and
CUDA exercises, built once per file: test_exercises_compiled.py.)"""

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minipaged.commands import check
from minipaged.commands.check import EXERCISES, ROOT, reference, run_all, run_each

STUBS = ROOT / "exercises"
PYTHON = [e for e in EXERCISES if not e.compiled]


def solved(exercise, into: Path) -> Path:
    """The exercise file with each stub's body replaced by the reference's source, and
    imports of the module globals that source uses: what a learner who copied the
    package's code would have written."""
    if exercise.compiled:
        return solved_cpp(exercise, into)
    source = (STUBS / exercise.file).read_text()
    lines = source.splitlines()
    imports = []
    defs = {
        node.name: node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name in exercise.replaces
    }
    # Bottom up, so earlier line numbers stay right.
    for name, node in sorted(defs.items(), key=lambda item: -item[1].lineno):
        _, attribute, original = reference(exercise.replaces[name])
        function = getattr(original, "fn", original)  # a Triton JITFunction wraps it
        code = textwrap.dedent(inspect.getsource(function))
        code = code.replace(f"def {attribute}(", f"def {name}(", 1)
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        lines[first - 1 : node.end_lineno] = code.splitlines()
        module = sys.modules[function.__module__]
        used = set(function.__code__.co_names) & set(vars(module)) - set(defs)
        imports += [f"from {function.__module__} import {n}" for n in sorted(used)]
    path = into / exercise.file
    # Annotations stay strings, as in the package: they may name what the stub lacks.
    header = ["from __future__ import annotations", *imports]
    path.write_text("\n".join(header + lines) + "\n")
    return path


def cpp_definition(name: str, source: str) -> re.Match:
    """The definition of C++ function ``name`` in ``source``: from its ``template``
    line (if any) to the ``}`` that closes it, alone on its line."""
    found = re.search(
        rf"^(template <[^>]*>\n)?[^\n]*\b{name}\(.*?^}}\n", source, re.MULTILINE | re.DOTALL
    )
    assert found, f"no definition of {name}() in the source"
    return found


def solved_cpp(exercise, into: Path) -> Path:
    """The C++ exercise with each stub's definition replaced by the reference's, from
    the package's C++ file, and that file's includes (a CUDA exercise has none: it is
    included into the kernel file, after all it uses)."""
    source = (STUBS / exercise.file).read_text()
    includes = []
    for name, target in exercise.replaces.items():
        reference_source = (ROOT / target).read_text()
        stub = cpp_definition(name, source)
        code = cpp_definition(name, reference_source)[0]
        source = source[: stub.start()] + code + source[stub.end() :]
        if target.endswith(".cpp"):
            includes += re.findall(r"^#include .*\n", reference_source, re.MULTILINE)
    path = into / exercise.file
    path.write_text("".join(includes) + source)
    return path


def lesson_text(number: str) -> str:
    (path,) = (ROOT / "lessons").glob(f"{number}_*.ipynb")
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def assert_both_ends(exercise, stub, done) -> None:
    """The stub fails every test with its message; the solution passes them all; the
    lesson prints both counts."""
    assert stub.problem is None, stub.problem
    assert stub.passed == 0 and stub.failed > 0
    stub_says = f"in exercises/{exercise.file})"
    assert [
        f for f in stub.failures if "not implemented yet (write " not in f or stub_says not in f
    ] == []

    assert done.problem is None, done.problem
    assert (done.passed, done.failed) == (stub.failed, 0), done.failures

    prose = lesson_text(exercise.lesson)
    assert f"exercises/{exercise.file}: 0 passed, {stub.failed} failed" in prose
    assert f"exercises/{exercise.file}: {stub.failed} passed, 0 failed" in prose


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    """Every Python exercise on its stub, then on its solution, in one pytest process
    (`run_all`): each exercise's file's results, ``(stub, solution)``."""
    solutions = tmp_path_factory.mktemp("solved")
    for exercise in PYTHON:
        solved(exercise, solutions)
    return dict(zip([e.file for e in PYTHON], run_all(PYTHON, [STUBS, solutions])))


@pytest.mark.parametrize("exercise", PYTHON, ids=lambda e: Path(e.file).stem)
def test_stub_fails_every_test_and_the_reference_passes_them(exercise, checked):
    assert_both_ends(exercise, *checked[exercise.file])


def test_a_swap_is_undone_as_it_was():
    """What one exercise swapped in is put back before the next runs: a method, a
    module's copy of a function, and a staticmethod each as they were."""
    from minipaged.core.memory import allocator, block_table

    exercises = {e.file: e for e in EXERCISES}
    before = [
        vars(allocator.BlockAllocator)["allocate"],
        vars(block_table)["slot_mapping"],
    ]
    swaps = []
    try:  # this process runs other tests: never leave a stub in
        check.swap_in(STUBS / "allocator.py", exercises["allocator.py"].replaces, swaps)
        check.swap_in(STUBS / "slot_mapping.py", exercises["slot_mapping.py"].replaces, swaps)
        with pytest.raises(NotImplementedError):
            allocator.BlockAllocator(2).allocate()
        assert block_table.slot_mapping is not before[1]
    finally:
        check.undo(swaps)
    assert allocator.BlockAllocator(2).allocate() == 0
    assert [vars(allocator.BlockAllocator)["allocate"], vars(block_table)["slot_mapping"]] == before

    class Holder:
        hold = staticmethod(len)

    swaps = [(Holder, "hold", vars(Holder)["hold"]), (Holder, "added", check._INHERITED)]
    Holder.hold, Holder.added = abs, abs
    check.undo(swaps)
    assert Holder().hold("ab") == 2 and not hasattr(Holder, "added")


def test_a_broken_exercise_is_named_in_one_line_and_breaks_nothing_else(tmp_path):
    exercise = EXERCISES[0]
    syntax, incomplete = tmp_path / "syntax", tmp_path / "incomplete"
    for folder, code in (
        (syntax, "def allocate(self):\n    return (\n"),
        (incomplete, "def allocate(self):\n    return 0\n"),
    ):
        folder.mkdir()
        (folder / exercise.file).write_text(code)
    # One process: a file that does not load runs none of the tests, and leaves the
    # next file's run (the stub's) as it would be alone.
    first, second, stub = run_each(exercise, [syntax, incomplete, STUBS])
    assert first.problem.startswith(f"{syntax / exercise.file} does not load: SyntaxError")
    assert "has no function free()" in second.problem
    assert first.passed == first.failed == second.passed == second.failed == 0
    assert stub.problem is None and stub.passed == 0 and stub.failed > 0
    assert all("not implemented yet (write " in f for f in stub.failures), stub.failures
    # The package imports, and runs, without the exercises.
    code = "import minipaged.core.memory as m; print(m.BlockAllocator(2).allocate())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.stdout.strip() == "0"


def test_the_command_prints_counts_and_the_first_failure(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "minipaged", "check", "2", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0].startswith("exercises/slot_mapping.py: 0 passed, ")
    assert lines[1].startswith("  first failure: tests/test_block_table.py::")
    assert lines[1].endswith(
        "not implemented yet (write slot_mapping() in exercises/slot_mapping.py)"
    )
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["passed"] == 0 and row["failed"] == len(row["failures"]) > 0


def test_a_lesson_without_exercises_is_refused_by_name():
    out = subprocess.run(
        [sys.executable, "-m", "minipaged", "check", "00"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 2
    assert "lesson '00' has no exercise" in out.stderr


def test_a_cuda_exercise_without_the_toolkits_headers_says_what_to_install(monkeypatch):
    from minipaged.ops import cuda_build

    monkeypatch.setattr(cuda_build, "_cuda_include", lambda: None)
    cuda_build._missing.cache_clear()
    monkeypatch.setattr(cuda_build, "_LOADED", {})
    try:
        with pytest.raises(check._LoadError) as error:
            check.build_in(STUBS / "cuda_qk_logits.cu")
    finally:
        cuda_build._missing.cache_clear()
    assert str(error.value).startswith(
        "exercises/cuda_qk_logits.cu cannot be checked on this machine: the CUDA emulator "
        "needs no GPU but the CUDA toolkit's headers (cuda_fp16.h, cuda_bf16.h)"
    )
    assert "install the CUDA toolkit" in str(error.value) and "CUDA_HOME" in str(error.value)
    assert cuda_build._LOADED == {}  # nothing built, nothing swapped in
