"""The compiled exercises (lesson 07's CPU kernel loop in C++, lesson 08's CUDA kernel
phase in the emulator), checked at both ends as the Python ones (test_exercises.py)
are, each file built in a process of its own; a C++ file that does not compile, or
writes out of bounds, is named in one line."""

import os
import re
import subprocess
import sys

import pytest

from minipaged.commands.check import EXERCISES, ROOT, run, run_each
from test_exercises import STUBS, assert_both_ends, solved

pytestmark = pytest.mark.spread  # each test builds and runs in processes of its own

COMPILED = [e for e in EXERCISES if e.compiled]


@pytest.mark.parametrize("exercise", COMPILED, ids=lambda e: e.file)
def test_stub_fails_every_test_and_the_reference_passes_them(exercise, tmp_path):
    assert_both_ends(exercise, *run_each(exercise, [STUBS, solved(exercise, tmp_path).parent]))


def test_a_broken_cpp_exercise_is_named_in_one_line_and_breaks_nothing_else(tmp_path):
    (exercise,) = [e for e in COMPILED if e.file.endswith(".cpp")]
    path = tmp_path / exercise.file
    stub = (STUBS / exercise.file).read_text()
    path.write_text(stub.replace("TORCH_CHECK_NOT_IMPLEMENTED(", "undeclared_check(", 1))
    line = stub[: stub.index("TORCH_CHECK_NOT_IMPLEMENTED(")].count("\n") + 1
    problem = run(exercise, tmp_path).problem
    shown = re.escape(str(path))
    assert re.fullmatch(
        rf"{shown} does not compile: {shown}:{line}:\d+: .*undeclared_check.*", problem
    ), problem
    # A write far out of bounds kills the test process: named, not a traceback.
    crash = "state.acc[first - (int64_t{1} << 40)] = q[0];  // "
    path.write_text(stub.replace("TORCH_CHECK_NOT_IMPLEMENTED(", crash, 1))
    assert run(exercise, tmp_path).problem == (
        "the tests crashed (SIGSEGV): does your code read or write out of bounds?"
    )
    # The exercise's next build starts from the stub again, and the package's kernel,
    # another build, still runs (in a process of its own, as a learner's next command).
    stub_says = f"not implemented yet (write attend_tile() in exercises/{exercise.file})"
    assert run(exercise, STUBS).failures[0].endswith(stub_says)
    code = (
        "import torch; from minipaged.ops import paged_attention_decode as d; "
        "c = torch.ones(2, 4, 1, 8); t = torch.tensor([[1]], dtype=torch.int32); "
        "print(d(torch.ones(1, 1, 8), c, 2 * c, t, torch.tensor([3]), 0.5, 'cpu').tolist())"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == str([[[2.0] * 8]]), out.stderr
