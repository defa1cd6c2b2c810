"""The `nesa-node` command line: run a node, a bootstrap DHT peer, generate, fine-tune, inspect the swarm, make
models.

Logging handlers and environment variables are handled here only.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from nesa_node import event_loop, openmp_wait
from nesa_node.cli.failures import ArgumentParser, Terminated, raise_terminated, report
from nesa_node.cli.model_tools import add_train_tiny_parser, train_tiny, write_canaries
from nesa_node.cli.options import (
    PARSERS,
    add_config_options,
    add_privacy_args,
    add_verify_arg,
    config_from_args,
    parse_port,
)
from nesa_node.compression.names import CLIENT_CODECS, CODECS, DEFAULT_CODEC
from nesa_node.server.config import ComputeConfig, LimitsConfig, NetworkConfig, NodeConfig, RebalanceConfig

logger = logging.getLogger("nesa_node.cli")


def _parse_span(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"blocks must look like START:END, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"need 0 <= START < END, got {start}:{end}")
    return start, end


INITIAL_PEERS_HELP = (
    "multiaddrs of swarm peers, /ip4/HOST/tcp/PORT/p2p/PEER_ID: the bootstrap's or any running node's (each prints "
    "it as `listening on`); give several and any that answers is used"
)


_positive_int = PARSERS["positive_int"]


def _add_peer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help=INITIAL_PEERS_HELP)
    parser.add_argument("--model", required=True, help="Hugging Face model folder (config, tokenizer, safetensors)")
    parser.add_argument("--dht-prefix", default=None, help="model key on the DHT (default: the folder's name)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="nesa-node",
        description="Peer-to-peer swarm serving large language models split by transformer blocks.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv for debug); tracebacks with errors"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    tiny = model.add_parser("init-tiny", help="write a small random model and tokenizer (no downloads)")
    tiny.add_argument("path")
    tiny.add_argument("--arch", choices=["llama", "mistral", "qwen2"], default="llama")
    tiny.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    tiny.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    tiny.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2: grouped-query)")
    tiny.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 x hidden)")
    tiny.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    tiny.add_argument("--seed", type=int, default=0)
    add_train_tiny_parser(model)
    manifest = model.add_parser(
        "manifest",
        help="write a model's weights manifest (per-block weight hashes) for clients to check nodes against",
        description="Read every block's weights of a model folder and write their sha256 digests as a weights "
        "manifest. A client given it (from_pretrained(weights_manifest=...), or the file in its model folder under "
        "the default name) routes only to nodes whose announced weights are the manifest's for their blocks.",
    )
    manifest.add_argument("path", help="Hugging Face model folder")
    manifest.add_argument(
        "--out", default=None, metavar="FILE", help="where to write it (default: PATH/weights-manifest.json)"
    )
    canaries = model.add_parser(
        "canaries",
        help='write known-answer canaries (hidden states at every block boundary) for verify="canary:P"',
        description="Run every block of a model folder, one block in memory at a time, over token sequences that "
        "start as prompts do (windows of --text files, else random ids) and write the hidden states at each block "
        "boundary, with each block's rounding error in bfloat16 and float16: for any node's span an input and its "
        "known output. A "
        'client with verify="canary:P" sends them to the nodes of its chains as ordinary sessions and bans a node '
        "whose outputs differ. Keep the file away from nodes: one that holds it knows every canary by its input. "
        "The seed is random unless given, and is not written.",
    )
    canaries.add_argument("path", help="Hugging Face model folder")
    canaries.add_argument(
        "--out", default=None, metavar="FILE", help="where to write them (default: PATH/canaries.safetensors)"
    )
    canaries.add_argument(
        "--count", type=int, default=16, help="canaries, one sequence each (default 16; more repeat less often)"
    )
    canaries.add_argument("--tokens", type=int, default=32, help="tokens per canary (default 32)")
    canaries.add_argument(
        "--text",
        action="append",
        default=None,
        metavar="FILE",
        help="take each canary's tokens (after BOS) from a random place of these text files, like prompts (default: "
        "random token ids, which a node serving the first blocks can tell from prose); may be repeated",
    )
    canaries.add_argument("--seed", type=int, default=None, help="seed of the token choice (default: a random one)")
    canaries.add_argument(
        "--device", default="cpu", help="where the blocks run (default cpu; the states are kept in float32)"
    )

    run = commands.add_parser(
        "run",
        help="serve a span of blocks (the node daemon)",
        description="Serve blocks [START, END) of a Hugging Face model folder (only their weights are read) and "
        "announce them on the swarm's DHT. SIGINT or SIGTERM drains: the node announces draining, ends its "
        "sessions after their queued steps, announces offline and exits.",
    )
    run.add_argument("--model", default=None, help="Hugging Face model folder; only the span's weights are read")
    run.add_argument("--blocks", default=None, type=_parse_span, metavar="START:END", help="blocks [START, END)")
    run.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        metavar="N",
        help="CPU threads for compute (default: torch's choice, all cores; nodes on one machine can each keep "
        "all: a chain computes one node at a time and idle threads sleep after about 0.1 ms)",
    )
    for title, section in (
        ("network", NetworkConfig),
        ("limits (what one node takes on)", LimitsConfig),
        ("compute", ComputeConfig),
        ("rebalancing", RebalanceConfig),
    ):
        add_config_options(run.add_argument_group(title), section)
    from nesa_node.cli.graph import add_arguments as add_graph_arguments

    add_graph_arguments(run)

    dht = commands.add_parser(
        "dht",
        help="run a bootstrap DHT peer that serves no blocks",
        description="A DHT peer that serves no blocks: a stable first address for a swarm. Give it --identity and "
        "--port so that a restart keeps its address (peer id and port). It keeps the peers it knows in a peers file "
        "(next to the identity: boot.key -> boot.peers) and dials them when it starts again, and nodes dial their "
        "initial peers every announce period, so a restarted bootstrap knows the swarm again at once. Any running "
        "node's address works as --initial-peers as well. SIGINT or SIGTERM stops it.",
    )
    dht.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    dht.add_argument("--port", type=parse_port, default=0, help="TCP port to listen on (default 0: any free one)")
    dht.add_argument(
        "--announce-host",
        type=PARSERS["ip"],
        default=None,
        metavar="IP",
        help="the IP address other machines reach this peer at, when it is not --host's (0.0.0.0, NAT, a container): "
        "announced with --port (give it one: a restart must keep the address)",
    )
    dht.add_argument(
        "--identity",
        default=None,
        metavar="FILE",
        help="private key file that fixes the peer id (created owner-only if missing; default: a new id each run)",
    )
    dht.add_argument(
        "--initial-peers", nargs="*", default=[], metavar="MADDR", help="other bootstrap peers of the same swarm"
    )
    dht.add_argument("--address-file", default=None, help="write the peer's multiaddrs here once it listens")
    dht.add_argument(
        "--peers-file",
        default=None,
        metavar="FILE",
        help="where the known peers are kept across restarts (default: the --identity file with suffix .peers; "
        "none without --identity)",
    )
    dht.add_argument(
        "--dht-storage-mb",
        type=PARSERS["positive"],
        default=None,
        metavar="MB",
        help="most memory other peers together may fill in this peer's DHT storage, MiB, each sender 1/16 of it; "
        "the oldest records of the heaviest sender go first (default 64)",
    )

    from nesa_node.cli.gateway import add_parser as add_gateway_parser

    add_gateway_parser(commands, _add_peer_args)

    generate = commands.add_parser("generate", help="generate text through the swarm")
    _add_peer_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        help="tokens to generate (default: the model's generation config, else 20, as transformers)",
    )
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--mode", choices=["direct", "relay"], default="direct", help="chain routing mode")
    generate.add_argument(
        "--compression",
        choices=CLIENT_CODECS,
        default=DEFAULT_CODEC,
        help=f"hidden-state codec on every hop that accepts it; auto: per hop and message, lossless unless the 8-bit "
        f"codec saves time on that link (default {DEFAULT_CODEC})",
    )
    generate.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="dtype of the client's embeddings, final norm and LM head (default: the one the nodes announce)",
    )
    generate.add_argument(
        "--device", default="cpu", help="where the client's layers run: cpu, cuda, cuda:1 ... (default cpu)"
    )
    generate.add_argument(
        "--routing-params",
        default=None,
        metavar="FILE",
        help="eq. 18 exponents written by `nesa-node tune` (default: untuned, all 1)",
    )
    generate.add_argument(
        "--adapter",
        default=None,
        metavar="NAME|DIR",
        help="LoRA adapter to generate with: a name the nodes announce, or a PEFT adapter folder (sent to nodes "
        "that lack it, for this generation only)",
    )
    add_privacy_args(generate)
    add_verify_arg(generate)

    from nesa_node.cli.finetune import add_parser as add_finetune_parser

    add_finetune_parser(commands, _add_peer_args)

    from nesa_node.cli.tune import add_parser as add_tune_parser

    add_tune_parser(commands)

    from nesa_node.cli.audit import add_parser as add_audit_parser

    add_audit_parser(commands)

    from nesa_node.cli.privacy import add_parser as add_privacy_parser

    add_privacy_parser(commands)

    from nesa_node.cli.schema import add_parser as add_schema_parser

    add_schema_parser(commands, _add_peer_args)

    from nesa_node.cli.graph import add_graph_commands

    add_graph_commands(commands)

    status = commands.add_parser("status", help="table of nodes and block coverage")
    _add_peer_args(status)

    demo = commands.add_parser("demo", help="start a local swarm, generate, compare with one process, stop")
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--model", default=None, help="model folder (default: a tiny random Llama)")
    demo.add_argument("--prompt", default="Beautiful is better than ugly.")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=32)
    demo.add_argument(
        "--compression",
        choices=CODECS,
        default="none",
        help="hidden-state codec between nodes (default none, so the tokens must equal one process's exactly)",
    )
    demo.add_argument(
        "--serve",
        action="store_true",
        help="after the check, start the OpenAI-compatible gateway and its dashboard and keep the swarm up until "
        "Ctrl-C",
    )
    demo.add_argument(
        "--gateway-port",
        type=parse_port,
        default=8000,
        help="the gateway's port on 127.0.0.1 with --serve (0: any free)",
    )
    return parser


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING - 10 * min(verbosity, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if verbosity < 2:
        for noisy in ("hivemind", "transformers"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    if verbosity < 1:
        logging.getLogger("nesa_node.events").setLevel(logging.INFO)  # a node's moves are shown by default


async def _run_node(args) -> None:
    from nesa_node.server.node import Node

    config = NodeConfig(
        model_path=args.model,
        start_block=args.blocks[0],
        end_block=args.blocks[1],
        network=config_from_args(NetworkConfig, args),
        limits=config_from_args(LimitsConfig, args),
        compute=config_from_args(ComputeConfig, args),
        rebalance=config_from_args(RebalanceConfig, args),
    )
    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    print(f"loading blocks {config.start_block}:{config.end_block} of {config.model_path}", flush=True)
    node = await Node.create(config)

    async def start() -> None:
        await node.start()
        print(f"peer id {node.peer_id}", flush=True)
        report = node.span.quantization
        if report is not None:
            print(
                f"quantized {report.layers} linear layers to {report.mode}: weights {report.bytes_before / 2**20:.1f} "
                f"-> {report.bytes_after / 2**20:.1f} MiB",
                flush=True,
            )
        for addr in await node.visible_maddrs():
            print(f"listening on {addr}", flush=True)
        print(
            f"serving blocks {config.start_block}:{config.end_block}, "
            f"{node.throughput['inference_tps']:.1f} tokens/s inference, "
            f"{node.budget.tokens_left} cache tokens",
            flush=True,
        )

    await event_loop.serve_until_signal(start, node.shutdown, name="nesa-node run")


async def _run_dht(args) -> None:
    from nesa_node.bootstrap import BootstrapPeer
    from nesa_node.protocol.dht_storage import limits_of_mib, set_storage_limits

    if args.dht_storage_mb is not None:
        set_storage_limits(limits_of_mib(args.dht_storage_mb))
    peer = await BootstrapPeer.create(
        host=args.host,
        port=args.port,
        identity_path=args.identity,
        initial_peers=tuple(args.initial_peers),
        peers_file=args.peers_file,
        announce_host=args.announce_host,
    )

    async def start() -> None:
        answered = await peer.start()
        if peer.remembered or answered:
            print(f"{answered} of {len(peer.remembered)} remembered peers answered ({peer.peers_file})", flush=True)
        print(f"peer id {peer.peer_id}", flush=True)
        for addr in await peer.visible_maddrs():
            print(f"listening on {addr}", flush=True)
        if args.address_file:
            await peer.write_address_file(args.address_file)

    await event_loop.serve_until_signal(start, peer.shutdown, name="nesa-node dht")


def _generate(args) -> int:
    from transformers import AutoTokenizer

    from nesa_node.client.async_model import default_new_tokens
    from nesa_node.client.model import DistributedModelForCausalLM
    from nesa_node.sharding.blocks import load_config

    load_config(args.model)  # a wrong folder is a ModelLoadError, not the Hub's "repo id" error
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    with DistributedModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        mode=args.mode,
        compression=args.compression,
        routing_params=args.routing_params,
        dtype=args.dtype,
        device=args.device,
        adapter=args.adapter,
        private_edges=args.private_edges,
        boundary_noise=args.boundary_noise,
        verify=args.verify,
        canaries=args.canaries,
    ) as model:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        sampling = {"do_sample": True, "temperature": args.temperature} if args.sample else {"do_sample": False}
        # transformers' own default, said explicitly (it warns when the length comes from its defaults)
        max_new_tokens = args.max_new_tokens or default_new_tokens(model.generation_config, input_ids.shape[1])
        if max_new_tokens < 1:
            raise ValueError(f"the prompt has {input_ids.shape[1]} tokens, the model's max_length or more")
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, **sampling)
        print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


def _status(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from nesa_node.client.swarm import Swarm
    from nesa_node.protocol.dht import default_dht_prefix
    from nesa_node.routing.chain import ChainRequest, missing_blocks
    from nesa_node.sharding.blocks import load_config

    num_blocks = load_config(args.model).num_hidden_layers

    async def read_swarm():
        prefix = args.dht_prefix or default_dht_prefix(args.model)
        async with await Swarm.create(args.initial_peers, dht_prefix=prefix) as swarm:
            return await swarm.node_records(), await swarm.snapshot(num_blocks)

    records, snapshot = event_loop.run(read_swarm())
    table = Table(title=f"{len(records)} nodes, {num_blocks} blocks")
    for column in ("peer", "blocks", "state", "inference tok/s", "forward tok/s", "cache left", "load", "adapters"):
        table.add_column(column)
    for record in sorted(records, key=lambda record: (record.info.start_block, record.info.peer_id)):
        info = record.info
        table.add_row(
            info.peer_id,
            f"{info.start_block}:{info.end_block}",
            info.state.value,
            f"{info.inference_tps:.1f}",
            f"{info.forward_tps:.1f}",
            str(info.cache_tokens_left),
            f"cpu {info.load.cpu_percent:.0f}%, {info.load.sessions} sessions",
            " ".join(f"{adapter.name} ({adapter.adapter_id[:8]}, r{adapter.rank})" for adapter in info.adapters),
        )
    console = Console() if sys.stdout.isatty() else Console(width=200)  # pipes get whole peer ids
    console.print(table)
    missing = missing_blocks(snapshot, ChainRequest())
    if missing:
        console.print(f"missing blocks: {', '.join(map(str, missing))}")
        return 1
    console.print(f"all {num_blocks} blocks covered")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        from nesa_node.cli.graph import check_arguments

        check_arguments(parser, args)
    _configure_logging(args.verbose)
    # idle OpenMP threads spin about 0.1 ms, then sleep: a node waiting for its next step (or a client for its
    # nodes) leaves the cores to the others (nesa_node/openmp_wait.py); read when torch loads, so set before that
    openmp_wait.short_spin()
    previous = signal.signal(signal.SIGTERM, raise_terminated)  # commands serving until a signal have their own
    try:
        return _dispatch(args)
    except (Exception, KeyboardInterrupt, Terminated) as exc:
        return report(exc, verbose=args.verbose > 0)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _dispatch(args) -> int:
    from nesa_node.cli.preflight import check

    check(args)  # the mistakes that need no heavy import, told before any
    if args.command == "model" and args.model_command == "train-tiny":
        return train_tiny(args)
    if args.command == "model" and args.model_command == "manifest":
        from nesa_node.sharding.blocks import weights_manifest_of
        from nesa_node.sharding.weights_manifest import FILE_NAME

        manifest = weights_manifest_of(args.path)
        out = Path(args.out) if args.out else Path(args.path) / FILE_NAME
        manifest.write(out)
        print(f"wrote {out}: {manifest.num_blocks} blocks, whole model {manifest.span_hash(0, manifest.num_blocks)}")
        return 0
    if args.command == "model" and args.model_command == "canaries":
        return write_canaries(args)
    if args.command == "model":
        from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model

        spec = TinyModelSpec(
            arch=args.arch,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate or 2 * args.hidden,
            vocab=args.vocab,
            seed=args.seed,
        )
        print(f"wrote {init_tiny_model(args.path, spec)}")
        return 0
    if args.command == "run" and (args.graph_model or args.graph_plan):
        from nesa_node.cli.graph import run_graph_stage

        return run_graph_stage(args)
    if args.command == "run":
        event_loop.run(_run_node(args))
        return 0
    if args.command == "gateway":
        from nesa_node.cli.gateway import run_gateway

        return run_gateway(args)
    if args.command == "dht":
        event_loop.run(_run_dht(args))
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "status":
        return _status(args)
    if args.command == "graph":
        from nesa_node.cli.graph import run_graph_command

        return run_graph_command(args)
    if args.command == "finetune":
        from nesa_node.cli.finetune import run_finetune

        return run_finetune(args)
    if args.command == "audit":
        from nesa_node.cli.audit import run_audit

        return run_audit(args)
    if args.command == "tune":
        from nesa_node.cli.tune import check_args, run_tune

        check_args(args)
        return run_tune(args)
    if args.command == "schema":
        from nesa_node.cli.schema import run_schema

        return run_schema(args)
    if args.command == "privacy-check":
        from nesa_node.cli.privacy import run_privacy_check

        return run_privacy_check(args)
    if args.command == "demo":
        from nesa_node.devtools.demo import run_demo

        return run_demo(
            nodes=args.nodes,
            model=args.model,
            prompt=args.prompt,
            max_new_tokens=args.max_new_tokens,
            compression=args.compression,
            serve=args.serve,
            gateway_port=args.gateway_port,
        )
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse allows only the commands above
