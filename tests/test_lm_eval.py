"""The real client: EleutherAI's lm-evaluation-harness scores SmolLM2 through
``minipaged serve`` exactly as it scores the same weights in process.

The ``lm_eval`` command runs its ``local-completions`` model (the one people point at
a vLLM server) against a ``minipaged serve`` this test starts, with its ``remote``
tokenizer (``/tokenizer_info``, ``/tokenize``, ``/detokenize``), on two tasks read from
local JSONL files (`tests/lm_eval_tasks/`): 50 multiple-choice questions, scored by
loglikelihood (completions with ``echo`` and ``logprobs``: the prompt's logprobs), and
20 short answers, generated greedily.  The oracle is lm-eval's own ``hf`` model, in
this process, on the same weights in fp32: equal accuracies, equal answers, and every
choice's loglikelihood within 1e-3.  Nothing reaches the network.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from server_helpers import subprocess_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["minipaged_mc", "minipaged_gen"]
INCLUDE = "tests/lm_eval_tasks"  # the tasks' data paths are relative to the repo root
BATCH_SIZE = 8
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network, a datasets cache of the test's own, and the repo root as the
    working directory (where the tasks' JSONL paths start)."""
    env = {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    return {**os.environ, **env}


def through_the_server(smollm2, out: Path, env: dict) -> tuple[dict, dict]:
    """``lm_eval --model local-completions`` against ``minipaged serve``: its results
    and its samples, by task."""
    flags = ["--device", "cpu", "--dtype", "float32", "--swap-space", "0.01"]
    for base_url in subprocess_server(smollm2, "smollm2", flags):
        model_args = (
            f"model=smollm2,base_url={base_url}/v1/completions,"
            "tokenizer_backend=remote,num_concurrent=1"
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "lm_eval",
                "--model",
                "local-completions",
                "--model_args",
                model_args,
                "--tasks",
                ",".join(TASKS),
                "--include_path",
                INCLUDE,
                "--batch_size",
                str(BATCH_SIZE),
                "--output_path",
                str(out),
                "--log_samples",
            ],
            cwd=ROOT,
            env=env,
            check=True,
            timeout=600,
        )
    (results,) = glob.glob(str(out / "*" / "results_*.json"))
    samples = {
        task: [json.loads(line) for line in open(path)]
        for task in TASKS
        for path in glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
    }
    return json.loads(Path(results).read_text())["results"], samples


def in_process_hf(smollm2) -> tuple[dict, dict]:
    """lm-eval's ``hf`` model on the same weights, in this process."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model="hf",
        model_args=f"pretrained={smollm2},dtype=float32",
        tasks=TASKS,
        task_manager=TaskManager(include_path=INCLUDE),
        batch_size=BATCH_SIZE,
        device="cpu",
        log_samples=True,
    )
    return out["results"], out["samples"]


def test_lm_eval_scores_the_server_as_it_scores_hf_in_process(smollm2, tmp_path, offline):
    served, served_samples = through_the_server(smollm2, tmp_path / "served", offline)
    hf, hf_samples = in_process_hf(smollm2)
    for task, metrics in [
        ("minipaged_mc", ["acc", "acc_norm"]),
        ("minipaged_gen", ["exact_match"]),
    ]:
        for metric in metrics:
            key = f"{metric},none"
            assert served[task][key] == hf[task][key], (task, metric)
    by_doc = {task: {s["doc_id"]: s for s in hf_samples[task]} for task in TASKS}
    assert len(served_samples["minipaged_mc"]) == len(by_doc["minipaged_mc"]) == 50
    for sample in served_samples["minipaged_mc"]:
        theirs = by_doc["minipaged_mc"][sample["doc_id"]]["filtered_resps"]
        for (ours, _), (hfs, _) in zip(sample["filtered_resps"], theirs, strict=True):
            assert float(ours) == pytest.approx(float(hfs), abs=1e-3), sample["doc_id"]
    assert len(served_samples["minipaged_gen"]) == 20
    for sample in served_samples["minipaged_gen"]:
        theirs = by_doc["minipaged_gen"][sample["doc_id"]]["filtered_resps"]
        assert sample["filtered_resps"] == theirs, sample["doc_id"]
