"""``minipaged check NN``: a lesson's own tests, run on the learner's code.

A lesson's exercise is a stub under ``exercises/`` (the signature, the docstring, and
``raise NotImplementedError``) for one piece of the engine the lesson explains.  This
command runs the tests that check that piece (the package's own, from ``tests/``) with
the learner's functions put in place of the reference ones, and prints how many
passed and the first failure in plain words.  The package itself is never edited: the
functions are swapped only inside the pytest process this command starts, and each
exercise's swap is undone before the next runs, so a broken exercise breaks neither
``minipaged`` nor another exercise.

The swap happens once the tests are collected, before they run (`ExercisePlugin`):
every module of the checkout (the package's and the tests') that holds the reference
object gets the learner's instead, and a method is replaced on its class, so subclasses
that inherit it use the learner's too.  A C++ exercise is compiled instead: lesson 07's
CPU kernel, or lesson 08's CUDA kernel in the CPU emulator, is built again, in a folder
of its own, with the learner's file in place of the reference loop, and a compile error
is reported as its first line.  This is the tiny-llm way of teaching (write the code,
run the command, watch the counts go from 0 to all), over this engine's own test suite.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NAME = "check"
HELP = "run a lesson's tests on your exercise (exercises/): passed/failed, first failure"
DESCRIPTION = (
    "Run the tests of lesson NN with your functions from exercises/ in place of "
    "minipaged's own, and print how many passed and the first failing assertion.  "
    "The package is not changed: the swap lives only in the test run.  Needs a source "
    "checkout (exercises/ and tests/)."
)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a learner's endless loop ends here, and is named as one
COMPILED = (".cpp", ".cu")  # exercises built into a kernel (`build_in`), not imported
_ENV = "MINIPAGED_EXERCISE"  # tells the pytest child which exercise to load, and where


@dataclass(frozen=True)
class Exercise:
    """One stub file: the functions it defines, what each replaces, and its tests.

    ``replaces`` maps a function of the file to ``"module:qualname"`` of the reference
    it stands in for (a method is ``Class.method``), or, for a C++ file, to the
    package's C++ file that holds the reference; ``tests`` are pytest arguments (files,
    node ids, ``-k`` expressions) relative to the checkout."""

    lesson: str
    file: str
    replaces: dict[str, str]
    tests: tuple[str, ...]

    @property
    def compiled(self) -> bool:
        """A C++ or CUDA file, built into a kernel: a process per file (`build_in`)."""
        return self.file.endswith(COMPILED)


EXERCISES = (
    Exercise(
        "01",
        "allocator.py",
        {
            "allocate": "minipaged.core.memory.allocator:BlockAllocator.allocate",
            "free": "minipaged.core.memory.allocator:BlockAllocator.free",
        },
        ("tests/test_allocator.py", "-k", "not pool_size and not distinguishable and not all_free"),
    ),
    Exercise(
        "02",
        "slot_mapping.py",
        {"slot_mapping": "minipaged.core.memory.block_table:slot_mapping"},
        (
            "tests/test_block_table.py",
            "-k",
            "bulk or interleaved or shuffled or exactly_fits",
        ),
    ),
    Exercise(
        "03",
        "copy_on_write.py",
        {"copy_on_write": "minipaged.core.memory.block_table:BlockTable._copy_on_write"},
        (
            "tests/test_cow.py",
            "-k",
            "(copies_it or copy_until or counts_both or parallel or beam)"
            " and not [1- and not [4-8-",
        ),
    ),
    Exercise(
        "04",
        "prefix_hashing.py",
        {
            "hash_block": "minipaged.core.memory.prefix_cache:hash_block",
            "match_prefix": (
                "minipaged.core.memory.prefix_cache:PrefixCachingBlockAllocator.match_prefix"
            ),
        },
        (
            "tests/test_prefix_cache.py",
            "-k",
            "not colliding and not parent_blind and not constant_hash",
        ),
    ),
    Exercise(
        "05",
        "admission.py",
        {"admission_plan": "minipaged.core.sched.scheduler:Scheduler._admission_plan"},
        (
            "tests/test_scheduler.py",
            "-k",
            "admission or arrival_order or chunked or seats or reference_model",
        ),
    ),
    Exercise(
        "06",
        "swapping.py",
        {"swap": "minipaged.core.memory.kv_cache_manager:KVCacheManager._swap"},
        (
            "tests/test_kv_cache_manager.py",
            "tests/test_scheduler.py",
            "-k",
            "swap and not refused and not falls_back",
        ),
    ),
    Exercise(
        "07",
        "online_softmax.py",
        {"paged_attention_decode": "minipaged.ops.torch_ref:paged_attention_decode"},
        ("tests/test_ops_torch.py", "-k", "decode_matches_oracle"),
    ),
    Exercise(
        "07",
        "triton_attend_tile.py",
        {"attend_tile": "minipaged.ops.triton_kernels:_attend_tile"},
        ("tests/test_ops_triton.py", "-k", "decode_matches_oracle and bs16 and not Cuda"),
    ),
    Exercise(
        "07",
        "cpu_attend_tile.cpp",
        {"attend_tile": "kernels/cpu/attend_tile.cpp"},
        (
            "tests/test_ops_cpu.py",
            "-k",
            "(decode_matches_oracle or long_contexts) and not avx2 and not bfloat16",
        ),
    ),
    Exercise(
        "08",
        "cuda_qk_logits.cu",
        {"qk_logits": "kernels/paged_attention_v1.cu"},
        (
            "tests/test_ops_cuda.py",
            "-k",
            # What cuda_build.QK_LOGITS_SET holds (v2, head_dim 64): the small cases, and
            # contexts across v2's partitions for each block size.
            "v2 and d64 and (every_version_matches_oracle"
            " or every_compiled_shape_and_dtype and bfloat16)",
        ),
    ),
    Exercise(
        "09",
        "incremental_detokenizer.py",
        {"update": "minipaged.engine.detokenizer:IncrementalDetokenizer.update"},
        ("tests/test_detokenizer.py",),
    ),
    Exercise(
        "10",
        "stop_strings.py",
        {"stop_string": "minipaged.engine.output_processor:stop_string"},
        (
            "tests/test_engine.py",
            "tests/test_server.py",
            "-k",
            # A server in a process of its own runs minipaged's function: not a test of yours.
            "stop_string and not subprocess",
        ),
    ),
    Exercise(
        "11",
        "contiguous_reservation.py",
        {
            "reservation_size": "minipaged.core.memory.contiguous:reservation_size",
            "reserve": "minipaged.core.memory.contiguous:ContiguousAllocator.reserve",
        },
        (
            "tests/test_contiguous.py",
            "tests/test_memory_modes.py",
            "-k",
            "(reservation_size or first_fit or allocator_errors or by_hand) and not paged",
        ),
    ),
    Exercise(
        "12",
        "pipeline_split.py",
        {
            "pp_layer_counts": "minipaged.distributed.parallel_state:pp_layer_counts",
            "micro_batches": "minipaged.worker.model_runner:micro_batches",
        },
        ("tests/test_pipeline_parallel.py", "-k", "split_as_vllm or micro_batches_cut"),
    ),
    Exercise(
        "13",
        "ngram_proposer.py",
        {"propose": "minipaged.spec_decode.ngram:NgramProposer.propose"},
        (
            "tests/test_spec_proposers.py",
            "tests/test_spec_decode.py",
            "-k",
            "proposes_what or longest_match or refuses_short or brute_force"
            " or greedy_equals_hf_whatever and ngram",
        ),
    ),
    Exercise(
        "13",
        "rejection_sampling.py",
        {
            "modified_rejection_sampling": (
                "minipaged.sample.rejection_sampler:_modified_rejection_sampling"
            )
        },
        (
            "tests/test_spec_rejection.py",
            "tests/test_spec_decode.py",
            "-k",
            "follow_the_target or greedy_target or seeded_verification"
            " or greedy_equals_hf_whatever",
        ),
    ),
    Exercise(
        "14",
        "fp8_round_trip.py",
        {"quantize": "minipaged.ops.kv_quant:quantize"},
        (
            "tests/test_kv_quant.py",
            "-k",
            "(rounds_within or do_not_depend) and torch or quantizing_store or saturate",
        ),
    ),
    Exercise(
        "15",
        "punica.py",
        {"bgmv": "minipaged.ops.punica:bgmv", "sgmv": "minipaged.ops.punica:sgmv"},
        (
            "tests/test_lora.py",
            "-k",
            # The base model alone ([None]) runs no LoRA term: not a test of yours.
            "bgmv_and_sgmv or each_adapter_alone and not None or mixed_batch_gives",
        ),
    ),
    Exercise(
        "16",
        "routing.py",
        {"route": "minipaged.models.moe:route"},
        ("tests/test_moe.py", "-k", "route_equals or routing_stats_count"),
    ),
    Exercise(
        "17",
        "kv_load.py",
        {
            "start_load_kv": "minipaged.distributed.kv_transfer.kv_connector.v1."
            "shared_storage_connector:SharedStorageConnector.start_load_kv"
        },
        (
            "tests/test_disagg_prefill.py",
            "-k",
            "consumer_loads or preempted_consumer or after_a_load or int8_cache or removed_after",
        ),
    ),
    Exercise(
        "18",
        "int4_packing.py",
        {
            "pack": "minipaged.models.quantization.formats:_pack",
            "unpack": "minipaged.models.quantization.formats:_unpack",
        },
        ("tests/test_quantization.py", "-k", "packing_matches"),
    ),
    Exercise(
        "19",
        "pooler.py",
        {
            "add": "minipaged.models.pooler:Pooler.add",
            "finish": "minipaged.models.pooler:Pooler.finish",
        },
        (
            "tests/test_pooling.py",
            "-k",
            "matches_hf or keeps_embeddings or double_counts or overrides or matryoshka_dimensions",
        ),
    ),
    Exercise(
        "20",
        "image_prefix_key.py",
        {
            "mm_cache_key": "minipaged.sequence:mm_cache_key",
            "block_key": "minipaged.core.memory.prefix_cache:block_key",
        },
        (
            "tests/test_multimodal.py",
            "tests/test_prefix_cache.py",
            "tests/test_lora.py",
            "-k",
            "keys_on_the_image or shares_the_blocks_before or shared_prompt_prefix"
            " or different_prefix_do_not or keeps_adapters_apart",
        ),
    ),
    Exercise(
        "21",
        "absorbed_decode.py",
        {"decode_absorbed": "minipaged.models.deepseek_v2:MLAPagedAttention._decode_absorbed"},
        (
            "tests/test_mla.py",
            "-k",
            # Prefill only, or unabsorbed, never runs the absorbed decode: not a test of yours.
            "naive_oracle and absorbed and not unabsorbed and not prefills or fp8_latent_cache"
            " or every_feature_at_once and torch",
        ),
    ),
    Exercise(
        "22",
        "grammar_bitmask.py",
        {"apply_grammar_bitmask": "minipaged.structured_output.utils:apply_grammar_bitmask"},
        (
            "tests/test_structured_output.py",
            "-k",
            "bit_by_bit_loop or greedy_tokens_equal_hf or regex_and_choice or sampled_json"
            " or n_forks",
        ),
    ),
)


def exercises_of(lesson: str) -> list[Exercise]:
    """The exercises of lesson ``lesson`` ("1", "01" or "01_block_allocator" alike)."""
    number = str(lesson).split("_")[0]
    if not number.isdigit():
        raise ValueError(f"lesson must be a lesson number such as 01, got {lesson!r}")
    found = [e for e in EXERCISES if e.lesson == f"{int(number):02d}"]
    if not found:
        have = sorted({e.lesson for e in EXERCISES})
        raise ValueError(f"lesson {lesson!r} has no exercise; these do: {', '.join(have)}")
    return found


def reference(target: str):
    """``(owner, attribute name, object)`` of a ``"module:qualname"`` reference."""
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


# -- the run --------------------------------------------------------------------------
@dataclass
class Result:
    """What one exercise's test run found."""

    exercise: Exercise
    passed: int = 0
    failed: int = 0
    first_failure: str | None = None
    failures: list[str] | None = None  # each failed test's one-line reason
    problem: str | None = None  # the file would not load, or the run did not finish


