"""The ``minipaged`` command line: subcommands run in-process and as a real process;
engine flags mirror `EngineConfig`, and ``generate`` prints what ``LLM`` returns."""

import ast
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from cli_helpers import run_main
from minipaged import BeamSearchParams, SamplingParams
from minipaged.arg_utils import engine_kwargs
from minipaged.cli import build_parser, main
from minipaged.config import EngineConfig
from minipaged.models import make_tiny_model

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def test_make_tiny_model_writes_the_same_checkpoint_as_the_api(tmp_path, capsys):
    assert (
        run_main(["make-tiny-model", str(tmp_path / "cli"), "--arch", "qwen2", "--seed", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert f"wrote a tiny qwen2 checkpoint (seed 3) to {tmp_path / 'cli'}" in out
    assert all(name in out for name in FILES)
    api = make_tiny_model(tmp_path / "api", arch="qwen2", seed=3)
    for name in FILES:
        assert (tmp_path / "cli" / name).read_bytes() == (api / name).read_bytes()


def test_make_tiny_model_as_a_process(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "minipaged.cli", "make-tiny-model", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == FILES
    assert '"LlamaForCausalLM"' in (tmp_path / "m" / "config.json").read_text()  # the default


@pytest.mark.parametrize(
    "argv, message",
    [
        (["make-tiny-model", "DIR", "--arch", "gpt2"], "argument --arch: invalid choice: 'gpt2'"),
        (["make-tiny-model", "DIR", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
        (
            ["make-tiny-model", "DIR", "--seed", "-1"],
            "minipaged make-tiny-model: error: seed must be a non-negative int, got -1",
        ),
        (["make-tiny-model", "FILE"], "minipaged make-tiny-model: error: [Errno 17] File exists"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_fail_with_a_clear_message(argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "FILE").touch()
    monkeypatch.chdir(tmp_path)
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "DIR").exists()


def test_every_bench_is_listed_with_its_help_and_has_its_own(capsys):
    import importlib

    from minipaged.cli import BENCHES

    assert run_main(["bench", "--help"]) == 0
    listing = capsys.readouterr().out
    for name in BENCHES:
        bench = importlib.import_module(f"minipaged.bench.{name}")
        words = [re.escape(word) for word in (bench.NAME, *bench.HELP.split()[:3])]
        assert re.search(r"^    " + r"\s+".join(words), listing, re.MULTILINE), bench.NAME
        assert run_main(["bench", bench.NAME, "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"usage: minipaged bench {bench.NAME} ")


def test_a_bench_that_needs_the_server_extra_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "httpx", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "minipaged.bench.serve", raising=False)
    assert run_main(["bench", "serve", "--help"]) == 2
    err = capsys.readouterr().err
    assert "minipaged bench serve: error: needs httpx" in err and "minipaged[server]" in err


# No benchmark module: the flags generate shares with them live in minipaged.arg_utils.
GENERATE_MODULES = ["minipaged.commands.generate"]


@pytest.mark.parametrize(
    "argv, imported",
    [
        (["--help"], []),
        (["bench", "--help"], []),
        (["generate", "--help"], GENERATE_MODULES),
        (["generate", "hi"], GENERATE_MODULES),
    ],
)
def test_a_command_imports_no_module_it_does_not_run(argv, imported):
    """Benchmarks load torch: `minipaged --help` and `minipaged generate` start without
    them, and without the other commands' modules."""
    code = (
        "import sys\nfrom minipaged.cli import build_parser\n"
        "try:\n    build_parser().parse_args(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or "
        "m.startswith(('minipaged.bench.', 'minipaged.commands.'))))"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(imported)


def test_demo_rejects_a_bad_request_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--num-requests", "-1"])
    assert exit_info.value.code == 2
    assert "num_requests" in capsys.readouterr().err


# -- generate and the engine flags ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny):
    from minipaged import LLM

    return LLM(
        str(tiny), device="cpu", block_size=8, num_gpu_blocks=64, enable_prefix_caching=True, seed=5
    )


ENGINE_ARGV = [
    "--device",
    "cpu",
    "--block-size",
    "8",
    "--num-gpu-blocks",
    "64",
    "--enable-prefix-caching",
    "--seed",
    "5",
]


def completions(out: str) -> dict[tuple[int, int], tuple[str, int]]:
    """``(prompt, index) -> (text, number of tokens)`` of every completion printed."""
    found, prompt = {}, None
    for line in out.splitlines():
        if match := re.match(r"prompt (\d+): ", line):
            prompt = int(match[1])
        elif match := re.match(r"  completion (\d+): (.*)  \[(\d+) tokens", line):
            found[prompt, int(match[1])] = ast.literal_eval(match[2]), int(match[3])
    return found


def test_engine_flags_default_to_engine_config():
    args = build_parser().parse_args(["generate", "--model", "M", "hi"])
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ("model", "trace")
    }
    assert engine_kwargs(args) == defaults


def test_engine_flags_reach_engine_config():
    args = build_parser().parse_args(
        [
            "generate",
            "--model",
            "M",
            "--dtype",
            "bfloat16",
            "--num-gpu-blocks",
            "7",
            "--gpu-memory-utilization",
            "0.5",
            "--swap-space",
            "0",
            "--preemption-mode",
            "swap",
            "--no-enable-prefix-caching",  # on by default, as in vLLM V1
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--max-model-len",
            "100",
            "--attention-backend",
            "triton",
            "--seed",
            "3",
            "hi",
        ]
    )
    config = EngineConfig(model="M", **engine_kwargs(args))
    assert (config.dtype, config.num_gpu_blocks, config.gpu_memory_utilization) == (
        "bfloat16",
        7,
        0.5,
    )
    assert (config.swap_space, config.preemption_mode, config.enable_prefix_caching) == (
        0,
        "swap",
        False,
    )
    assert EngineConfig(model="M").enable_prefix_caching
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (
        4,
        64,
        100,
    )
    assert (config.attention_backend, config.seed) == ("triton", 3)
    # The request's seed is a sampling flag of its own.
    assert args.sampling_seed is None


def test_generate_prints_what_llm_generate_returns(tiny, llm, capsys):
    prompts = ["Hello", "The capital of"]
    argv = [
        "generate",
        "--model",
        str(tiny),
        *ENGINE_ARGV,
        "--n",
        "3",
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--sampling-seed",
        "11",
        *prompts,
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, top_k=20, seed=11)
    expected = {
        (i, c.index): (c.text, len(c.token_ids))
        for i, o in enumerate(llm.generate(prompts, params, use_tqdm=False))
        for c in o.outputs
    }
    assert completions(out) == expected
    assert "prompt 1: 'The capital of'" in out
    assert "Memory: a KV pool of 64 blocks x 8 token slots on cpu" in out
    assert "now 64 of 64 blocks are free again" in out


def test_generate_greedy_with_stops_and_logprobs(tiny, llm, capsys):
    reference = llm.generate("abc", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[
        0
    ].outputs[0]
    stop = reference.text[2:4] or "x"
    argv = [
        "generate",
        "--model",
        str(tiny),
        *ENGINE_ARGV,
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--stop",
        stop,
        "--stop",
        "never",
        "--logprobs",
        "2",
        "abc",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    params = SamplingParams(temperature=0, max_tokens=8, stop=[stop, "never"], logprobs=2)
    c = llm.generate("abc", params, use_tqdm=False)[0].outputs[0]
    assert completions(out) == {(0, 0): (c.text, len(c.token_ids))}
    assert f"finish_reason={c.finish_reason}" in out
    assert out.count("logprobs[") == len(c.token_ids)


def test_generate_penalty_and_min_tokens_flags_reach_sampling_params(tiny, llm, capsys):
    argv = [
        "generate",
        "--model",
        str(tiny),
        *ENGINE_ARGV,
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--min-tokens",
        "3",
        "--repetition-penalty",
        "1.5",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "-0.5",
        "abc",
    ]
    assert main(argv) == 0
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        min_tokens=3,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
    )
    c = llm.generate("abc", params, use_tqdm=False)[0].outputs[0]
    assert completions(capsys.readouterr().out) == {(0, 0): (c.text, len(c.token_ids))}


def test_generate_beam_search_prints_llm_beam_search(tiny, llm, capsys):
    argv = [
        "generate",
        "--model",
        str(tiny),
        *ENGINE_ARGV,
        "--beam-width",
        "3",
        "--max-tokens",
        "5",
        "Hello",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    beams = llm.beam_search(["Hello"], BeamSearchParams(beam_width=3, max_tokens=5))[0]
    printed = [ast.literal_eval(m[1]) for m in re.finditer(r"beam \d+: (.*)  \[cum", out)]
    assert printed == [s.text for s in beams.sequences]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block-size", "0"], "minipaged generate: error: block_size must be an int >= 1, got 0"),
        (["--preemption-mode", "drop"], "argument --preemption-mode: invalid choice: 'drop'"),
        (["--num-gpu-blocks", "x"], "argument --num-gpu-blocks: invalid int value: 'x'"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
        (["--max-tokens", "0"], "max_tokens must be an int >= 1, got 0"),
        (["--n", "0"], "n must be an int >= 1, got 0"),
        (["--presence-penalty", "3"], "presence_penalty must be a number in [-2, 2], got 3.0"),
        (
            ["--min-tokens", "20"],
            "min_tokens must be an int in [0, 16] (at most max_tokens), got 20",
        ),
        (["--beam-width", "2", "--n", "2"], "beam_width=2 cannot be combined with --n"),
        (
            ["--beam-width", "2", "--sampling-seed", "1", "--stop", "x"],
            "cannot be combined with --sampling-seed, --stop",
        ),
        (["--dtype", "fp8"], "dtype must be 'auto', one of"),
        (["--max-model-len", "99999"], "max_model_len=99999 is more than the model's 1024"),
    ],
)
def test_generate_bad_flags_exit_2_naming_them(argv, message, tiny, capsys):
    assert run_main(["generate", "--model", str(tiny), *argv, "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_needs_a_prompt_and_its_model_is_smollm2_unless_told(tiny, capsys):
    assert run_main(["generate", "--model", str(tiny)]) == 2
    assert "the following arguments are required: PROMPT" in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "hi"]).model == "smollm2"


# -- one model convention (vLLM's): `serve MODEL`, `--model MODEL` elsewhere ------------
MODEL_COMMANDS = [
    ["generate", "hi"],
    ["bench", "throughput"],
    ["bench", "block-size"],
    ["bench", "preemption"],
    ["bench", "latency"],
]


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c))
@pytest.mark.parametrize(
    "model", ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "m.gguf", "some/dir"]
)
def test_every_command_takes_the_model_the_same_way(command, model):
    assert build_parser().parse_args([*command, "--model", model]).model == model
    assert build_parser().parse_args(["serve", model]).model == model


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """The hub, replaced by a writer of a tiny checkpoint; the cache, a temporary one.
    Returns the hub ids fetched."""
    from minipaged.models import hub

    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    fetched = []

    def from_hub(hub_id, staging):
        fetched.append(hub_id)
        make_tiny_model(staging)

    monkeypatch.setattr(hub, "_from_hub", from_hub)
    return fetched


def test_download_prints_where_the_checkpoint_is_and_its_files(fake_hub, tmp_path, capsys):
    assert run_main(["download"]) == 0
    where = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    out = capsys.readouterr().out
    assert out.startswith(f"smollm2 is in {where}:\n")
    for name in FILES:
        assert re.search(rf"^  {re.escape(name)} +[\d,]+ bytes$", out, re.MULTILINE), name
        size = f"{(where / name).stat().st_size:,}"
        assert f"{size} bytes" in out
    assert run_main(["download", "smollm2"]) == 0  # cached: fetched once
    assert run_main(["download", "org/other", "--dir", str(tmp_path / "mine")]) == 0
    assert f"org/other is in {tmp_path / 'mine'}:" in capsys.readouterr().out
    assert fake_hub == ["HuggingFaceTB/SmolLM2-135M-Instruct", "org/other"]


def test_generate_and_bench_resolve_a_name_through_the_cache(fake_hub, tmp_path, capsys):
    argv = ["--model", "org/tiny", "--device", "cpu", "--num-gpu-blocks", "16", "--swap-space", "0"]
    assert main(["generate", *argv, "--max-tokens", "3", "Hello"]) == 0
    assert "prompt 0: 'Hello'" in capsys.readouterr().out
    out = tmp_path / "latency.json"
    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                "org/tiny",
                "--device",
                "cpu",
                "--preset",
                "cpu",
                "--modes",
                "paged",
                "--rates",
                "8",
                "--num-requests",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert out.is_file()
    assert fake_hub == ["org/tiny"]  # fetched once, then found in the cache


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c))
def test_a_model_that_cannot_be_had_is_a_one_line_error(command, tmp_path, monkeypatch, capsys):
    from minipaged.models import hub

    def unreachable(name, *args):
        raise hub.ModelUnavailableError(f"model {name!r} is not cached; `minipaged download`")

    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "_fetch", unreachable)
    assert run_main([*command, "--model", "org/gone", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "'org/gone' is not cached" in err and "`minipaged download`" in err
    assert "Traceback" not in err
    assert run_main([*command, "--model", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "is not a directory, not a .gguf file and not a known name" in err
    assert "Traceback" not in err


def test_generate_reports_the_swap_pool_that_exists(tiny, capsys):
    argv = [
        "generate",
        "--model",
        str(tiny),
        "--device",
        "cpu",
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "64",
        "--max-tokens",
        "2",
        "hi",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # Two sequences of 64 tokens in blocks of 16: 8 blocks, whatever 1 and 4 GiB hold.
    assert "Memory: a KV pool of 8 blocks x 16 token slots on cpu" in out
    assert "Swap: a CPU pool of 8 blocks" in out
