"""A proxy in front of a prefill server and a decode server (vLLM's disaggregated-serving
example, ``disagg_proxy_server.py``): each completion or chat request goes first to the
prefill instance with ``max_tokens=1`` (it computes the prompt's KV, which its KV
connector keeps), then, as it came, to the decode instance, whose connector loads that KV
instead of computing it; the decode instance's answer, streamed or whole, is the
proxy's.  An error from either instance is passed back as it came (OpenAI's shape).
"""

from __future__ import annotations

import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0


def build_proxy_app(prefill_url: str, decode_url: str) -> FastAPI:
    """The proxy's app over the two servers' base URLs (``http://HOST:PORT``)."""
    client = httpx.AsyncClient(timeout=TIMEOUT_S)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    app = FastAPI(title="minipaged disaggregated-prefill proxy", lifespan=lifespan)

    async def forward(request: Request) -> Response:
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        path = request.url.path
        prefill = {**body, "max_tokens": 1, "stream": False, "n": 1}
        prefill.pop("max_completion_tokens", None)
        prefill.pop("stream_options", None)
        first = await client.post(f"{prefill_url}{path}", json=prefill, headers=headers)
        if first.status_code != 200:
            return JSONResponse(first.json(), status_code=first.status_code)
        if not body.get("stream"):
            decoded = await client.post(f"{decode_url}{path}", json=body, headers=headers)
            return JSONResponse(decoded.json(), status_code=decoded.status_code)
        upstream = await client.send(
            client.build_request("POST", f"{decode_url}{path}", json=body, headers=headers),
            stream=True,
        )
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return JSONResponse(upstream.json(), status_code=upstream.status_code)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    for route in ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            if (await client.get(f"{url}/health")).status_code != 200:
                return JSONResponse({"error": f"{url} is not healthy"}, status_code=503)
        return Response(status_code=200)

    return app
