"""The ``minipaged`` command line: subcommands run in-process and as a real process."""

import os
import subprocess
import sys

import pytest

from minipaged.cli import main
from minipaged.models import make_tiny_model

FILES = ["config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json"]


def run_main(argv):
    """``main(argv)``'s exit status, whether it returns or exits the way argparse does."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def test_make_tiny_model_writes_the_same_checkpoint_as_the_api(tmp_path, capsys):
    assert run_main(["make-tiny-model", str(tmp_path / "cli"), "--arch", "qwen2",
                     "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert f"wrote a tiny qwen2 checkpoint (seed 3) to {tmp_path / 'cli'}" in out
    assert all(name in out for name in FILES)
    api = make_tiny_model(tmp_path / "api", arch="qwen2", seed=3)
    for name in FILES:
        assert (tmp_path / "cli" / name).read_bytes() == (api / name).read_bytes()


def test_make_tiny_model_as_a_process(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "minipaged.cli", "make-tiny-model",
                           str(tmp_path / "m")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == FILES
    assert '"LlamaForCausalLM"' in (tmp_path / "m" / "config.json").read_text()  # the default


@pytest.mark.parametrize("argv, message", [
    (["make-tiny-model", "DIR", "--arch", "gpt2"], "argument --arch: invalid choice: 'gpt2'"),
    (["make-tiny-model", "DIR", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["make-tiny-model", "DIR", "--seed", "-1"],
     "minipaged make-tiny-model: error: seed must be a non-negative int, got -1"),
    (["make-tiny-model", "FILE"], "minipaged make-tiny-model: error: [Errno 17] File exists"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_arguments_fail_with_a_clear_message(argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "FILE").touch()
    monkeypatch.chdir(tmp_path)
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "DIR").exists()


def test_demo_reports_paged_and_contiguous_waste(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for system in ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"):
        assert system in rows
    token_share = {s: float(rows[s][1].rstrip("%")) for s in rows if s.startswith(("paged", "contiguous"))}
    assert token_share["paged"] > max(v for s, v in token_share.items() if s != "paged")
    assert "copy-on-write" in out and "Prefix caching" in out


def test_demo_rejects_a_bad_request_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--num-requests", "-1"])
    assert exit_info.value.code == 2
    assert "num_requests" in capsys.readouterr().err
