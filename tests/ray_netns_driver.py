"""The driver of test_ray_two_nodes.py, run inside network namespace A (``ip netns exec``):
deploy two replicas of the tiny model on the two-node Ray cluster, send a burst through
the ingress, and print what happened as JSON on the last line of stdout."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray
from ray import serve

from minipaged.integrations.ray_serve import REPLICA_HEADER, build_openai_app

REPLICA = REPLICA_HEADER.decode()


def main(address: str, host: str, port: int, model_path: str, settings: dict) -> dict:
    ray.init(address=address, log_to_driver=False)
    deadline = time.monotonic() + 120  # node B's raylet registers with the head
    while len([n for n in ray.nodes() if n["Alive"]]) < 2:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_openai_app(model_path, **settings), name="minipaged")
    url = f"http://{host}:{port}"

    def one(i: int) -> dict:
        body = {
            "model": settings["served_model_name"],
            "prompt": [1 + i, 2, 3],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        return {"status": r.status_code, "replica": r.headers.get(REPLICA, ""), "text": text}

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(16)))
    # Which node each replica (its header) runs on, asked of its actor.
    replica_nodes = {}
    for named in ray.util.list_named_actors(all_namespaces=True):
        for replica in {a["replica"] for a in answers} - {""}:
            if replica in named["name"]:
                actor = ray.get_actor(named["name"], namespace=named["namespace"])
                replica_nodes[replica] = ray.get(
                    actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                )
    nodes = [
        {"id": n["NodeID"], "ip": n["NodeManagerAddress"], "resources": n["Resources"]}
        for n in ray.nodes()
        if n["Alive"]
    ]
    serve.shutdown()
    ray.shutdown()
    return {"answers": answers, "replica_nodes": replica_nodes, "nodes": nodes}


if __name__ == "__main__":
    address, host, port, model_path, settings = sys.argv[1:6]
    print(json.dumps(main(address, host, int(port), model_path, json.loads(settings))))
