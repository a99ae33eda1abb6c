"""Disaggregated prefill over the network: `P2pTcpConnector`.  A producer engine runs
each prompt with ``max_tokens=1`` and keeps its KV; a consumer engine on another host
pulls it over TCP into its own blocks and decodes.

The oracles: Hugging Face transformers on the same checkpoint (the consumer's greedy
output), arithmetic on the prompts for how many tokens load (whole blocks, never a
prompt's last token), and the consumer computing everything itself when the producer is
gone.  The first test runs both engines in this process over loopback; the last puts
them on two hosts, network namespaces joined by a veth pair (`netns`), the proxy
on the decode host reaching the prefill server across the link.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.config import EngineConfig
from minipaged.core.memory.block_table import blocks_for
from minipaged.distributed.kv_transfer.kv_connector.v1.base import KVTransferError
from minipaged.distributed.parallel_state import free_port

BLOCK_SIZE = 4
MAX_TOKENS = 6
PROMPTS = [random_prompt(n, seed) for seed, n in enumerate([3, 30, 17, 9])]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PREFILL = SamplingParams(temperature=0, max_tokens=1)
POOL = 4 * sum(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS)
PEER = Path(__file__).with_name("disagg_p2p_peer.py")


def transfer(role: str, ip: str, port: int, **extra) -> dict:
    return {
        "kv_connector": "P2pTcpConnector",
        "kv_role": role,
        "kv_ip": ip,
        "kv_port": port,
        "kv_connector_extra_config": extra,
    }


def loadable(prompt: list[int]) -> int:
    """The tokens a consumer loads: whole blocks, never the last token."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def wire_bytes(model, num_blocks: int) -> int:
    """What ``num_blocks`` blocks of every layer weigh on the wire, from the
    checkpoint's config.json alone: keys and values, each ``block_size x KV heads x
    head_dim`` elements of its dtype."""
    config = json.loads((Path(model[0]) / "config.json").read_text())
    itemsize = torch.finfo(getattr(torch, config["torch_dtype"])).bits // 8
    per_block = 2 * BLOCK_SIZE * config["num_key_value_heads"] * config["head_dim"] * itemsize
    return config["num_hidden_layers"] * num_blocks * per_block


def consumer_of(model, port: int, **extra):
    return make_llm(
        model[0],
        block_size=BLOCK_SIZE,
        num_gpu_blocks=POOL,
        kv_transfer_config=transfer("kv_consumer", "127.0.0.1", port, **extra),
    )


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def producer(model):
    """A producer that prefilled PROMPTS, listening on a free loopback port."""
    port = free_port()
    llm = make_llm(
        model[0],
        block_size=BLOCK_SIZE,
        num_gpu_blocks=POOL,
        kv_transfer_config=transfer("kv_producer", "127.0.0.1", port),
    )
    llm.generate(as_inputs(PROMPTS), PREFILL, use_tqdm=False)
    assert_all_blocks_free(llm)
    return port


def test_a_consumer_pulls_the_prompts_kv_and_decodes_as_hf(model, producer):
    consumer = consumer_of(model, producer)
    outputs = consumer.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS, model[1], MAX_TOKENS)
    stats = consumer.stats()
    assert stats["num_external_computed_tokens"] == sum(map(loadable, PROMPTS))
    # The bytes that crossed are the loaded blocks' K and V, nothing more.
    num_blocks = sum(map(loadable, PROMPTS)) // BLOCK_SIZE
    assert stats["kv_connector_bytes_received"] == wire_bytes(model, num_blocks)
    assert stats["num_computed_prompt_tokens"] == sum(len(p) - loadable(p) for p in PROMPTS)
    assert_all_blocks_free(consumer)
    # /metrics carries both counts.
    pytest.importorskip("prometheus_client")
    from minipaged.server.metrics import make_registry

    registry = make_registry(SimpleNamespace(stats=stats))
    for name, key in (
        ("external_computed_tokens", "num_external_computed_tokens"),
        ("computed_prompt_tokens", "num_computed_prompt_tokens"),
    ):
        assert registry.get_sample_value(f"minipaged:{name}_total") == stats[key]
    consumer.shutdown()


