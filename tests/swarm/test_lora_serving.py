"""LoRA adapters served by the swarm (Nesa sec. 2.4): three nodes on the trained tiny model preload three random
adapters of different ranks and targets; greedy tokens through the swarm with an adapter equal one process's
`PeftModel.from_pretrained(base, adapter)`, also for two clients with different adapters at once on the same nodes
(their decode steps may share a node's pass), and a session without an adapter still gets the base model's."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import openai
import pytest
import torch
from hivemind.p2p import P2P
from transformers import AutoTokenizer

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.adapter_lookup import own_adapter_of_folder
from nesa_node.client.async_model import AsyncDistributedModel, adapter_id_of_folder
from nesa_node.client.session_chain import OwnAdapter
from nesa_node.errors import AdapterBudgetError, AdapterHashError, AdapterMissingError, NoRouteError
from nesa_node.gateway.app import Gateway
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import frame, read
from nesa_node.protocol.framing import open_stream
from nesa_node.protocol.messages import ADAPTER_ANSWERS, TO_SESSION, AdapterRequest, ErrorReply
from nesa_node.server.adapter_fetch import MAX_ANSWERS_PER_PEER
from nesa_node.sharding.blocks import load_config
from nesa_node.sharding.lora import load_adapter_slice
from tests.support.adapters import peft_generate, save_random_adapter
from tests.support.gateway import Served
from tests.support.swarm import wait_for_chain, wait_until

pytest.importorskip("peft")

PREFIX = "lora"
SPANS = [(0, 2), (2, 3), (3, 4)]
ADAPTERS = {
    "all-r16": dict(r=16, lora_alpha=32, target_modules="all-linear"),
    "attention-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp-r8-some": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "down_proj"], layers_to_transform=[0, 3]),
}
PROMPTS = 10
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(trained_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(save_random_adapter(trained_model, root / name, seed, **lora))
        for seed, (name, lora) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def lora_swarm(module_swarm, trained_model, adapters):
    nodes = [
        module_swarm.start_node(
            trained_model, start, end, dht_prefix=PREFIX, adapters=tuple(adapters.values()), metrics_port=0
        )
        for start, end in SPANS
    ]
    yield module_swarm
    for node in nodes:
        module_swarm.stop_node(node)


def connect(swarm, path: str, **settings) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix=PREFIX, compression="none", **settings
    )


def async_client(swarm, path: str, prefix: str) -> AsyncDistributedModel:
    """A client that gives up an open at its first refusal (the refusals are what these tests look at)."""
    return swarm.run(
        AsyncDistributedModel.from_pretrained(
            path, initial_peers=swarm.initial_peers, dht_prefix=prefix, compression="none", max_open_attempts=1
        )
    )


def own_adapters(path: str, root, seed: int, count: int) -> tuple[list, int]:
    """`count` random rank-4 adapters on every linear layer, saved under `root`, and the bytes of one's slice of
    all blocks."""
    folders = [
        save_random_adapter(path, root / f"{index}", seed + index, r=4, target_modules="all-linear")
        for index in range(count)
    ]
    return folders, load_adapter_slice(str(folders[0]), load_config(path), 0, 4).nbytes


def prompts(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (1, 4 + index % 5), generator=generator) for index in range(count)]


def test_nodes_announce_their_slices_of_each_adapter(lora_swarm, trained_model, adapters):
    config = load_config(trained_model)
    ids = {name: adapter_id_of_folder(folder, config) for name, folder in adapters.items()}
    for node in lora_swarm.nodes[-len(SPANS) :]:
        announced = {info.name: info for info in node.current_info().adapters}
        assert set(announced) == set(adapters)
        for name, info in announced.items():
            assert info.adapter_id == ids[name]
            assert info.rank == ADAPTERS[name]["r"]
    slices = {info.slice_sha256 for node in lora_swarm.nodes[-len(SPANS) :] for info in node.current_info().adapters}
    assert len(slices) == len(SPANS) * len(ADAPTERS)  # each node's slice of each adapter is bytes of its own


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_tokens_with_an_adapter_equal_peft_model(lora_swarm, trained_model, adapters, name):
    with connect(lora_swarm, trained_model, adapter=name) as model:  # by the name the nodes announce
        wait_for_chain(model, hops=len(SPANS), max_length=32)
        for input_ids in prompts(PROMPTS):
            output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            reference = peft_generate(trained_model, adapters[name], input_ids, NEW_TOKENS)
            assert torch.equal(output, reference), (name, input_ids)


def test_two_clients_with_two_adapters_at_once_each_get_their_own(lora_swarm, trained_model, adapters):
    names = ["all-r16", "attention-r4"]
    inputs = prompts(4)
    references = {name: [peft_generate(trained_model, adapters[name], ids, 24) for ids in inputs] for name in names}
    base = [peft_generate(trained_model, None, ids, 24) for ids in inputs]
    assert all(not torch.equal(a, b) for a, b in zip(references[names[0]], base, strict=True))  # adapters matter
    outputs: dict[str, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(names))

    def client(name: str) -> None:
        try:
            with connect(lora_swarm, trained_model, adapter=adapters[name]) as model:  # by folder this time
                wait_for_chain(model, hops=len(SPANS), max_length=32)
                barrier.wait(timeout=60)
                outputs[name] = [
                    model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False) for ids in inputs
                ]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for name in names:
        for output, reference in zip(outputs[name], references[name], strict=True):
            assert torch.equal(output, reference), name
    with connect(lora_swarm, trained_model) as model:  # no adapter: the base model's tokens on the same nodes
        for ids, reference in zip(inputs, base, strict=True):
            assert torch.equal(model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False), reference)


def test_an_adapter_no_node_holds_is_refused_with_its_name(lora_swarm, trained_model, tmp_path):
    with connect(lora_swarm, trained_model) as model:
        wait_until(lambda: model.call(model.swarm.node_records()) != [], timeout_s=30)
        with pytest.raises(AdapterMissingError, match="no node announces it"):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, adapter="no-such-adapter")
        other = save_random_adapter(trained_model, tmp_path / "other", 99, r=2, target_modules=["q_proj"])
        with pytest.raises(NoRouteError, match="without adapter"):  # known by id only: the client cannot send it
            model.generate(
                torch.tensor([[5, 6, 7]]),
                max_new_tokens=2,
                adapter=adapter_id_of_folder(str(other), load_config(trained_model)),
            )


def resident(swarm, adapter_id: str) -> list[bool]:
    return [adapter_id in node.adapters.store for node in swarm.nodes[-len(SPANS) :]]


def test_an_adapter_no_node_holds_is_sent_by_the_client_and_gone_after(lora_swarm, trained_model, tmp_path):
    """The client names a folder no node has: it sends each node of the chain its blocks before the open (in
    parallel, one stream per node), the tokens equal PeftModel's, the nodes never announce it, and each drops it
    when the session closes."""
    folder = save_random_adapter(
        trained_model, tmp_path / "private", 7, r=8, lora_alpha=16, target_modules="all-linear"
    )
    adapter_id = adapter_id_of_folder(str(folder), load_config(trained_model))
    input_ids = prompts(1)[0]
    reference = peft_generate(trained_model, folder, input_ids, NEW_TOKENS)
    with connect(lora_swarm, trained_model, adapter=str(folder)) as model:
        wait_for_chain(model, hops=len(SPANS), max_length=32)
        with model.inference_session(max_length=32) as session:
            assert resident(lora_swarm, adapter_id) == [True] * len(SPANS)
            assert not any(adapter_id in {info.adapter_id for info in node.current_info().adapters}
                           for node in lora_swarm.nodes)  # fmt: skip
            output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            assert len(session.chain.hops) == len(SPANS)
        assert torch.equal(output, reference)
        wait_until(lambda: resident(lora_swarm, adapter_id) == [False] * len(SPANS), timeout_s=10)


def test_a_changed_byte_in_the_clients_adapter_is_refused_by_hash(lora_swarm, trained_model, tmp_path):
    folder = save_random_adapter(trained_model, tmp_path / "tampered", 8, r=4, target_modules=["q_proj", "o_proj"])
    with connect(lora_swarm, trained_model, adapter=str(folder)) as model:
        own = next(iter(model.client.own_adapters.values()))
        blobs = list(own.blobs)
        blobs[2] = blobs[2][:-9] + bytes([blobs[2][-9] ^ 1]) + blobs[2][-8:]  # one bit of block 2's bytes
        model.client.own_adapters[own.adapter_id] = OwnAdapter(own.manifest, tuple(blobs))
        with pytest.raises(AdapterHashError):
            model.generate(prompts(1)[0], max_new_tokens=2)
    # nodes whose blocks were intact took the adapter for the open and release it when the refused chain closes
    wait_until(lambda: resident(lora_swarm, own.adapter_id) == [False] * len(SPANS), timeout_s=10)


@pytest.fixture(scope="module")
def lora_gateway(lora_swarm, trained_model, tmp_path_factory):
    """A gateway over the LoRA swarm that may load adapters from its own adapter folder (`adapter_dir`)."""
    adapter_dir = tmp_path_factory.mktemp("gateway-adapters")
    model = lora_swarm.run(
        AsyncDistributedModel.from_pretrained(
            trained_model, initial_peers=lora_swarm.initial_peers, dht_prefix=PREFIX, compression="none"
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    served = Served(lora_swarm, Gateway(model, tokenizer, model_name="trained", adapter_dir=str(adapter_dir)))
    try:
        yield served, adapter_dir, tokenizer
    finally:
        served.close()
        lora_swarm.run(model.close())


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_gateway_serves_announced_and_loaded_adapters(lora_gateway, trained_model, adapters, lora_swarm):
    served, adapter_dir, tokenizer = lora_gateway
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) == {"trained", *(f"trained:{name}" for name in ADAPTERS)}
    assert all(getattr(listed[f"trained:{name}"], "parent", None) == "trained" for name in ADAPTERS)
    prompt = "import os and sys"
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    def reference(folder) -> str:
        output = peft_generate(trained_model, folder, ids, NEW_TOKENS)
        return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def complete(model: str) -> str:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert answer.model == model
        return answer.choices[0].text

    for model in ("trained:all-r16", "mlp-r8-some"):  # base:adapter, or the adapter's name alone
        assert complete(model) == reference(adapters[model.split(":")[-1]])
    assert complete("trained") == reference(None)

    save_random_adapter(
        trained_model, adapter_dir / "mine", 21, r=4, lora_alpha=8, target_modules=["v_proj", "up_proj"]
    )
    status, loaded = post(served.url + "/v1/adapters/load", {"name": "mine", "path": "mine"})
    assert status == 200 and loaded["parent"] == "trained", loaded
    assert "trained:mine" in {model.id for model in client.models.list().data}
    assert complete("trained:mine") == reference(adapter_dir / "mine")  # sent to the nodes, none holds it
    metrics = urllib.request.urlopen(served.url + "/metrics", timeout=10).read().decode()
    assert "nesa_gateway_adapters_loaded 1.0" in metrics
    assert 'nesa_gateway_adapter_requests{adapter="mine",state="running"} 0.0' in metrics
    assert 'nesa_gateway_adapter_requests{adapter="swarm",state="running"} 0.0' in metrics
    node_metrics = urllib.request.urlopen(lora_swarm.nodes[-1].metrics_url, timeout=10).read().decode()
    assert 'nesa_node_adapters{state="resident"} 3.0' in node_metrics  # the one sent is gone with its session

    assert post(served.url + "/v1/adapters/unload", {"name": "mine"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        complete("trained:mine")
    assert post(served.url + "/v1/adapters/unload", {"name": "mine"})[0] == 404
    status, refused = post(served.url + "/v1/adapters/load", {"name": "escape", "path": "../../etc"})
    assert status == 403 and "outside" in refused["error"]["message"], refused
    status, refused = post(served.url + "/v1/adapters/load", {"name": "bad:name", "path": "mine"})
    assert status == 400, refused


def test_a_node_lacking_an_announced_adapter_fetches_it_from_peers(lora_swarm, trained_model, adapters, monkeypatch):
    """A fourth node on blocks 2:3 without adapters; the client names an adapter by name and cannot use the node
    that preloaded it for 2:3 (banned here): the new node fetches its blocks from that peer, checked by hash, the
    tokens equal PeftModel's, and it announces the adapter from then on. A peer that serves changed bytes is
    refused: nothing is stored."""
    holder = next(node for node in lora_swarm.nodes[-len(SPANS) :] if (node.start_block, node.end_block) == (2, 3))
    fresh = lora_swarm.start_node(trained_model, 2, 3, dht_prefix=PREFIX)
    try:
        name = "attention-r4"
        adapter_id = adapter_id_of_folder(adapters[name], load_config(trained_model))
        input_ids = prompts(1)[0]
        reference = peft_generate(trained_model, adapters[name], input_ids, NEW_TOKENS)
        with connect(lora_swarm, trained_model, adapter=name) as model:
            wait_for_chain(model, hops=len(SPANS), max_length=32)
            model.swarm.ban(holder.peer_id)
            with model.inference_session(max_length=32) as session:
                assert fresh.peer_id in session.chain.peer_ids
                output = model.generate(
                    input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
                )
        assert torch.equal(output, reference)
        assert adapter_id in {info.adapter_id for info in fresh.current_info().adapters}

        corrupt = lora_swarm.start_node(trained_model, 2, 3, dht_prefix=PREFIX)
        try:
            import nesa_node.server.adapter_fetch as adapter_fetch

            serve = adapter_fetch.slice_blobs
            monkeypatch.setattr(
                adapter_fetch, "slice_blobs", lambda piece: [b[:-1] + bytes([b[-1] ^ 1]) for b in serve(piece)]
            )
            other = adapter_id_of_folder(adapters["all-r16"], load_config(trained_model))
            with pytest.raises(AdapterMissingError, match="corrupted or tampered, refused"):
                lora_swarm.run(corrupt.adapters.hold_or_fetch(other, (2, 3)))
            assert other not in corrupt.adapters.store
        finally:
            lora_swarm.stop_node(corrupt)
    finally:
        lora_swarm.stop_node(fresh)


def test_idle_sessions_holding_adapters_make_room_and_a_peer_holds_at_most_its_share(
    lora_swarm, trained_model, tmp_path
):
    """A node with room for two and a half adapters: two throwaway identities open idle sessions with adapters of
    their own; an honest client's third adapter is admitted by preempting them (as for the KV cache), and its
    tokens equal PeftModel's. One peer's sessions may hold at most its share (half) of the adapter budget, and an
    adapter over it is refused before it could preempt anyone."""
    folders, size = own_adapters(trained_model, tmp_path / "own", 50, 4)
    node = lora_swarm.start_node(
        trained_model, 0, 4, dht_prefix="lora-room", adapter_budget_mb=2.5 * size / 2**20, preempt_idle_s=1.0
    )

    def client():
        return async_client(lora_swarm, trained_model, "lora-room")

    throwaways, honest = [client(), client()], client()
    try:
        idle = [lora_swarm.run(model.open_session(max_length=8, adapter=str(folders[index])))
                for index, model in enumerate(throwaways)]  # fmt: skip
        assert node.adapters.store.pinned == 2
        prompt = torch.tensor([[5, 6, 7, 8]])
        output = lora_swarm.run(honest.generate(prompt, max_new_tokens=6, adapter=str(folders[2])))
        assert torch.equal(output, peft_generate(trained_model, folders[2], prompt, 6))
        assert node.adapters.store.pinned == 1 and len(node.sessions) == 1  # one idle session preempted: enough

        first = lora_swarm.run(honest.open_session(max_length=8, adapter=str(folders[0])))
        try:
            with pytest.raises(AdapterBudgetError, match="over its share"):
                lora_swarm.run(honest.open_session(max_length=8, adapter=str(folders[1])))
            # an adapter the node lacks, over the peer's share: refused before it goes into the store, where making
            # room for it would preempt the other peer's idle session
            sessions, resident = len(node.sessions), node.adapters.store.resident
            assert sessions == 2 and resident == 2 and node.adapters.store.used_bytes + size > 2.5 * size
            with pytest.raises(AdapterBudgetError, match="over its share"):
                lora_swarm.run(honest.open_session(max_length=8, adapter=str(folders[3])))
            assert (len(node.sessions), node.adapters.store.resident) == (sessions, resident)
        finally:
            lora_swarm.run(first.close())
        for session in idle:
            lora_swarm.run(session.close())
    finally:
        for model in [*throwaways, honest]:
            lora_swarm.run(model.close())
        lora_swarm.stop_node(node)


def test_peers_asking_for_adapter_blocks_without_end_are_refused_and_an_honest_fetch_still_succeeds(
    lora_swarm, trained_model, adapters
):
    """Two attacker identities each open their share of ADAPTER streams on the node holding blocks 2:3 and say
    nothing; a further stream gets a typed `quota` refusal at once. Meanwhile a new node fetches an adapter's blocks
    from the same holder (checked by hash; a first fetch, refused by the asking peer's share, leaves nothing in
    the store) and an honest client's tokens with that adapter equal PeftModel's."""
    holder = next(node for node in lora_swarm.nodes[-len(SPANS) :] if (node.start_block, node.end_block) == (2, 3))
    adapter_id = adapter_id_of_folder(adapters["all-r16"], load_config(trained_model))

    async def ask(p2p, request: AdapterRequest | None):
        channel = await open_stream(p2p, holder.peer_id, rpc.ADAPTER, max_frame_bytes=2**24)
        if request is not None:
            channel.send(frame(request))
            return channel, read(await channel.receive(), ADAPTER_ANSWERS)
        return channel, None

    async def identities(count: int, initial_peers: list[str]) -> list[P2P]:
        return list(await asyncio.gather(*(P2P.create(initial_peers=initial_peers) for _ in range(count))))

    async def shutdown(peers: list[P2P]) -> None:
        await asyncio.gather(*(p2p.shutdown() for p2p in peers), return_exceptions=True)

    attackers = lora_swarm.run(identities(2, lora_swarm.peers_with(holder)))
    fresh = lora_swarm.start_node(trained_model, 2, 3, dht_prefix=PREFIX)
    held = []
    try:
        for p2p in attackers:  # each peer's share of streams, idle
            held += [lora_swarm.run(ask(p2p, None))[0] for _ in range(MAX_ANSWERS_PER_PEER)]
        wait_until(lambda: sum(holder.rpc.adapter_answers.running.values()) == len(held), timeout_s=10)
        channel, answer = lora_swarm.run(ask(attackers[0], AdapterRequest(adapter_id=adapter_id, start_block=2,
                                                                          end_block=3)))  # fmt: skip
        channel.close()
        assert isinstance(answer, ErrorReply) and answer.code == "quota", answer

        def over_share(nbytes: int) -> None:  # a peer under its share before the fetch, over it with the slice
            sizes.append(nbytes)
            if nbytes > 1:
                raise AdapterBudgetError("over its share")

        sizes: list[int] = []
        with pytest.raises(AdapterBudgetError):
            lora_swarm.run(fresh.adapters.hold_or_fetch(adapter_id, (2, 3), admit=over_share))
        assert sizes and adapter_id not in fresh.adapters.store  # refused before it went into the store
        piece, release = lora_swarm.run(fresh.adapters.hold_or_fetch(adapter_id, (2, 3)))  # from the holder
        release()
        assert sizes == [1, piece.nbytes]  # 1 byte before the fetch, then the slice before the store takes it
        assert (piece.start, piece.end) == (2, 3)
        input_ids = prompts(1)[0]
        with connect(lora_swarm, trained_model, adapter="all-r16") as model:
            output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(output, peft_generate(trained_model, adapters["all-r16"], input_ids, NEW_TOKENS))
    finally:
        for channel in held:
            channel.close()
        lora_swarm.run(shutdown(attackers))
        lora_swarm.stop_node(fresh)
    wait_until(lambda: not holder.rpc.adapter_answers.running, timeout_s=10)  # closed or timed out: slots free


def test_a_name_squatted_by_another_adapter_is_refused_never_resolved_to_it(
    lora_swarm, trained_model, adapters, tmp_path
):
    """A node announces a different adapter under a name the swarm already uses: the name is refused as ambiguous
    (typed, naming the way out), never resolved to the squatter's adapter; named by its id, the honest adapter
    still gives PeftModel's tokens."""
    name = "attention-r4"
    squatted = save_random_adapter(trained_model, tmp_path / name, 99, r=4, lora_alpha=8, target_modules=["q_proj"])
    squatter = lora_swarm.start_node(trained_model, 0, 2, dht_prefix=PREFIX, adapters=(str(squatted),))
    honest_id = adapter_id_of_folder(adapters[name], load_config(trained_model))
    try:
        with connect(lora_swarm, trained_model) as model:
            wait_until(lambda: len(model.call(model.client.announced_adapters()).get(name, ())) == 2, timeout_s=30)
            with pytest.raises(AdapterMissingError, match="2 different adapters have this name"):
                model.generate(prompts(1)[0], max_new_tokens=2, adapter=name)
            input_ids = prompts(1)[0]
            output = model.generate(
                input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, adapter=honest_id
            )
        assert torch.equal(output, peft_generate(trained_model, adapters[name], input_ids, NEW_TOKENS))
    finally:
        lora_swarm.stop_node(squatter)


