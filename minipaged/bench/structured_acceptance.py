"""``minipaged bench structured-acceptance``: do structured outputs hold, as applications
ask for them?  (The acceptance check of `minipaged.structured_output`; vLLM's
``benchmarks/benchmark_serving_structured_output.py`` counts the same "correct rate".)

A fixed set of 50 JSON schemas (``data/structured_schemas.json``: nested objects,
arrays, enums, numbers with bounds, optional fields, ``$defs``, a few ``anyOf``,
``const`` and ``pattern``) is sent to ``minipaged serve`` three ways, as applications
do:

- **openai**: the official client, ``response_format={"type": "json_schema", ...}``;
- **langchain_structured**: LangChain's ``ChatOpenAI.with_structured_output(...,
  method="json_schema")``;
- **langchain_tools**: ``ChatOpenAI.bind_tools([...], tool_choice=name)``, the schema as
  the function's parameters: the call's arguments come back as ``tool_calls``.

Each answer is parsed and validated with ``jsonschema`` (the oracle), and counted.  Five
regexes and five choices (the file's ``patterns``) go through the openai client too, as
vLLM's ``structured_outputs`` extra field; each answer must match its regex whole
(``re.fullmatch``) or be one of its choices.  It
is a count, not a timing: a busy machine changes nothing but how long the run takes.
The clients retry nothing, but a connection error is tried once more, and counted.
Without ``--base-url`` it starts ``minipaged serve MODEL --device cpu`` itself, with
``--structured-outputs-config`` passed through: ``'{"backend": "xgrammar"}'`` measures
the xgrammar backend, whose results are saved as ``structured-acceptance-xgrammar``.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from matplotlib.figure import Figure
from tqdm.auto import tqdm

from minipaged.arg_utils import json_object
from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column
from minipaged.config import StructuredOutputsConfig

NAME = "structured-acceptance"
HELP = "structured outputs' acceptance: 50 JSON schemas, regexes and choices, validated"
DESCRIPTION = (
    "Send 50 JSON schemas to minipaged serve through the official openai client "
    "(response_format json_schema) and LangChain (with_structured_output, bind_tools "
    "with a named tool_choice); parse and validate every answer with jsonschema, and "
    "count the valid ones; then five regexes and five choices through the openai client."
)
SCHEMAS_PATH = Path(__file__).with_name("data") / "structured_schemas.json"
CLIENTS = ("openai", "langchain_structured", "langchain_tools")
PATTERN_KINDS = ("regex", "choice")


def load_schemas(names: list[str] | None = None) -> list[dict]:
    """The fixed set's entries (``name``, ``features``, ``prompt``, ``schema``), all or
    those ``names`` name, in the file's order."""
    entries = json.loads(SCHEMAS_PATH.read_text())["schemas"]
    if names is None:
        return entries
    unknown = set(names) - {e["name"] for e in entries}
    if unknown:
        raise ValueError(f"names must be schemas of {SCHEMAS_PATH.name}, got {sorted(unknown)}")
    return [e for e in entries if e["name"] in names]


def load_patterns() -> list[dict]:
    """The fixed set's regexes and choices (``name``, ``prompt``, ``regex`` or ``choice``)."""
    return json.loads(SCHEMAS_PATH.read_text())["patterns"]


def validation_error(value, schema: dict) -> str | None:
    """What is wrong with ``value`` against ``schema`` (jsonschema, the schema's own
    draft), or None if it validates."""
    import jsonschema  # noqa: PLC0415 (the oracle: a test extra)

    error = jsonschema.validators.validator_for(schema)(schema).iter_errors(value)
    first = next(error, None)
    return None if first is None else first.message


def prompt(entry: dict) -> str:
    return f"{entry['prompt']} Answer in JSON."


def ask_openai(client, model: str, entry: dict, max_tokens: int) -> tuple[object, str | None]:
    """(the parsed answer, a problem) through the official client's ``response_format``."""
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt(entry)}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True},
        },
        temperature=0,
        max_tokens=max_tokens,
    )
    choice = response.choices[0]
    if choice.finish_reason != "stop":
        tail = (choice.message.content or "")[-60:]
        return None, f"finish_reason {choice.finish_reason}, ending {tail!r}"
    try:
        return json.loads(choice.message.content), None
    except json.JSONDecodeError as error:
        return None, f"not JSON: {error}"