def test_a_consumer_holding_a_prefix_asks_only_for_the_blocks_it_lacks(model, producer):
    """LOCAL (not on the producer) shares PROMPTS[1]'s first three blocks: computed
    first, it leaves them in the consumer's prefix cache, and PROMPTS[1] then pulls
    only its blocks 3..6 (7 loadable), those blocks' bytes exactly; its tokens HF's."""
    local = PROMPTS[1][:12] + random_prompt(5, 77)
    consumer = consumer_of(model, producer)
    consumer.generate(as_inputs([local]), GREEDY, use_tqdm=False)
    before = consumer.stats()
    outputs = consumer.generate(as_inputs(PROMPTS[1:2]), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS[1:2], model[1], MAX_TOKENS)
    after = consumer.stats()
    lacking = loadable(PROMPTS[1]) // BLOCK_SIZE - 3
    assert after["num_external_computed_tokens"] - before["num_external_computed_tokens"] == (
        lacking * BLOCK_SIZE
    )
    received = after["kv_connector_bytes_received"] - before["kv_connector_bytes_received"]
    assert received == wire_bytes(model, lacking) < wire_bytes(model, lacking + 3)
    assert_all_blocks_free(consumer)
    consumer.shutdown()


def test_an_int8_cache_pulls_its_scales_with_its_blocks(model):
    """int8's per-slot scales cross the wire after the keys and values (one float32
    per token and KV head each): the consumer's tokens are those of an int8 engine
    that computed the prompts, and its bytes those of the loaded blocks."""
    port, runs = free_port(), []
    for role in (None, "kv_producer", "kv_consumer"):
        llm = make_llm(
            model[0],
            block_size=BLOCK_SIZE,
            num_gpu_blocks=POOL,
            kv_cache_dtype="int8",
            kv_transfer_config=role and transfer(role, "127.0.0.1", port),
        )
        outputs = llm.generate(
            as_inputs(PROMPTS), PREFILL if role == "kv_producer" else GREEDY, use_tqdm=False
        )
        runs.append([o.outputs[0].token_ids for o in outputs])
        stats = llm.stats()
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert runs[2] == runs[0]
    config = json.loads((Path(model[0]) / "config.json").read_text())
    heads, num_blocks = config["num_key_value_heads"], sum(map(loadable, PROMPTS)) // BLOCK_SIZE
    per_block = 2 * BLOCK_SIZE * heads * (config["head_dim"] * 1 + 4)  # int8 values, fp32 scale
    assert (
        stats["kv_connector_bytes_received"] == config["num_hidden_layers"] * num_blocks * per_block
    )


class GatedConn:
    """A consumer worker's connection to the producer whose messages are logged as the
    connector takes them, and whose ``hold``-th message is held back until ``gate`` is
    set (``fail``: it raises instead, as a connection the producer dropped)."""

    def __init__(self, conn, log: list, hold: int, gate, fail: bool = False) -> None:
        self.conn, self.log, self.hold, self.gate, self.fail = conn, log, hold, gate, fail
        self.taken = 0

    def send_bytes(self, data) -> None:
        self.conn.send_bytes(data)

    def recv_bytes(self) -> bytes:
        if self.taken == self.hold:
            if self.fail:
                raise EOFError("the producer hung up")
            self.gate.wait(30)  # a bound, so a connector that never waits cannot hang
        data = self.conn.recv_bytes()
        self.log.append(("received", self.taken))
        self.taken += 1
        return data

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.gate.set()
        self.conn.close()


def gate_the_worker(consumer, hold: int, fail: bool = False):
    """Route the consumer's worker-side loads through a `GatedConn`; the log, which
    also records each layer's `wait_for_layer_load` returning, and the gate."""
    worker = consumer.engine.runner.kv_connector
    log, gate = [], threading.Event()
    connect, wait = worker._connect, worker.wait_for_layer_load
    worker._connect = lambda timeout: GatedConn(connect(timeout), log, hold, gate, fail)

    def logged_wait(layer):
        wait(layer)
        if worker._layer_loaded:  # a step with loads
            log.append(("waited", layer))
            gate.set()  # the first layer to return lets the held message through

    worker.wait_for_layer_load = logged_wait
    return log