def test_a_narrow_slice_a_client_sent_does_not_hide_the_adapter_its_peers_announce(lora_swarm, trained_model, adapters):
    """A client sends a node blocks 0:1 of an adapter others announce for 0:2 (its id is its content: the same
    adapter): a session on 0:2 naming it still gets it, fetched whole from the peers in place of the narrow slice,
    which then stays and is announced like any fetched adapter. A client's own adapter sent narrow, then wide, is
    held wide and gone with its sessions."""
    config = load_config(trained_model)
    public = own_adapter_of_folder(adapters["all-r16"], config)
    private = own_adapter_of_folder(adapters["mlp-r8-some"], config)
    fresh = lora_swarm.start_node(trained_model, 0, 2, dht_prefix=PREFIX)

    async def upload(own: OwnAdapter, start: int, end: int):
        sent = own.blocks_frame(start, end)
        return await fresh.adapters.hold_uploaded(read(sent, TO_SESSION), sent)

    async def run():
        narrow, release_narrow = await upload(public, 0, 1)
        whole, release_whole = await fresh.adapters.hold_or_fetch(public.adapter_id, (0, 2))
        release_narrow()
        release_whole()
        first, release_first = await upload(private, 0, 1)
        # a session running from the narrow slice is moved to the wide one once it is held: one slice in memory
        session = SimpleNamespace(adapter_id=private.adapter_id, adapter=first)
        table = getattr(fresh.adapters, "sessions", None)
        fresh.adapters.sessions = SimpleNamespace(sessions={"s": session})
        try:
            second, release_second = await upload(private, 0, 2)
        finally:
            fresh.adapters.sessions = table
        assert session.adapter is second
        release_first()
        release_second()
        return [(piece.start, piece.end) for piece in (narrow, whole, first, second)]

    try:
        assert lora_swarm.run(run()) == [(0, 1), (0, 2), (0, 1), (0, 2)]
        assert public.adapter_id in fresh.adapters.store  # fetched: kept once its sessions are gone
        assert public.adapter_id in {info.adapter_id for info in fresh.current_info().adapters}
        assert private.adapter_id not in fresh.adapters.store  # a client's own: gone with its last session
    finally:
        lora_swarm.stop_node(fresh)


