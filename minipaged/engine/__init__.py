"""The engine, as vLLM V1's ``v1/engine``: the step loop (`llm_engine`), the input
and output processors and the detokenizer around it."""
