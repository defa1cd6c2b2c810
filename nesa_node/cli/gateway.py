"""`nesa-node gateway`: its options, and the process that serves the OpenAI-compatible API and the dashboard over
one async swarm client (nesa_node/gateway/)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from nesa_node import event_loop
from nesa_node.cli.options import PARSERS, add_privacy_args, add_verify_arg, parse_port
from nesa_node.compression.names import CLIENT_CODECS, DEFAULT_CODEC


def add_parser(commands, add_peer_args) -> None:
    gateway = commands.add_parser(
        "gateway",
        help="serve the OpenAI API (/v1/completions, /v1/chat/completions) over the swarm",
        description="One process that is a client of the swarm (one P2P host, one session per request, at most "
        "--max-concurrency at once) and serves OpenAI's HTTP API: POST /v1/completions and /v1/chat/completions "
        "(streamed as server-sent events when asked), GET /v1/models and /health. The model folder gives the "
        "tokenizer, its chat template and the client's layers. SIGINT or SIGTERM stops it.",
    )
    add_peer_args(gateway)
    gateway.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on (default 127.0.0.1)")
    gateway.add_argument("--port", type=parse_port, default=8000, help="HTTP port (default 8000; 0: any free one)")
    gateway.add_argument(
        "--model-name", default=None, help="the name clients ask for in `model` (default: the folder's name)"
    )
    gateway.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template for /v1/chat/completions (default: the tokenizer's own; without either, chat "
        "requests get a 400 that names this option)",
    )
    gateway.add_argument(
        "--max-concurrency", type=PARSERS["positive_int"], default=64, help="requests generating at once (default 64)"
    )
    gateway.add_argument(
        "--max-requests-per-caller",
        type=PARSERS["positive_int"],
        default=None,
        metavar="N",
        help="requests one caller may have generating or waiting while the gateway holds --max-concurrency requests, "
        "429 beyond (a caller: an API key, or without --api-key-file a client address, so everyone behind one proxy "
        "is one caller; while slots are free a caller may use them past this; default: a quarter of "
        "--max-concurrency)",
    )
    gateway.add_argument(
        "--send-timeout",
        type=PARSERS["positive"],
        default=30.0,
        metavar="SECONDS",
        help="a streamed answer whose client takes nothing for this long is ended, and its slot freed (default 30)",
    )
    gateway.add_argument(
        "--max-connections",
        type=PARSERS["positive_int"],
        default=1024,
        metavar="N",
        help="open HTTP connections and requests in progress at once, all clients together; past them a new "
        "request gets a 503 at once (default 1024). Each request's body must also arrive whole within 30 s, and the "
        "gateway reads at most 64 of the largest bodies it takes at once (503 `server_busy` past that)",
    )
    gateway.add_argument(
        "--compression",
        choices=CLIENT_CODECS,
        default=DEFAULT_CODEC,
        help=f"hidden-state codec on every hop that accepts it (default {DEFAULT_CODEC})",
    )
    gateway.add_argument(
        "--adapter-dir",
        default=None,
        metavar="DIR",
        help="folder of PEFT LoRA adapter folders POST /v1/adapters/load may load (by path inside it); without it, "
        "loading is refused and requests name the adapters the nodes announce",
    )
    gateway.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="file of API keys, one per line: every /v1 request then needs `Authorization: Bearer KEY` (401 "
        "otherwise); /health, /metrics and the dashboard stay open. Without it /v1 is open to whoever reaches "
        "--host, and adapters are loaded and unloaded only from this machine (with --admin-key-file: only with an "
        "admin key, from anywhere)",
    )
    gateway.add_argument(
        "--admin-key-file",
        default=None,
        metavar="FILE",
        help="file of admin keys, one per line: POST /v1/adapters/load and /unload then take one of them, from any "
        "address (403 for a user's key; without a key, 401 where there are --api-key-file keys, else 403), and they "
        "serve as API keys for the rest of /v1 too. Without it, any --api-key-file key loads and unloads adapters",
    )
    gateway.add_argument(
        "--topology-period",
        type=PARSERS["positive"],
        default=5.0,
        metavar="SECONDS",
        help="seconds between the dashboard's topology snapshots (persistence diagrams and change detection; "
        "default 5)",
    )
    gateway.add_argument("--address-file", default=None, help="write the gateway's URL here once it serves")
    add_privacy_args(gateway)
    add_verify_arg(gateway)


def run_gateway(args) -> int:
    chat_template = None
    if args.chat_template:
        try:
            chat_template = Path(args.chat_template).read_text()
        except OSError as exc:
            raise ValueError(f"--chat-template {args.chat_template}: {exc.strerror or exc}") from None
    name = args.model_name or Path(args.model).resolve().name
    from nesa_node.gateway.auth import ApiKeys

    api_keys = ApiKeys.from_file(args.api_key_file) if args.api_key_file else None
    admin_keys = ApiKeys.from_file(args.admin_key_file, option="--admin-key-file") if args.admin_key_file else None
    event_loop.run(_serve(args, name, chat_template, api_keys, admin_keys))
    return 0


async def _serve(args, name: str, chat_template: str | None, api_keys, admin_keys) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from nesa_node.client.async_model import AsyncDistributedModel
    from nesa_node.gateway.app import Gateway, create_app
    from nesa_node.peer import check_port_free
    from nesa_node.sharding.blocks import load_config

    check_port_free(args.host, args.port, "--port")
    load_config(args.model)  # a wrong folder is a ModelLoadError, not the Hub's "repo id" error
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    model = await AsyncDistributedModel.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        compression=args.compression,
        private_edges=args.private_edges,
        boundary_noise=args.boundary_noise,
        verify=args.verify,
        canaries=args.canaries,
    )
    app = create_app(
        Gateway(
            model,
            tokenizer,
            model_name=name,
            chat_template=chat_template,
            max_concurrency=args.max_concurrency,
            max_requests_per_caller=args.max_requests_per_caller,
            send_timeout_s=args.send_timeout,
            topology_period_s=args.topology_period,
            adapter_dir=args.adapter_dir,
            api_keys=api_keys,
            admin_keys=admin_keys,
        )
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            lifespan="off",
            limit_concurrency=args.max_connections,
        )
    )
    server.capture_signals = contextlib.nullcontext  # this process's own handlers stop it (event_loop)
    serving: asyncio.Task | None = None

    async def start() -> None:
        nonlocal serving
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            if serving.done():
                serving.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {args.host}:{args.port} stopped at start")
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://{args.host}:{port}"
        access = f"{len(api_keys)} API key(s)" if api_keys else "no API key: open to whoever reaches it"
        access += f", {len(admin_keys)} admin key(s) for adapters" if admin_keys else ""
        print(f"gateway for {name} on {url} (OpenAI API under {url}/v1; {access})", flush=True)
        if args.address_file:
            await asyncio.to_thread(Path(args.address_file).write_text, url + "\n")

    async def stop() -> None:
        server.should_exit = True
        if serving is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, timeout=10)
        await model.close()

    await event_loop.serve_until_signal(start, stop, name="nesa-node gateway")
