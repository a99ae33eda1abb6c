"""The engine's core, as vLLM V1's ``v1/core``: the scheduler (`sched`) and the KV
cache manager with its block allocator, block tables and prefix cache (`memory`)."""
