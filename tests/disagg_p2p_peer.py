"""One side of test_disagg_p2p.py's two-host test, run inside a network namespace
(``ip netns exec``): ``producer MODEL IP PROMPTS`` prefills the prompts (a JSON list of
token-id lists), prints ``ready`` and serves their KV until killed; ``consumer MODEL
PRODUCER_IP PROMPTS`` connects, prints ``connected``, waits for a line on stdin, then
decodes the prompts greedily and prints a JSON line: each prompt's tokens and the
tokens it loaded from the producer."""

import json
import sys

from minipaged import SamplingParams
from minipaged.llm import LLM

PORT, BLOCK_SIZE, MAX_TOKENS = 14579, 4, 6


def main(role: str, model: str, ip: str, prompts: str) -> None:
    llm = LLM(
        model,
        device="cpu",
        block_size=BLOCK_SIZE,
        swap_space=0.01,
        kv_transfer_config={
            "kv_connector": "P2pTcpConnector",
            "kv_role": f"kv_{role}",
            "kv_ip": ip,
            "kv_port": PORT,
        },
    )
    inputs = [{"prompt_token_ids": p} for p in json.loads(prompts)]
    if role == "producer":
        llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        print("ready", flush=True)
        sys.stdin.read()  # serve (the store's thread) until killed
        return
    print("connected", flush=True)
    sys.stdin.readline()
    outputs = llm.generate(
        inputs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"tokens": tokens, "external": llm.stats()["num_external_computed_tokens"]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
