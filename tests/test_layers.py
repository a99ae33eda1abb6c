"""Import arrows point down the layers of docs/architecture.md; the memory layer is
standard library only."""

import ast
import re
import subprocess
import sys
from pathlib import Path


def modules_loaded_by(*names: str) -> set[str]:
    code = (
        f"import sys; {'; '.join(f'import {n}' for n in names)}; "
        "print('\\n'.join(sorted(m.split('.')[0] for m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_memory_layer_needs_nothing_but_the_standard_library():
    loaded = modules_loaded_by(
        "minipaged.core.memory",
        "minipaged.core.memory.simulate",
        "minipaged.core.memory.contiguous",
        "minipaged.core.memory.workloads",
    )
    at_start_up = modules_loaded_by("sys")  # the interpreter's and the venv's own
    third_party = loaded - at_start_up - set(sys.stdlib_module_names) - {"minipaged"}
    assert third_party == set(), f"the memory layer pulled in {sorted(third_party)}"


# -- rules of their own -----------------------------------------------------------------
def submodule_imports(package: str) -> dict[str, set[str]]:
    """Each module under ``package`` -> the modules under it that it imports, anywhere in
    it (``from minipaged.bench import common`` imports ``minipaged.bench.common``)."""
    root = ROOT / Path(*package.split("."))
    modules = {
        ".".join((package, *p.relative_to(root).with_suffix("").parts)): p
        for p in sorted(root.rglob("*.py"))
        if p.name != "__init__.py"
    }
    imports = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in (package, *modules):
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        imports[module] = found & modules.keys()
    return imports


def test_the_commands_and_the_demo_import_no_benchmark():
    """The benchmarks are a library of experiments beside the ``minipaged`` commands: the
    flags both use live below them (`minipaged.arg_utils`), so ``minipaged generate``
    and ``make demo`` load nothing of ``minipaged.bench``."""
    interface = ("minipaged.cli", "minipaged.commands", "minipaged.demo", "minipaged.__main__")
    wrong = [
        f"{module} -> {name}"
        for module, imported in package_imports().items()
        if module.startswith(interface)
        for name in imported
        if name == "minipaged.bench" or name.startswith("minipaged.bench.")
    ]
    assert not wrong, "\n".join(sorted(wrong))


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (module -> the modules it imports), as the modules along it
    with the first repeated at the end, or None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for name in sorted(graph.get(module, ())):
            if cycle := visit(name):
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := visit(m))), None)


def test_the_benchmarks_import_each_other_without_a_cycle():
    """A module of ``minipaged.bench`` is a library (presets, HF baselines, the overhead
    probe, results) or an experiment on top of them, never both ways round."""
    bench = submodule_imports("minipaged.bench")
    assert "minipaged.bench.presets" in bench["minipaged.bench.args"]  # the finder finds
    assert import_cycle(bench) is None, " -> ".join(import_cycle(bench))


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycle(graph) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None


# -- tests/README.md maps every module to its tests ------------------------------------
def readme_rows() -> list[tuple[list[str], list[str]]]:
    """The rows of tests/README.md's table: (modules under minipaged/, test files)."""
    text = (ROOT / "tests" / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    cells = [row.split(" | ")[:2] for row in rows]
    return [(re.findall(r"`([\w/]+\.py)`", m), re.findall(r"`(\w+\.py)`", t)) for m, t in cells]


def defines_code(path: Path) -> bool:
    """Whether a module defines a function or class (a package's lazy ``__getattr__``,
    PEP 562, aside): a package that only gathers names needs no row of its own."""
    return any(
        isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name != "__getattr__"
        for node in ast.parse(path.read_text()).body
    )


def test_every_module_has_a_row_in_the_test_map():
    rows = readme_rows()
    mapped = {module for modules, _ in rows for module in modules}
    package = ROOT / "minipaged"
    missing = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if defines_code(path) and str(path.relative_to(package)) not in mapped
    ]
    assert not missing, (
        f"modules without a row in tests/README.md's table: {missing}; add one naming "
        "the test file that checks each (and the oracle it checks against)"
    )
    gone = [m for m in mapped if not (package / m).is_file()]
    gone += [t for _, tests in rows for t in tests if not (ROOT / "tests" / t).is_file()]
    assert not gone, f"tests/README.md names files that are not there: {gone}"
    assert all(tests for _, tests in rows), "a row of tests/README.md names no test file"


# -- every import points down the layers docs/architecture.md lists --------------------
ROOT = Path(__file__).resolve().parents[1]