def run(exercise: Exercise, exercises_dir: Path, verbose: bool = False) -> Result:
    """Run ``exercise``'s tests in a pytest process of their own, with the functions of
    ``exercises_dir / exercise.file`` swapped in."""
    return run_each(exercise, [exercises_dir], verbose)[0]


def run_each(exercise: Exercise, dirs: list[Path], verbose: bool = False) -> list[Result]:
    """`run` for each folder of ``dirs`` in turn (a stub, then a solution)."""
    return run_all([exercise], dirs, verbose)[0]


def run_all(exercises: list[Exercise], dirs: list[Path], verbose: bool = False):
    """For each of ``exercises``, its results with each folder of ``dirs`` in turn.

    The Python exercises share one pytest process: its start-up and collection, most of
    a check's time, are paid once; each pass sets up its fixtures afresh, and each
    exercise's swap is undone before the next.  A C++ exercise takes a process per
    folder: a process cannot unload the kernel it built (`build_in`)."""
    if not (ROOT / "tests").is_dir():
        raise ValueError(f"minipaged check needs a source checkout: no tests/ in {ROOT}")
    python = [i for i, e in enumerate(exercises) if not e.compiled]
    shared = _run_process([exercises[i] for i in python], dirs, verbose) if python else []
    found = dict(zip(python, shared))
    return [
        found[i] if i in found else [_run_process([e], [d], verbose)[0][0] for d in dirs]
        for i, e in enumerate(exercises)
    ]