def test_a_peers_opens_under_way_count_in_its_adapter_share(lora_swarm, trained_model, tmp_path):
    """A node whose cache throwaway sessions fill: one peer opens two sessions at once with two adapters of its
    own, each within its share of the adapter budget, not both. Both wait for room; the second is refused over
    the share at once (its first's adapter counted while that open waits), the first opens once a throwaway
    session is preempted."""
    folders, size = own_adapters(trained_model, tmp_path / "share", 70, 2)
    node = lora_swarm.start_node(
        trained_model,
        0,
        4,
        dht_prefix="lora-share",
        adapter_budget_mb=3 * size / 2**20,
        preempt_idle_s=3.0,  # the first open waits that long at most for a throwaway session to be preemptible
        max_cache_tokens=16,
    )

    def client():
        return async_client(lora_swarm, trained_model, "lora-share")

    throwaways, peer = [client(), client()], client()
    try:
        idle = [lora_swarm.run(model.open_session(max_length=8)) for model in throwaways]  # each half the cache

        async def both():
            return await asyncio.gather(
                *(peer.open_session(max_length=8, adapter=str(folder)) for folder in folders), return_exceptions=True
            )

        answers = lora_swarm.run(both())
        refused = [answer for answer in answers if isinstance(answer, BaseException)]
        assert len(refused) == 1 and isinstance(refused[0], AdapterBudgetError), answers
        assert "over its share" in str(refused[0])
        for answer in answers:
            if not isinstance(answer, BaseException):
                lora_swarm.run(answer.close())
        for session in idle:
            lora_swarm.run(session.close())
    finally:
        for model in (*throwaways, peer):
            lora_swarm.run(model.close())
        lora_swarm.stop_node(node)


