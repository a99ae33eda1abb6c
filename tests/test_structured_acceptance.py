"""``minipaged bench structured-acceptance`` on a handful of its 50 schemas: each answer
through the official openai client (``response_format``) and LangChain
(``with_structured_output``, ``bind_tools`` with a named ``tool_choice``) parses and
validates (oracle: ``jsonschema``, applied here again to the answers the results file
records), and each regex's and choice's answer matches (``re.fullmatch``, the choice
list).  The full run on SmolLM2 is committed under benchmarks/results/cpu/.
"""

import json
import re

import pytest

pytest.importorskip("fastapi")  # the server extra
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("openai")
pytest.importorskip("langchain_openai")
pytest.importorskip("llguidance")

from cli_helpers import run_main  # noqa: E402
from minipaged.bench.structured_acceptance import (  # noqa: E402
    CLIENTS,
    backend_of,
    load_patterns,
    load_schemas,
    validation_error,
)
from minipaged.cli import build_parser  # noqa: E402
from server_helpers import MODEL, in_process_app  # noqa: E402

# Nested objects, an array of objects, an enum, optional fields, $defs: a field each.
NAMES = ["person", "book", "color", "todo_list", "user_refs"]  # in the file's order
FEATURES = {"nested", "array", "enum", "numbers", "optional", "$defs"}


def test_the_set_is_50_valid_schemas_covering_each_feature():
    entries = load_schemas()
    assert len(entries) == 50 and len({e["name"] for e in entries}) == 50
    for entry in entries:
        jsonschema.validators.validator_for(entry["schema"]).check_schema(entry["schema"])
    for feature in FEATURES:
        assert sum(feature in e["features"] for e in entries) >= 5, feature
    assert any("$defs" in e["schema"] for e in entries)
    with pytest.raises(ValueError, match="names"):
        load_schemas(["nosuchschema"])


def test_the_patterns_are_five_regexes_and_five_choices_each_matchable():
    patterns = load_patterns()
    regexes = [p for p in patterns if "regex" in p]
    choices = [p for p in patterns if "choice" in p]
    assert len(regexes) == len(choices) == 5 and len({p["name"] for p in patterns}) == 10
    for p in regexes:
        re.compile(p["regex"])
    assert all(len(set(p["choice"])) == len(p["choice"]) >= 2 for p in choices)


def test_validation_error_catches_a_wrong_answer():
    (person,) = load_schemas(["person"])
    assert validation_error({"name": "Ada", "age": 36}, person["schema"]) is None
    assert validation_error({"name": "Ada", "age": 200}, person["schema"]) is not None
    assert validation_error({"name": "Ada"}, person["schema"]) is not None
    assert validation_error(None, person["schema"]) is not None


def test_a_few_schemas_through_openai_and_langchain_all_validate(tiny, tmp_path):
    path, _ = tiny("llama")
    out = tmp_path / "acceptance.json"
    for url, _, _ in in_process_app(path, engine_kwargs=dict(max_model_len=1024)):
        argv = ["bench", "structured-acceptance", "--base-url", url, "--model", MODEL]
        argv += ["--schemas", *NAMES, "--max-tokens", "300", "--json", str(out)]
        assert run_main(argv) == 0
    results = json.loads(out.read_text())
    schemas = {e["name"]: e["schema"] for e in load_schemas(NAMES)}
    assert [r["name"] for r in results["results"]] == NAMES
    for row in results["results"]:
        for client in CLIENTS:
            assert row[f"{client}_valid"], (row["name"], client, row[f"{client}_problem"])
            jsonschema.validate(row[f"{client}_answer"], schemas[row["name"]])
    assert all(results[f"{c}_valid"] == len(NAMES) for c in CLIENTS)
    patterns = {p["name"]: p for p in load_patterns()}
    assert [r["name"] for r in results["patterns"]] == list(patterns)
    for row in results["patterns"]:
        pattern = patterns[row["name"]]
        if "regex" in pattern:
            assert re.fullmatch(pattern["regex"], row["answer"]), row
        else:
            assert row["answer"] in pattern["choice"], row
    assert (results["num_regex"], results["num_choice"]) == (5, 5)
    assert results["regex_valid"] == results["choice_valid"] == 5
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_backend_flag_is_for_the_server_the_bench_starts():
    """``--structured-outputs-config`` is checked as the server checks it, names the
    backend whose results are saved, and is refused with ``--base-url`` (a running
    server's backend is its own)."""
    bench = ["bench", "structured-acceptance"]
    assert backend_of(build_parser().parse_args(bench)) == "guidance"
    flag = ["--structured-outputs-config", '{"backend": "xgrammar"}']
    assert backend_of(build_parser().parse_args([*bench, *flag])) == "xgrammar"
    with pytest.raises(ValueError, match="--structured-outputs-config"):
        backend_of(build_parser().parse_args([*bench, *flag, "--base-url", "http://h"]))
    outlines = ["--structured-outputs-config", '{"backend": "outlines"}']
    with pytest.raises(ValueError, match="'outlines' is not supported"):
        backend_of(build_parser().parse_args([*bench, *outlines]))