def _run_process(exercises: list[Exercise], dirs: list[Path], verbose: bool) -> list[list[Result]]:
    """`run_all`'s pytest process: the union of the exercises' test files collected once,
    and each exercise's own tests run on each folder's file (`ExercisePlugin`)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = [
            {
                "replaces": exercise.replaces,
                "tests": exercise.tests,
                "passes": [
                    {"file": str(folder / exercise.file), "report": f"{tmp}/{i}-{j}.json"}
                    for j, folder in enumerate(dirs)
                ],
            }
            for i, exercise in enumerate(exercises)
        ]
        env = {**os.environ, _ENV: json.dumps(spec), "PYTHONPATH": str(ROOT)}
        if any(e.file.endswith(".cu") for e in exercises):  # the emulator's: CPU tensors
            env["CUDA_VISIBLE_DEVICES"] = ""
        command = [sys.executable, "-m", "pytest", "-p", __name__, "-p", "no:cacheprovider"]
        command += ["-q", "--no-header", *dict.fromkeys(f for e in exercises for f in files(e))]
        timeout = TIMEOUT_S * len(exercises) * len(dirs)

        def each(problem: str) -> list[list[Result]]:
            return [[Result(e, problem=problem) for _ in dirs] for e in exercises]

        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env=env,
                capture_output=not verbose,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return each(f"the tests did not finish in {timeout} s: is there an endless loop?")
        if done.returncode < 0:  # a signal: a C++ exercise's stray pointer kills the process
            name = signal.Signals(-done.returncode).name
            return each(f"the tests crashed ({name}): does your code read or write out of bounds?")
        reports = [[Path(p["report"]) for p in e["passes"]] for e in spec]
        if not all(report.exists() for row in reports for report in row):
            tail = (done.stdout or "")[-2000:] + (done.stderr or "")[-2000:]
            return each(f"pytest stopped before any test ran:\n{tail}")
        return [
            [Result(e, **json.loads(report.read_text())) for report in row]
            for e, row in zip(exercises, reports)
        ]


def files(exercise: Exercise) -> list[str]:
    """The test files (or node ids) of ``exercise.tests``: its arguments but ``-k``'s."""
    tests = list(exercise.tests)
    return [t for i, t in enumerate(tests) if t != "-k" and (i == 0 or tests[i - 1] != "-k")]