def test_a_replacement_that_cannot_get_the_adapter_is_passed_over_not_banned(lora_swarm, trained_model, adapters):
    """The only node holding the session's adapter is lost mid-generation; the spare serving its blocks has no copy
    and nothing to fetch one from, so it refuses the replacement's open (adapter_missing). That is no failure of the
    spare: it is left out of that recovery, not banned, and still serves this client's sessions without the adapter."""
    from nesa_node.errors import NesaError

    prefix = "adapter-failover"
    holder = lora_swarm.start_node(trained_model, 0, 4, dht_prefix=prefix, adapters=(adapters["attention-r4"],))
    spare = lora_swarm.start_node(trained_model, 0, 4, dht_prefix=prefix)
    nodes = [holder, spare]
    model = DistributedModelForCausalLM.from_pretrained(
        trained_model, initial_peers=lora_swarm.initial_peers, dht_prefix=prefix, compression="none"
    )
    try:
        wait_until(lambda: len(model.call(model.swarm.node_records(fresh=True))) == 2, 30)
        input_ids = prompts(1)[0]
        model.swarm.ban(spare.peer_id)  # the session opens on the holder
        with model.inference_session(max_length=32, adapter="attention-r4") as session:
            assert session.chain.peer_ids == (holder.peer_id,)
            model.swarm.unban(spare.peer_id)
            model.generate(input_ids, max_new_tokens=2, do_sample=False)
            lora_swarm.stop_node(holder)
            nodes.remove(holder)
            with pytest.raises(NesaError):
                model.generate(input_ids, max_new_tokens=4, do_sample=False)
        assert spare.peer_id not in model.swarm.banned()
        assert model.generate(input_ids, max_new_tokens=2, do_sample=False).shape == (1, input_ids.shape[1] + 2)
    finally:
        model.close()
        for node in nodes:
            lora_swarm.stop_node(node)