def documented_layers() -> list[list[str]]:
    """The modules of each numbered layer of docs/architecture.md, top layer first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n(?=\d+\. \*\*)", section)
    return [
        re.findall(r"`(minipaged\.[\w.]+)`", item.split("\n\n")[0])
        for item in items
        if re.match(r"\d+\. \*\*", item)
    ]


def layer_of(module: str, layers: list[list[str]]) -> int:
    """The layer (0 = top) of the longest documented name that ``module`` is or is in."""
    matches = [
        (len(name), i)
        for i, names in enumerate(layers)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    assert matches, f"{module} is in no layer of docs/architecture.md"
    return max(matches)[1]


def outside_functions(node: ast.AST):
    """The nodes under ``node`` that run when its module is imported: not the bodies
    of functions and methods."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from outside_functions(child)


def package_imports(at_import: bool = False) -> dict[str, set[str]]:
    """Each module of the package -> the minipaged modules it imports (``at_import``:
    only those importing it loads, not those a function imports when it runs)."""
    imports = {}
    for path in sorted((ROOT / "minipaged").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        package = path.name == "__init__.py"
        module = ".".join(parts[:-1] if package else parts)
        found = set()
        tree = ast.parse(path.read_text())
        for node in outside_functions(tree) if at_import else ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = (module if package else module.rsplit(".", 1)[0]).split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                name = (
                    ".".join(base + [node.module] if node.module else base)
                    if node.level
                    else node.module
                )
                found.add(name)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        imports[module] = {name for name in found if name.split(".")[0] == "minipaged"}
    return imports


def test_the_layers_are_documented_top_down():
    layers = documented_layers()
    assert len(layers) == 10 and layers[0][0] == "minipaged.cli"
    assert layers[-1] == ["minipaged.core.memory", "minipaged.core.memory.workloads"]


def test_every_import_points_down_the_layers():
    layers = documented_layers()
    upward = []
    for module, imported in package_imports().items():
        if module in ("minipaged", "minipaged.distributed"):  # the packages' own faces
            continue
        for name in imported:
            if name != "minipaged" and layer_of(name, layers) < layer_of(module, layers):
                upward.append(f"{module} -> {name}")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(sorted(upward))


def test_the_checker_orders_layers():
    """An import of the engine from the memory layer would count as pointing up."""
    layers = documented_layers()
    assert layer_of("minipaged.engine.llm_engine", layers) < layer_of(
        "minipaged.core.memory.allocator", layers
    )
    assert layer_of("minipaged.bench.common", layers) < layer_of("minipaged.models.tiny", layers)


# -- the server reaches the engine through its client API only -------------------------
SERVING = ("minipaged.server", "minipaged.integrations")
# What serving may import of the layers below it: the client API (`EngineClient`, and
# the `LLMEngine` it is built over) and the plain data that crosses the layers.
CLIENT_API = {"minipaged.engine.protocol", "minipaged.engine.llm_engine"}
PLAIN_DATA = {
    "minipaged.config",
    "minipaged.sampling_params",
    "minipaged.pooling_params",
    "minipaged.outputs",
    "minipaged.lora_request",
    "minipaged.multimodal.inputs",
}


def test_the_server_imports_of_the_engine_only_its_client_api():
    wrong = [
        f"{module} -> {name}"
        for module, imported in package_imports().items()
        if module.startswith(SERVING)
        for name in imported
        if not name.startswith(SERVING) and name not in CLIENT_API | PLAIN_DATA
    ]
    assert not wrong, "the server importing past the client API:\n" + "\n".join(sorted(wrong))


def engine_internals() -> set[str]:
    """What `LLMEngine` keeps on itself that is not its API: the attributes its methods
    set, less its public methods and the last step's ``failed`` requests."""
    path = ROOT / "minipaged" / "engine" / "llm_engine.py"
    engine = next(
        node
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "LLMEngine"
    )
    public = {
        node.name
        for node in engine.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }
    assigned = {
        node.attr
        for node in ast.walk(engine)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    return assigned - public - {"failed"}


def last_name(node: ast.AST) -> str:
    """``engine`` of ``self.engine`` or of ``engine``; '' for anything else."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def engine_internals_reached(source: str, internals: set[str]) -> list[str]:
    """Each ``<...engine>.<name>`` in ``source`` reading an engine's part (``name`` in
    ``internals``), or an engine inside an engine (``engine.engine``)."""
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and "engine" in last_name(node.value)
        and (node.attr in internals or node.attr == "engine")
    ]


def test_the_server_never_reaches_into_an_engine():
    """The server holds an `EngineClient` and calls the `LLMEngine`'s public methods;
    its KV cache manager, scheduler, model, tokenizer and limits are the engine's own
    (the client's ``facts`` say what the server needs of them)."""
    internals = engine_internals()
    assert {"kv", "scheduler", "model", "tokenizer"} <= internals  # the finder finds
    reached = [
        f"{path.relative_to(ROOT)}: {chain}"
        for package in SERVING
        for path in sorted((ROOT / Path(*package.split("."))).rglob("*.py"))
        for chain in engine_internals_reached(path.read_text(), internals)
    ]
    assert not reached, "the server reaching into an engine:\n" + "\n".join(reached)


def test_the_internals_finder_finds_what_the_server_once_did():
    found = engine_internals_reached(
        "t = engine.engine.tokenizer\nn = self.engine.kv.num_gpu_blocks\n"
        "d = engine.model.config\nok = self.engine.facts.tokenizer\nself.tokenizer = t\n",
        {"kv", "model", "tokenizer"},
    )
    assert sorted(found) == [
        "engine.engine",
        "engine.engine.tokenizer",
        "engine.model",
        "self.engine.kv",
    ]


# -- one device never runs the multi-process code ------------------------------------
GROUP_OBJECT = "minipaged.distributed.parallel_state"  # the process group, SINGLE on one device
# Disaggregated prefill's KV connectors run beside one device's scheduler and runner.
KV_TRANSFER = "minipaged.distributed.kv_transfer"


def enters_multi_process_code(name: str) -> bool:
    """An import of ``minipaged.distributed`` past what one device runs."""
    return (
        name.startswith("minipaged.distributed")
        and name != GROUP_OBJECT
        and not (name == KV_TRANSFER or name.startswith(KV_TRANSFER + "."))
    )


# The models are built from distributed/'s parallel layers, which are plain layers on one
# device; everything else above them is the single-device path.
BUILT_FROM_PARALLEL_LAYERS = ("minipaged.distributed", "minipaged.models")


def single_device_modules(imports: dict[str, set[str]]) -> list[str]:
    return [m for m in imports if not m.startswith(BUILT_FROM_PARALLEL_LAYERS)]


def test_single_device_modules_import_only_the_group_object_from_distributed():
    imports = package_imports(at_import=True)
    entering = [
        f"{module} -> {name}"
        for module in single_device_modules(imports)
        for name in imports[module]
        if enters_multi_process_code(name)
    ]
    assert not entering, "single-device modules importing distributed/:\n" + "\n".join(entering)


def test_the_engine_enters_distributed_in_one_place():
    """`engine.start_workers` (tensor_parallel_size > 1, or ranks torchrun started) is
    the one function of the single-device path that imports the multi-process executor
    or the launcher's group."""
    at_import, every = package_imports(at_import=True), package_imports()
    lazy = sorted(
        f"{module} -> {name}"
        for module in single_device_modules(every)
        for name in every[module] - at_import[module]
        if enters_multi_process_code(name)
    )
    assert lazy == [
        "minipaged.engine.llm_engine -> minipaged.distributed.executor",
        "minipaged.engine.llm_engine -> minipaged.distributed.launcher",
    ]


def test_serving_on_one_device_loads_no_multi_process_code():
    code = (
        "import sys, minipaged.llm, minipaged.server.app; "
        "print(' '.join(m for m in sys.modules if m.startswith('minipaged.distributed')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(out.stdout.split()) <= {
        "minipaged.distributed",
        GROUP_OBJECT,
        "minipaged.distributed.layers",  # what the models are built from
    }


# -- the walk through one request ------------------------------------------------------
def test_the_request_walk_visits_each_file_once_and_counts_them():
    """docs/architecture.md follows one request file by file: no file named twice, each
    one real, and the number it states is the number it names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    walk = text.split("## One request, file by file", 1)[1].split("\n## ", 1)[0]
    files = re.findall(r"`([\w/]+\.(?:py|cpp|cu))`", walk)
    twice = sorted({f for f in files if files.count(f) > 1})
    assert not twice, f"visited twice: {twice}"
    missing = [
        f for f in files if not (ROOT / "minipaged" / f).exists() and not (ROOT / f).exists()
    ]
    assert not missing, f"no such files: {missing}"
    assert f"{len(files)} files, none visited twice" in " ".join(walk.split())
