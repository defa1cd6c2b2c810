"""`nesa-node demo`: a whole swarm on this machine, one generation, and a check against one process; with `serve`, then
the OpenAI-compatible gateway and its dashboard over the same swarm until Ctrl-C."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from nesa_node.devtools.launcher import ProcessGroup, split_blocks
from nesa_node.errors import NoRouteError

TIMEOUT_S = 180.0  # for the whole swarm to come up (model load and throughput measurement included)


def _serve_gateway(group: ProcessGroup, model: str, peers: list[str], compression: str, port: int) -> None:
    """Run a gateway over the demo's swarm until Ctrl-C (or until the gateway itself stops)."""
    args = ["gateway", "--model", model, "--initial-peers", *peers, "--host", "127.0.0.1", "--port", str(port)]
    gateway, address_file = group.start("gateway", [*args, "--compression", compression])
    (url,) = group.wait_address(gateway, address_file, TIMEOUT_S)
    name = Path(model).resolve().name
    print(f"gateway {gateway.pid} at {url}", flush=True)
    print(f"  dashboard:  {url}/", flush=True)
    print(f"  OpenAI API: {url}/v1 (model {name!r}), for example:", flush=True)
    print(f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"import os\", \"max_tokens\": 16}}'", flush=True)  # fmt: skip
    print("Ctrl-C stops the gateway and the swarm", flush=True)
    try:
        while gateway.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return
    print(f"the gateway exited with status {gateway.returncode}; see {group.log_path(gateway)}", flush=True)


class _TokenClock:
    """A generation streamer that records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_demo(
    *,
    nodes: int = 3,
    model: str | None = None,
    prompt: str,
    max_new_tokens: int = 32,
    compression: str = "none",
    serve: bool = False,
    gateway_port: int = 8000,
) -> int:
    """Start a bootstrap peer and `nodes` node daemons, generate through them, compare with one process; with
    `serve`, then start a gateway on 127.0.0.1:`gateway_port` (0: any free port), print its address and keep the
    swarm up until Ctrl-C.

    Returns 0 when the swarm's tokens equal the single-process ones (with a lossy `compression` codec, when the
    generation completes: the agreement is printed, since quantized hidden states may change a later token).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nesa_node.client.model import DistributedModelForCausalLM
    from nesa_node.devtools.tiny_model import init_tiny_model
    from nesa_node.sharding.blocks import load_config

    with tempfile.TemporaryDirectory(prefix="nesa-demo-") as workdir, ProcessGroup(workdir) as group:
        if model is None:
            model = str(Path(workdir) / "tiny-llama")
            print(f"making a tiny random Llama in {model}", flush=True)
            init_tiny_model(model)
        num_blocks = load_config(model).num_hidden_layers
        spans = split_blocks(num_blocks, min(nodes, num_blocks))
        bootstrap, address_file = group.start("dht", ["dht"])
        peers = group.wait_address(bootstrap, address_file)
        print(f"bootstrap DHT peer {bootstrap.pid} at {peers[0]}", flush=True)
        launched = []
        for index, (start, end) in enumerate(spans):
            args = ["run", "--model", model, "--blocks", f"{start}:{end}", "--initial-peers", *peers]
            args += ["--announce-period", "2", "--throughput-cache", str(Path(workdir) / "throughput.json")]
            launched.append(group.start(f"node{index}", args))
        for (process, node_address), (start, end) in zip(launched, spans, strict=True):
            group.wait_address(process, node_address, TIMEOUT_S)
            print(f"node {process.pid} serves blocks {start}:{end}", flush=True)
        print(f"started pids: {' '.join(map(str, group.pids))}", flush=True)

        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with DistributedModelForCausalLM.from_pretrained(
            model, initial_peers=peers, compression=compression
        ) as swarm_model:
            deadline = time.monotonic() + TIMEOUT_S
            while True:  # every block announced?
                try:
                    chain = swarm_model.choose_chain(max_length=input_ids.shape[1] + max_new_tokens)
                    break
                except NoRouteError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            print(
                "chain: "
                + " -> ".join(f"{hop.peer_id[:12]}..[{hop.start_block}:{hop.end_block})" for hop in chain.hops)
            )
            clock = _TokenClock()
            started = time.perf_counter()
            output = swarm_model.generate(
                input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, streamer=clock
            )
        reference_model = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=False)
        with torch.inference_mode():
            reference = reference_model.generate(
                input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
            )
        new_tokens = output.shape[1] - input_ids.shape[1]
        ttft = clock.times[0] - started if clock.times else float("nan")
        decode_s = clock.times[-1] - clock.times[0] if len(clock.times) > 1 else float("nan")
        matches = torch.equal(output, reference)
        agree = int((output[0, input_ids.shape[1] :] == reference[0, input_ids.shape[1] :]).sum())
        print(f"text: {tokenizer.decode(output[0], skip_special_tokens=True)!r}")
        print(f"{new_tokens} new tokens, time to first token {ttft * 1000:.1f} ms, ", end="")
        print(f"decode {(len(clock.times) - 1) / decode_s:.1f} tokens/s")
        print(f"tokens equal the single-process reference: {'yes' if matches else 'NO'}", flush=True)
        if compression != "none":
            print(f"hidden states sent with {compression}: {agree} of {new_tokens} new tokens agree", flush=True)
        if serve:
            _serve_gateway(group, model, peers, compression, gateway_port)
    print("stopped every process the demo started", flush=True)
    return 0 if matches or compression != "none" else 1
