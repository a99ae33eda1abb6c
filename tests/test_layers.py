"""Import arrows point down the layers of docs/architecture.md: the memory layer is standard library only."""

import subprocess
import sys


def modules_loaded_by(*names: str) -> set[str]:
    code = (f"import sys; {'; '.join(f'import {n}' for n in names)}; "
            "print('\\n'.join(sorted(m.split('.')[0] for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_memory_layer_needs_nothing_but_the_standard_library():
    loaded = modules_loaded_by("minipaged.memory", "minipaged.memory.simulate",
                               "minipaged.memory.contiguous", "minipaged.workloads")
    at_start_up = modules_loaded_by("sys")  # the interpreter's and the venv's own
    third_party = loaded - at_start_up - set(sys.stdlib_module_names) - {"minipaged"}
    assert third_party == set(), f"the memory layer pulled in {sorted(third_party)}"