def describe(result: Result) -> str:
    """The lines ``minipaged check`` prints for one exercise."""
    where = f"exercises/{result.exercise.file}"
    if result.problem:
        return f"{where}: {result.problem}"
    total = result.passed + result.failed
    lines = [f"{where}: {result.passed} passed, {result.failed} failed (of {total} tests)"]
    if result.first_failure:
        lines.append(f"  first failure: {result.first_failure}")
    elif total:
        lines.append("  all pass: well done")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("lesson", metavar="NN", help="the lesson number, e.g. 01")
    parser.add_argument(
        "--exercises-dir",
        type=Path,
        default=ROOT / "exercises",
        help="where the exercise files are (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, help="also write the counts here, as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")


def main(args) -> None:
    exercises = exercises_of(args.lesson)
    results = [r for (r,) in run_all(exercises, [args.exercises_dir], args.verbose)]
    print("\n".join(describe(r) for r in results))
    if args.json:
        rows = [
            {
                "file": r.exercise.file,
                "passed": r.passed,
                "failed": r.failed,
                "failures": r.failures or [],
                "problem": r.problem,
            }
            for r in results
        ]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if any(r.problem or r.failed for r in results):
        sys.exit(1)


# -- inside the pytest process: the plugin `run_all` loads with -p --------------------
class ExercisePlugin:
    """Runs each exercise of the spec on its own tests, once for each file of its
    ``passes`` with that file's functions swapped in, and records each pass's outcomes
    for `run_all`; the swap is undone before the next exercise."""

    def __init__(self, spec: list[dict]) -> None:
        self.spec = spec
        self.current = {}  # the result of the pass whose tests are running

    def pytest_runtestloop(self, session):
        # Registered after pytest's own loop, so called before it (it answers first).
        if session.testsfailed or session.config.option.collectonly:
            return None  # pytest's own loop stops on collection errors, or only lists
        problems = []
        for exercise in self.spec:
            items = selected(session.items, exercise["tests"])
            for run in exercise["passes"]:
                self.current = {"passed": 0, "failed": 0, "first_failure": None, "failures": []}
                swaps = []
                try:
                    swap_in(Path(run["file"]), exercise["replaces"], swaps)
                    run_items(session, items)
                except _LoadError as error:
                    self.current["problem"] = str(error)
                    problems.append(str(error))
                finally:
                    undo(swaps)
                Path(run["report"]).write_text(json.dumps(self.current))
        if problems:
            import pytest  # only inside pytest: the package runs without it

            pytest.exit("\n".join(problems), returncode=3)
        return True

    def pytest_runtest_logreport(self, report) -> None:
        result = self.current
        if report.when == "call" and report.passed:
            result["passed"] += 1
        elif report.failed:
            reason = f"{report.nodeid}: {plain_words(report)}"
            result["failed"] += 1
            result["failures"].append(reason)
            result["first_failure"] = result["first_failure"] or reason


def selected(items: list, tests: list[str]) -> list:
    """The collected ``items`` that ``tests`` (an exercise's pytest arguments: files or
    node ids, then ``-k`` and an expression) name, matched as pytest's ``-k`` does."""
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    keyword = tests[tests.index("-k") + 1] if "-k" in tests else None
    expression = Expression.compile(keyword) if keyword else None
    named = tuple(t for t in tests if t != "-k" and t != keyword)
    return [
        item
        for item in items
        if any(item.nodeid == n or item.nodeid.startswith(n + "::") for n in named)
        and (expression is None or expression.evaluate(KeywordMatcher.from_item(item)))
    ]


def run_items(session, items: list) -> None:
    """Run ``items`` as pytest's own loop would; the last one tears every fixture down,
    so the next pass starts afresh."""
    for i, item in enumerate(items):
        nextitem = items[i + 1] if i + 1 < len(items) else None
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        if session.shouldfail or session.shouldstop:
            raise session.Interrupted(session.shouldfail or session.shouldstop)


class _LoadError(Exception):
    """The exercise file cannot be used: it does not import, or lacks a function."""


def swap_in(path: Path, replaces: dict[str, str], swaps: list) -> None:
    """Load the exercise at ``path`` and put its functions in place of the references,
    in every module of the checkout that holds them (a C++ exercise: `build_in`); each
    replacement is added to ``swaps``, for `undo`."""
    if path.suffix in COMPILED:
        build_in(path)
        return
    shown = _shown(path)
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    if spec is None:
        raise _LoadError(f"{shown} is not there")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a learner's file may raise anything while it loads
        raise _LoadError(f"{shown} does not load: {type(error).__name__}: {error}") from None
    for name, target in replaces.items():
        if not hasattr(module, name):
            raise _LoadError(f"{shown} has no function {name}(): keep the stub's name")
        owner, attribute, original = reference(target)
        holders = [owner] + [
            other
            for other in list(sys.modules.values())
            if other is not owner
            and _in_checkout(other)
            and getattr(other, attribute, None) is original
        ]
        for holder in holders:
            # What the holder itself has (a class's staticmethod, not the function it
            # wraps), or _INHERITED: to be put back as it was.
            swaps.append((holder, attribute, vars(holder).get(attribute, _INHERITED)))
            setattr(holder, attribute, getattr(module, name))


def undo(swaps: list) -> None:
    """Put back what `swap_in` replaced, last first."""
    for holder, attribute, original in reversed(swaps):
        if original is _INHERITED:
            delattr(holder, attribute)
        else:
            setattr(holder, attribute, original)


_INHERITED = object()


def build_in(path: Path) -> None:
    """A C++ exercise: the kernel built with the learner's file in place of its reference
    inner loop, then used by every call of its backend in this process: lesson 07's CPU
    kernel (`cpu_ops.build_with_attend_tile`), or lesson 08's CUDA kernels in the CPU
    emulator (`cuda_build.build_with_qk_logits`)."""
    from minipaged.ops import cpu_ops, cuda_build

    shown = _shown(path)
    if not path.is_file():
        raise _LoadError(f"{shown} is not there")
    cuda = path.suffix == ".cu"
    if cuda and (why := cuda_build.emulator_missing()):
        raise _LoadError(f"{shown} cannot be checked on this machine: {why}")
    try:
        built = (cuda_build.build_with_qk_logits if cuda else cpu_ops.build_with_attend_tile)(path)
    except (RuntimeError, OSError, ImportError) as error:  # compiler, linker, loader
        raise _LoadError(f"{shown} does not compile: {first_error(str(error))}") from None
    if cuda:  # what every emulated launch of this process loads (its tests ask no more)
        cuda_build._LOADED[(True, None)] = [(cuda_build.ALL, built)]
    else:
        cpu_ops._kernel = lambda: built


def first_error(output: str) -> str:
    """The compiler's first error in ``output`` as ``file:line:column: message``; else
    the output's last line (a linker's or loader's complaint)."""
    for line in output.splitlines():
        found = re.match(r"(\S+?):(\d+:\d+): (?:fatal )?error: (.*)", line)
        if found:
            return f"{_shown(Path(found[1]))}:{found[2]}: {found[3]}"
    return output.strip().splitlines()[-1]


def _in_checkout(module) -> bool:
    file = getattr(module, "__file__", None)
    return bool(file) and Path(file).resolve().is_relative_to(ROOT)


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def plain_words(report) -> str:
    """One line on why a test failed: the stub's message, or the failing assertion
    and where it is."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return str(report.longrepr).strip().splitlines()[-1]
    message = crash.message.strip()
    # Triton's interpreter wraps the stub's error: InterpreterError("NotImplementedError('...')")
    stub = re.search(
        r"NotImplementedError(?::\s*|\(\\?['\"])(.+?)(?:\\?['\"]\)|$)", message, re.MULTILINE
    )
    if stub:
        return f"not implemented yet ({stub.group(1)})"
    first = message.splitlines()[0]
    return f"{first}  [{_shown(Path(crash.path))}:{crash.lineno}]"


def pytest_configure(config) -> None:
    spec = os.environ.get(_ENV)
    if spec:
        config.pluginmanager.register(ExercisePlugin(json.loads(spec)), "minipaged-exercise")