def ask_pattern(client, model: str, entry: dict, max_tokens: int) -> dict:
    """A regex or choice through the official client (vLLM's ``structured_outputs``
    field): the answer, and whether it matches whole (``re.fullmatch``, or one of the
    choices exactly)."""
    kind = "regex" if "regex" in entry else "choice"
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": entry["prompt"]}],
        extra_body={"structured_outputs": {kind: entry[kind]}},
        temperature=0,
        max_tokens=max_tokens,
    )
    choice = response.choices[0]
    text = choice.message.content or ""
    if choice.finish_reason != "stop":
        problem = f"finish_reason {choice.finish_reason}"
    elif not (re.fullmatch(entry["regex"], text) if kind == "regex" else text in entry["choice"]):
        problem = f"{text!r} does not match"
    else:
        problem = None
    return {
        "name": entry["name"],
        "kind": kind,
        "answer": text,
        "valid": problem is None,
        "problem": problem,
    }


def ask_langchain_structured(chat, entry: dict) -> tuple[object, str | None]:
    """LangChain's ``with_structured_output`` (``response_format`` underneath)."""
    runnable = chat.with_structured_output(
        {"name": entry["name"], "schema": entry["schema"]}, method="json_schema", include_raw=True
    )
    result = runnable.invoke(prompt(entry))
    if result["parsing_error"] is not None:
        return None, f"parsing error: {result['parsing_error']}"
    return result["parsed"], None


def ask_langchain_tools(chat, entry: dict) -> tuple[object, str | None]:
    """LangChain's ``bind_tools`` with the schema as a function's parameters, that
    function named in ``tool_choice``."""
    tool = {"type": "function", "function": {"name": entry["name"], "parameters": entry["schema"]}}
    message = chat.bind_tools([tool], tool_choice=entry["name"]).invoke(prompt(entry))
    if message.invalid_tool_calls or len(message.tool_calls) != 1:
        return None, f"tool calls {message.tool_calls}, invalid {message.invalid_tool_calls}"
    (call,) = message.tool_calls
    if call["name"] != entry["name"]:
        return None, f"called {call['name']!r}"
    return call["args"], None


def check_one(clients: dict, model: str, entry: dict, max_tokens: int) -> dict:
    """One schema's row: for each client, whether its answer validates, and why not."""
    asks = {
        "openai": lambda: ask_openai(clients["openai"], model, entry, max_tokens),
        "langchain_structured": lambda: ask_langchain_structured(clients["chat"], entry),
        "langchain_tools": lambda: ask_langchain_tools(clients["chat"], entry),
    }
    import openai  # noqa: PLC0415

    row = {"name": entry["name"], "features": entry["features"], "connection_retries": 0}
    for name, ask in asks.items():
        for attempt in range(2):
            try:
                value, problem = ask()
            except openai.APIConnectionError as error:
                # A pooled connection closed by the server as the client reused it:
                # the race of a server whose keep-alive timeout is no longer than
                # httpx's 5 s (uvicorn's and vLLM's default; minipaged serve's now
                # outlasts it, see `uvicorn_config`): once more, and counted.
                value, problem = None, f"{type(error).__name__}: {error}"
                if attempt == 0:
                    row["connection_retries"] += 1
                    continue
            except Exception as error:  # noqa: BLE001 (a client's error is this answer's failure)
                value, problem = None, f"{type(error).__name__}: {error}"
            break
        problem = problem or validation_error(value, entry["schema"])
        row[f"{name}_valid"] = problem is None
        row[f"{name}_problem"] = problem
        row[f"{name}_answer"] = value
    return row


def run_acceptance(
    base_url: str,
    entries: list[dict],
    patterns: list[dict],
    max_tokens: int = 512,
    concurrency: int = 8,
) -> tuple[list[dict], list[dict]]:
    """Every schema through every client, then every pattern through the openai client,
    against the server at ``base_url``, ``concurrency`` requests at a time (the server
    batches them); a row per schema and per pattern, in order."""
    import httpx  # noqa: PLC0415 (the server extra)
    import openai  # noqa: PLC0415
    from langchain_openai import ChatOpenAI  # noqa: PLC0415

    model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    options = dict(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    clients = {
        "openai": openai.OpenAI(**options),
        "chat": ChatOpenAI(model=model, temperature=0, max_tokens=max_tokens, **options),
    }
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(check_one, clients, model, e, max_tokens) for e in entries]
        rows = [f.result() for f in tqdm(futures, desc="schemas", leave=False)]
        asks = [pool.submit(ask_pattern, clients["openai"], model, p, max_tokens) for p in patterns]
        return rows, [f.result() for f in tqdm(asks, desc="patterns", leave=False)]