def test_a_peers_share_counts_what_running_its_adapters_costs(lora_swarm, trained_model, tmp_path):
    """A bfloat16 adapter runs from float32 copies beside its stored factors: the node's budget charges both, and so
    does the peer's share of it (half the budget), or one peer's sessions could hold far more of the budget than
    its share says. An adapter whose bytes fit the share but whose cost does not is refused."""
    from safetensors.torch import load_file, save_file

    folder = save_random_adapter(trained_model, tmp_path / "bf16", 61, r=4, target_modules="all-linear")
    weights = folder / "adapter_model.safetensors"
    save_file({name: tensor.to(torch.bfloat16) for name, tensor in load_file(weights).items()}, weights)
    piece = load_adapter_slice(str(folder), load_config(trained_model), 0, 4)
    cost = piece.nbytes + piece.run_bytes("cpu")
    assert piece.nbytes < cost  # (stored in bfloat16, run in float32 here)
    budget = 1.5 * cost  # room for the adapter; a peer's share (half) is over its bytes, under its cost
    assert piece.nbytes < budget / 2 < cost
    node = lora_swarm.start_node(trained_model, 0, 4, dht_prefix="lora-cost", adapter_budget_mb=budget / 2**20)
    model = async_client(lora_swarm, trained_model, "lora-cost")
    try:
        with pytest.raises(AdapterBudgetError, match="over its share"):
            lora_swarm.run(model.open_session(max_length=8, adapter=str(folder)))
        assert len(node.sessions) == 0 and node.adapters.store.resident == 0
    finally:
        lora_swarm.run(model.close())
        lora_swarm.stop_node(node)


