"""One side of test_disagg_p2p.py's two-host test, run inside a network namespace
(``ip netns exec``), each role with a JSON list of prompts (token-id lists):

- ``producer MODEL IP PROMPTS``: a prefill server (the app in this process, a
  ``kv_producer`` engine) listening on ``IP``; prints ``ready PORT`` and serves, its
  KV store too, until killed;
- ``proxy MODEL PRODUCER_IP PROMPTS PORT``: a decode server (a ``kv_consumer``) on
  loopback and `minipaged disagg-proxy`'s app in front of it and of the prefill server
  at ``PRODUCER_IP:PORT``; sends each prompt through the proxy and prints a JSON line:
  each answer's text and the tokens the decode engine loaded from the producer;
- ``consumer MODEL PRODUCER_IP PROMPTS``: an offline consumer that connects, prints
  ``connected``, waits for a line on stdin, then decodes the prompts greedily and
  prints a JSON line: each prompt's tokens and the tokens it loaded.
"""

import asyncio
import json
import sys

import httpx

from minipaged import SamplingParams
from minipaged.llm import LLM
from minipaged.server.disagg_proxy import build_proxy_app
from server_helpers import MODEL, in_process_app

KV_PORT, BLOCK_SIZE, MAX_TOKENS = 14579, 4, 6
SERVERS = []  # each server's generator, kept: closing it stops the server


def transfer(role: str, ip: str) -> dict:
    return {
        "kv_connector": "P2pTcpConnector",
        "kv_role": f"kv_{role}",
        "kv_ip": ip,
        "kv_port": KV_PORT,
    }


def server(model: str, role: str, ip: str, host: str = "127.0.0.1"):
    """The app over a ``role`` engine, on ``host``: its base URL and engine."""
    engine = dict(block_size=BLOCK_SIZE, kv_transfer_config=transfer(role, ip))
    SERVERS.append(in_process_app(model, engine_kwargs=engine, host=host))
    url, async_engine, _ = next(SERVERS[-1])
    return url, async_engine


def producer(model: str, ip: str, prompts: list) -> None:
    url, _ = server(model, "producer", ip, host=ip)
    print("ready", url.rsplit(":", 1)[1], flush=True)
    sys.stdin.read()  # serve until killed


def proxy(model: str, ip: str, prompts: list, port: str) -> None:
    decode_url, decode_engine = server(model, "consumer", ip)
    app = build_proxy_app(f"http://{ip}:{port}", decode_url)

    async def ask_all() -> list[str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            texts = []
            for prompt in prompts:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}
                response = await client.post("/v1/completions", json={**body, "temperature": 0})
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
            return texts

    texts = asyncio.run(ask_all())
    external = decode_engine.stats["num_external_computed_tokens"]
    print(json.dumps({"texts": texts, "external": external}), flush=True)


def consumer(model: str, ip: str, prompts: list) -> None:
    llm = LLM(
        model,
        device="cpu",
        block_size=BLOCK_SIZE,
        swap_space=0.01,
        kv_transfer_config=transfer("consumer", ip),
    )
    print("connected", flush=True)
    sys.stdin.readline()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"tokens": tokens, "external": llm.stats()["num_external_computed_tokens"]}))


if __name__ == "__main__":
    role, model, ip, prompts, *rest = sys.argv[1:]
    {"producer": producer, "proxy": proxy, "consumer": consumer}[role](
        model, ip, json.loads(prompts), *rest
    )
