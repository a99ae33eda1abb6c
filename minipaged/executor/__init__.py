"""Executors, as vLLM's ``v1/executor``: where a scheduled step runs (one process
here; ``minipaged.distributed`` runs it over several ranks)."""