def test_a_slice_fetched_while_the_node_moved_is_not_kept_for_its_new_blocks(lora_swarm, trained_model, adapters):
    """A node moves to other blocks while it fetches an adapter for its old ones: the slice, of blocks it no longer
    serves, is dropped (the open is refused as missing), not put in the new store and announced there."""
    config = load_config(trained_model)
    adapter_id = adapter_id_of_folder(adapters["attention-r4"], config)
    fresh = lora_swarm.start_node(trained_model, 0, 2, dht_prefix=PREFIX)
    fetch = fresh.adapters.fetcher.fetch

    async def fetch_then_move(*args):
        fetched = await fetch(*args)
        await fresh.adapters.load_span(1, 2)  # (as a move does: a fresh store for the new blocks)
        return fetched

    fresh.adapters.fetcher.fetch = fetch_then_move
    try:
        with pytest.raises(AdapterMissingError, match="moved"):
            lora_swarm.run(fresh.adapters.hold_or_fetch(adapter_id, (0, 2)))
        assert adapter_id not in fresh.adapters.store and fresh.adapters.span == (1, 2)
    finally:
        lora_swarm.stop_node(fresh)


def test_a_preloaded_adapter_larger_than_a_peers_share_is_served(lora_swarm, trained_model, tmp_path):
    """The operator's preloaded adapters are held whoever uses them: a session naming one larger than a peer's share
    of the adapter budget is opened, and a peer's share still bounds what it makes the node hold besides."""
    folders, size = own_adapters(trained_model, tmp_path / "big", 70, 2)
    node = lora_swarm.start_node(
        trained_model, 0, 4, dht_prefix="lora-preloaded", adapters=(str(folders[0]),),
        adapter_budget_mb=1.6 * size / 2**20,
    )  # fmt: skip
    model = async_client(lora_swarm, trained_model, "lora-preloaded")
    try:
        name = folders[0].name
        session = lora_swarm.run(model.open_session(max_length=8, adapter=name))
        try:
            assert len(node.sessions) == 1  # over half the budget, preloaded: not this peer's to answer for
            with pytest.raises(AdapterBudgetError, match="over its share"):  # its own one that size is
                lora_swarm.run(model.open_session(max_length=8, adapter=str(folders[1])))
        finally:
            lora_swarm.run(session.close())
    finally:
        lora_swarm.run(model.close())
        lora_swarm.stop_node(node)
