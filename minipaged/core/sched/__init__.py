"""The scheduler: what each step runs, and what it hands the workers (vLLM's
``v1/core/sched``)."""
