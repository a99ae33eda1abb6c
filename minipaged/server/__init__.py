"""The OpenAI-compatible server (lesson 10): ``minipaged serve DIR``.

- `async_engine` - the engine stepped by a thread of its own, outputs streamed to asyncio;
- `protocol` - OpenAI's request bodies and the `SamplingParams` they ask for;
- `app` - the FastAPI routes, server-sent events, errors in OpenAI's shape, `serve`;
- `metrics` - ``/metrics`` in Prometheus's format;
- `guard` - the checks before a body is read: host, API key, size, read time;
- `limits` - `ServerLimits`, what one request may ask for.

Needs the ``server`` extra (``pip install minipaged[server]``): FastAPI, uvicorn and
prometheus_client.
"""