def test_layer_zero_computes_while_the_last_layer_is_still_on_the_wire(model, producer):
    """The last layer's message (the header, then one per layer) is held back until a
    layer's wait has returned: loading layer by layer, layer 0's wait returns first
    and the forward pass runs it while the last layer arrives; a connector that loaded
    every layer before the pass would take the last message first.  The tokens are HF's."""
    consumer = consumer_of(model, producer)
    layers = consumer.engine.runner.kv_layer_names
    log = gate_the_worker(consumer, hold=len(layers))
    outputs = consumer.generate(as_inputs(PROMPTS[1:2]), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS[1:2], model[1], MAX_TOKENS)
    assert log.index(("waited", layers[0])) < log.index(("received", len(layers)))
    assert log.index(("received", len(layers))) < log.index(("waited", layers[-1]))
    assert_all_blocks_free(consumer)
    consumer.shutdown()


@pytest.mark.parametrize(
    "hold, fail, message",
    [(2, True, "failed .*the producer hung up"), (1, False, "did not send layer")],
)
def test_a_layer_lost_or_late_fails_only_its_request_naming_the_producer(
    model, producer, hold, fail, message
):
    """The producer hangs up after layer 0 (mid-transfer), or layer 0 never comes: the
    request that was loading fails alone, naming the producer, while one computed in
    the same steps decodes as HF; no block stays held, and none of the lost blocks is
    served from the prefix cache: asked again over a sound link, the prompt's tokens
    are HF's."""
    # The late layer's wait gives up after 0.5 s; the lost one never waits that long.
    consumer = consumer_of(model, producer, load_timeout_s=30 if fail else 0.5)
    engine, worker = consumer.engine, consumer.engine.runner.kv_connector
    gate_the_worker(consumer, hold=hold, fail=fail)
    computed = random_prompt(11, 78)  # not on the producer
    engine.add_request("computed", computed, GREEDY)
    engine.add_request("pulled", PROMPTS[1], GREEDY)
    finished, failed = {}, {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step(fail_alone=True))
        failed.update(engine.failed)
    assert list(failed) == ["pulled"] and list(finished) == ["computed"]
    assert isinstance(failed["pulled"], KVTransferError)
    assert re.search(f"producer at 127.0.0.1:{producer}.*{message}", str(failed["pulled"]))
    assert_greedy_matches_hf([finished["computed"]], [computed], model[1], MAX_TOKENS)
    assert_all_blocks_free(consumer)
    del worker._connect  # a sound link again, and time to spare on a busy machine
    worker.load_timeout_s = 30
    again = consumer.generate(as_inputs(PROMPTS[1:2]), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(again, PROMPTS[1:2], model[1], MAX_TOKENS)
    consumer.shutdown()


def test_a_producer_with_another_cache_is_refused_naming_the_field(model, producer):
    with pytest.raises(ValueError, match="block_size=4; this engine has block_size=8"):
        make_llm(
            model[0],
            block_size=8,
            kv_transfer_config=transfer("kv_consumer", "127.0.0.1", producer),
        )


def test_no_producer_is_refused_at_start_up(model):
    config = transfer("kv_consumer", "127.0.0.1", free_port(), connect_timeout_s=0.3)
    with pytest.raises(ValueError, match="no KV producer answered at 127.0.0.1"):
        make_llm(model[0], block_size=BLOCK_SIZE, kv_transfer_config=config)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_role="kv_both"), "takes kv_producer or kv_consumer"),
        (dict(kv_buffer_size=0), "'kv_buffer_size' must be a number > 0"),
        (dict(kv_connector_extra_config={"connect_timeout_s": -1}), "'connect_timeout_s'"),
        (dict(kv_connector_extra_config={"shared_storage_path": "x"}), "not supported by"),
    ],
)
def test_bad_settings_are_refused_naming_them(model, change, message):
    with pytest.raises(ValueError, match=message):
        make_llm(model[0], kv_transfer_config={**transfer("kv_producer", "127.0.0.1", 1), **change})


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_pipeline_parallelism_on_either_side_is_refused_naming_the_option(role):
    """A pipeline stage holds only some layers; the connector moves whole ones."""
    config = transfer(role, "127.0.0.1", 1)
    with pytest.raises(ValueError, match="cannot run with pipeline_parallel_size=2"):
        EngineConfig(model="m", pipeline_parallel_size=2, kv_transfer_config=config)


