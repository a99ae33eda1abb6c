"""``make demo`` (``minipaged demo``): what paging buys, measured with minipaged's own memory layer.

1. Where KV memory goes when a ShareGPT-like load is served on a pool the size of
   OPT-13B's KV cache on an A100-40GB, paged vs contiguous reservation (§3, Fig. 2).
2. Blocks saved by sharing: parallel sampling with copy-on-write and a shared prompt
   prefix with prefix caching (§4.4).
"""

from __future__ import annotations

from .memory import KVCacheManager
from .memory.block_table import blocks_for
from .memory.simulate import SYSTEMS, simulate_memory
from .workloads import synthetic_requests

OPT13B_A100_SLOTS = 15_700  # the paper's §6 setting: about 12 GB of KV at 800 KB per token


def waste_report(num_requests: int = 300, seed: int = 0) -> str:
    requests = synthetic_requests("sharegpt", num_requests, seed=seed)
    lines = [f"KV memory while serving {num_requests} ShareGPT-like requests on "
             f"{OPT13B_A100_SLOTS} token slots (cf. paper Fig. 2)",
             f"{'system':<20}{'tokens':>8}{'reserved':>10}{'internal':>10}{'external':>10}"
             f"{'free':>8}{'batch':>8}"]
    for system in SYSTEMS:
        r = simulate_memory(requests, system, OPT13B_A100_SLOTS)
        lines.append(f"{system:<20}{r.token_share:>8.1%}{r.reserved_share:>10.1%}"
                     f"{r.internal_share:>10.1%}{r.external_share:>10.1%}{r.free_share:>8.1%}"
                     f"{r.max_batch:>8.1f}")
    return "\n".join(lines)


def sharing_report(block_size: int = 16) -> str:
    prompt, n, output_len = list(range(200)), 4, 40
    shared = KVCacheManager(1000, block_size)
    shared.allocate("s0", prompt)
    for i in range(1, n):
        shared.fork("s0", f"s{i}")
    separate = KVCacheManager(1000, block_size)
    for i in range(n):
        separate.allocate(f"s{i}", prompt)
    for step in range(output_len):
        for i in range(n):
            shared.append(f"s{i}", [1000 + 10 * step + i])
            separate.append(f"s{i}", [1000 + 10 * step + i])
    used_shared = shared.gpu.num_used_blocks
    used_separate = separate.gpu.num_used_blocks

    system_prompt = list(range(5000, 5160))
    cache = KVCacheManager(1000, block_size, enable_prefix_caching=True)
    for i in range(8):
        cache.allocate(f"r{i}", system_prompt + [i] * 20)
    return "\n".join([
        f"Parallel sampling, n={n}, {len(prompt)}-token prompt, {output_len} tokens each: "
        f"{used_shared} blocks with copy-on-write vs {used_separate} without "
        f"({1 - used_shared / used_separate:.0%} saved)",
        f"Prefix caching, 8 requests sharing a {len(system_prompt)}-token system prompt: "
        f"hit rate {cache.gpu.hit_rate:.0%}, {cache.gpu.num_used_blocks} blocks instead of "
        f"{8 * blocks_for(len(system_prompt) + 20, block_size)}",
    ])