def summary(rows: list[dict], pattern_rows: list[dict]) -> dict:
    """Valid answers per client, out of the schemas sent; matching ones per pattern kind."""
    counts = {
        "num_schemas": len(rows),
        **{f"{c}_valid": sum(r[f"{c}_valid"] for r in rows) for c in CLIENTS},
        "connection_retries": sum(r["connection_retries"] for r in rows),
    }
    for kind in PATTERN_KINDS:
        of_kind = [r for r in pattern_rows if r["kind"] == kind]
        counts |= {f"num_{kind}": len(of_kind), f"{kind}_valid": sum(r["valid"] for r in of_kind)}
    return counts


def format_table(rows: list[dict]) -> str:
    def mark(client):
        return lambda row: "ok" if row[f"{client}_valid"] else row[f"{client}_problem"][:40]

    columns = [Column("schema", "name")] + [Column(c, mark(c)) for c in CLIENTS]
    return common.format_table(rows, columns)


def plot_acceptance(rows: list[dict], pattern_rows: list[dict], title: str) -> Figure:
    """The share of valid answers per client (schemas) and per pattern kind."""
    fig = Figure(figsize=(7, 3.4), layout="constrained")
    ax = fig.subplots()
    counts = summary(rows, pattern_rows)
    labels = [*CLIENTS, *(f"openai {k}" for k in PATTERN_KINDS)]
    valid = [counts[f"{c}_valid"] for c in CLIENTS] + [counts[f"{k}_valid"] for k in PATTERN_KINDS]
    sent = [len(rows)] * len(CLIENTS) + [counts[f"num_{k}"] for k in PATTERN_KINDS]
    bars = ax.bar(labels, [v / max(n, 1) for v, n in zip(valid, sent)])
    ax.bar_label(bars, [f"{v} / {n}" for v, n in zip(valid, sent)], fontsize=8)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("answers that validate or match")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title, fontsize=9)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--base-url", help="a running server's URL (default: start minipaged serve on --model)"
    )
    parser.add_argument(
        "--model", default="smollm2", help="the model to serve (default: %(default)s)"
    )
    parser.add_argument("--schemas", nargs="+", help="only these schemas of the set, by name")
    parser.add_argument("--max-tokens", type=int, default=512, help="(default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument(
        "--structured-outputs-config",
        metavar="JSON",
        type=json_object,
        help='the server\'s flag, passed through: \'{"backend": "xgrammar"}\' saves the '
        f"results as {NAME}-xgrammar (default: the server's default backend)",
    )
    add_output_flags(parser, NAME)


def backend_of(args) -> str | None:
    """The backend the served engine uses (``StructuredOutputsConfig``'s check); None:
    a running server's (``--base-url``), which this command cannot see."""
    if args.base_url:
        if args.structured_outputs_config is not None:
            raise ValueError("--structured-outputs-config is for the server this command starts")
        return None
    return StructuredOutputsConfig.from_value(args.structured_outputs_config).resolved_backend


def main(args) -> None:
    import contextlib  # noqa: PLC0415

    from minipaged.bench.chaos import serve_process  # noqa: PLC0415
    from minipaged.models.hub import resolve_model  # noqa: PLC0415

    entries = load_schemas(args.schemas)
    backend, flags = backend_of(args), ["--device", "cpu"]
    if args.structured_outputs_config is not None:
        flags += ["--structured-outputs-config", json.dumps(args.structured_outputs_config)]
    if args.base_url:
        server = contextlib.nullcontext(args.base_url)
        model = args.model
    else:
        model = resolve_model(args.model)
        server = serve_process(model, flags)
    with server as base_url:
        rows, pattern_rows = run_acceptance(
            base_url, entries, load_patterns(), args.max_tokens, args.concurrency
        )
    print(format_table(rows))
    counts = summary(rows, pattern_rows)
    print(", ".join(f"{c}: {counts[f'{c}_valid']} / {len(rows)} valid" for c in CLIENTS))
    print(
        ", ".join(
            f"{k}: {counts[f'{k}_valid']} / {counts[f'num_{k}']} match" for k in PATTERN_KINDS
        )
    )
    name = getattr(model, "name", model)
    title = f"{name} served by minipaged: structured outputs" + (f" ({backend})" if backend else "")
    figure = plot_acceptance(rows, pattern_rows, title)
    results = NAME if backend in (None, "guidance") else f"{NAME}-{backend}"
    extra = dict(model=str(name), max_tokens=args.max_tokens, backend=backend, **counts)
    extra["patterns"] = pattern_rows
    write(args, results, "cpu", rows, figure, **extra)