def test_a_proxy_sends_the_prefill_to_one_server_and_streams_the_decode_from_the_other(model):
    """``minipaged disagg-proxy`` over a producer server and a consumer server: the
    answer, whole and streamed, is a single engine's greedy text, whose tokens are HF's;
    the consumer loaded every prompt's whole blocks from the producer."""
    pytest.importorskip("fastapi")
    import asyncio

    import httpx

    from minipaged.server.disagg_proxy import build_proxy_app
    from server_helpers import MODEL, in_process_app

    port = free_port()
    engine = dict(block_size=BLOCK_SIZE, num_gpu_blocks=POOL, enable_prefix_caching=False)
    producer = in_process_app(
        model[0],
        engine_kwargs={**engine, "kv_transfer_config": transfer("kv_producer", "127.0.0.1", port)},
    )
    prefill_url, _, _ = next(producer)
    consumer = in_process_app(
        model[0],
        engine_kwargs={**engine, "kv_transfer_config": transfer("kv_consumer", "127.0.0.1", port)},
    )
    decode_url, decode_engine, _ = next(consumer)

    async def ask(prompt, stream):
        app = build_proxy_app(prefill_url, decode_url)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            if not stream:
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["text"]
            text = ""
            async with client.stream(
                "POST", "/v1/completions", json={**body, "stream": True}
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

    try:
        whole = asyncio.run(ask(PROMPTS[1], stream=False))
        streamed = asyncio.run(ask(PROMPTS[2], stream=True))
        loaded = decode_engine.stats["num_external_computed_tokens"]
    finally:
        for server in (consumer, producer):
            server.close()
    single = make_llm(model[0], block_size=BLOCK_SIZE).generate(
        as_inputs(PROMPTS[1:3]), GREEDY, use_tqdm=False
    )
    assert_greedy_matches_hf(single, PROMPTS[1:3], model[1], MAX_TOKENS)
    assert [whole, streamed] == [o.outputs[0].text for o in single]
    assert loaded == loadable(PROMPTS[1]) + loadable(PROMPTS[2])


@pytest.mark.netns
def test_across_two_hosts_through_the_proxy_then_with_the_producer_gone(model):
    """A prefill server on host A; on host B a decode server with the proxy in front of
    both: each answer is a single engine's greedy text (its tokens HF's), the prompts'
    KV loaded over the veth link.  A is killed after an offline consumer on B connects,
    and that one computes every prompt itself, its tokens HF's."""
    from netns import two_hosts

    with two_hosts("kvp2p", "10.77.3.1", "10.77.3.2") as (a, b):
        producer = start(a, "producer", model, a.address)
        try:
            ready, port = producer.stdout.readline().split()
            assert ready == "ready"
            proxied = start(b, "proxy", model, a.address, port)
            out, _ = proxied.communicate(timeout=120)
            assert proxied.returncode == 0
            first = json.loads(out.strip().splitlines()[-1])
            second = start(b, "consumer", model, a.address)
            assert second.stdout.readline().strip() == "connected"
        finally:
            producer.kill()
            producer.wait()
        second = decode(second, connected=True)
    single = make_llm(model[0], block_size=BLOCK_SIZE).generate(
        as_inputs(PROMPTS), GREEDY, use_tqdm=False
    )
    assert_greedy_matches_hf(single, PROMPTS, model[1], MAX_TOKENS)
    assert first["texts"] == [o.outputs[0].text for o in single]
    assert first["external"] == sum(map(loadable, PROMPTS))
    assert second["external"] == 0
    assert second["tokens"] == [model[1].greedy(p, MAX_TOKENS)[0] for p in PROMPTS]


def start(host, role: str, model, ip: str, *rest: str) -> subprocess.Popen:
    command = [sys.executable, str(PEER), role, str(model[0]), ip, json.dumps(PROMPTS), *rest]
    return subprocess.Popen(
        host.exec(*command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def decode(consumer: subprocess.Popen, connected: bool = False) -> dict:
    """Let a consumer decode; its JSON line."""
    if not connected:
        assert consumer.stdout.readline().strip() == "connected"
    out, _ = consumer.communicate("go\n", timeout=120)
    assert consumer.returncode == 0
    return json.loads(out.strip().splitlines()[-1])
