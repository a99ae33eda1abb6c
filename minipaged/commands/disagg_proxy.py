"""``minipaged disagg-proxy --prefill URL --decode URL``: the proxy in front of a
prefill server and a decode server (`minipaged.server.disagg_proxy`)."""

from __future__ import annotations

NAME = "disagg-proxy"
HELP = "a proxy in front of a prefill server and a decode server (disaggregated prefill)"
DESCRIPTION = (
    "Serve /v1/completions and /v1/chat/completions by sending each request to the "
    "prefill server with max_tokens=1, then to the decode server, whose KV connector "
    "loads the prompt's KV (both started with --kv-transfer-config); the decode "
    "server's answer, streamed or not, is returned."
)


def add_arguments(parser) -> None:
    parser.add_argument("--prefill", required=True, metavar="URL", help="e.g. http://A:8100")
    parser.add_argument("--decode", required=True, metavar="URL", help="e.g. http://B:8200")
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")


def main(args) -> None:
    import uvicorn

    from minipaged.server.disagg_proxy import build_proxy_app

    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{name} must be a URL like http://HOST:PORT, got {url!r}")
    app = build_proxy_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
