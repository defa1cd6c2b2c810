"""LoRA fine-tuning over a real swarm (issue: distributed LoRA fine-tuning): three in-process nodes of the trained
tiny Llama, float32, no compression, against peft training the same adapter in one process with the same AdamW."""

from __future__ import annotations

import threading

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.checkpoints import latest_step, read_checkpoint
from nesa_node.client.finetune import FineTuningSession, causal_lm_loss
from nesa_node.client.train_link import LinkLost
from nesa_node.errors import AdapterError, BadRequestError, CheckpointError
from nesa_node.protocol.channel import LaneChannel, frame
from nesa_node.protocol.messages import TrainApplied, TrainApply, TrainBackward, TrainGrad
from nesa_node.protocol.tensors import tensor_to_proto
from nesa_node.sharding.lora import load_adapter_slice
from tests.support.adapters import peft_generate
from tests.support.swarm import wait_for_chain

PREFIX = "finetune"
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], lora_dropout=0.0)
LR, WEIGHT_DECAY = 2e-3, 0.01
SEQ, BATCH = 24, 4


def batches(vocab: int, count: int, seed: int = 7) -> list[torch.Tensor]:
    """Token batches of a fixed repeating pattern with noise: something an adapter can learn in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.randint(3, vocab, (SEQ,), generator=generator)
    out = []
    for _ in range(count):
        rows = pattern.repeat(BATCH, 1)
        noise = torch.rand(BATCH, SEQ, generator=generator) < 0.1
        rows[noise] = torch.randint(3, vocab, (int(noise.sum()),), generator=generator)
        out.append(rows)
    return out


@pytest.fixture(scope="module")
def swarm(module_swarm, trained_model):
    for start, end in ((0, 1), (1, 3), (1, 3), (3, 4)):  # a spare for blocks 1:3, for the failover test
        module_swarm.start_node(trained_model, start, end, dht_prefix=PREFIX)
    return module_swarm


@pytest.fixture(scope="module")
def initial_adapter(trained_model, tmp_path_factory):
    """A fresh peft adapter (B zero, as peft starts one), saved: both runs start from it."""
    base = AutoModelForCausalLM.from_pretrained(trained_model)
    torch.manual_seed(11)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    folder = tmp_path_factory.mktemp("initial-adapter")
    model.save_pretrained(folder)
    return folder


def local_run(model_path: str, folder, data: list[torch.Tensor]):
    """peft in one process: (loss before each step, the trained PeftModel)."""
    base = AutoModelForCausalLM.from_pretrained(model_path)
    model = peft.PeftModel.from_pretrained(base, folder, is_trainable=True)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    losses = []
    for input_ids in data:
        loss = causal_lm_loss(model(input_ids).logits, input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def swarm_session(swarm, model_path, folder, **options) -> FineTuningSession:
    session = FineTuningSession.create(
        model_path,
        initial_peers=swarm.initial_peers,
        dht_prefix=PREFIX,
        adapter=folder,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        **options,
    )
    assert len(session.chain) == 3
    return session


def serving_client(swarm, model_path, folder=None) -> DistributedModelForCausalLM:
    """An inference client of the swarm, lossless, with the adapter in `folder` as its model's (None: the base)."""
    adapter = None if folder is None else str(folder)
    return DistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, dht_prefix=PREFIX, compression="none", adapter=adapter
    )


def greedy(client, prompt: torch.Tensor, **options) -> torch.Tensor:
    """Eight greedy tokens after `prompt`, however soon an end-of-text token comes."""
    return client.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, **options)


def lora_parameters(model) -> dict[str, torch.Tensor]:
    """{"<block>.<projection>.lora_A|B": tensor} of a PeftModel's adapter."""
    out = {}
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            block = int(name.split("layers.")[1].split(".")[0])
            projection = ".".join(name.split("layers.")[1].split(".")[1:3])
            out[f"{block}.{projection}.{name.split('.')[-3]}"] = parameter.detach()
    return out


def slice_parameters(whole) -> dict[str, torch.Tensor]:
    out = {}
    for (block, projection), factor in whole.factors.items():
        out[f"{block}.{projection}.lora_A"] = factor.lora_a
        out[f"{block}.{projection}.lora_B"] = factor.lora_b
    return out


@pytest.mark.parametrize("lanes", [True, False], ids=["data-lanes", "libp2p"])
def test_one_swarm_step_equals_one_peft_step(swarm, trained_model, initial_adapter, lanes):
    data = batches(2048, 1)
    losses, model = local_run(trained_model, initial_adapter, data)
    with swarm_session(swarm, trained_model, initial_adapter, lanes=lanes) as session:
        assert all(isinstance(link.channel, LaneChannel) == lanes for link in session.inner.links)
        loss = session.train_step(data[0])
        assert session.step == 1
        whole = session.adapter()
    assert abs(loss - losses[0]) < 1e-5
    local, remote = lora_parameters(model), slice_parameters(whole)
    assert local.keys() == remote.keys() and len(local) == 4 * 5 * 2
    moved = 0
    for name, expected in local.items():
        assert torch.allclose(remote[name], expected, atol=1e-6, rtol=0), name
        moved += not torch.equal(expected, slice_parameters(load_adapter_slice(initial_adapter, model.config))[name])
    assert moved >= 4 * 5  # every B left zero after one step


def test_thirty_steps_follow_peft_and_the_adapter_serves(swarm, trained_model, initial_adapter, tmp_path):
    data = batches(2048, 30)
    losses, model = local_run(trained_model, initial_adapter, data)
    with swarm_session(swarm, trained_model, initial_adapter) as session:
        remote = [session.train_step(input_ids) for input_ids in data]
        folder = session.save_pretrained(tmp_path / "trained")
        assert session.step == 30
    for step, (ours, theirs) in enumerate(zip(remote, losses, strict=True)):
        assert abs(ours - theirs) < 1e-4, f"step {step}: {ours} vs {theirs}"
    assert remote[-1] < 0.5 * remote[0]  # it learnt the pattern

    # the saved folder is a standard PEFT adapter, equal to the one trained in one process
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained_model), folder)
    for name, expected in lora_parameters(model).items():
        assert torch.allclose(lora_parameters(loaded)[name], expected, atol=1e-5, rtol=0), name

    # served: the swarm's greedy tokens with the trained adapter equal PeftModel's in one process
    prompt = data[0][:1, :6]
    expected = peft_generate(trained_model, folder, prompt, 8)
    with serving_client(swarm, trained_model, folder) as client:
        wait_for_chain(client)
        tokens = greedy(client, prompt)
    assert torch.equal(tokens, expected)


def test_evaluation_changes_nothing_and_bad_requests_are_typed(swarm, trained_model, initial_adapter):
    data = batches(2048, 2)
    with swarm_session(swarm, trained_model, initial_adapter) as session:
        before = session.evaluate(data[1])
        assert session.evaluate(data[1]) == before  # evaluating updates nothing
        first = session.evaluate(data[0])
        assert session.train_step(data[0]) == pytest.approx(first, abs=1e-5)  # the loss before the step
        assert session.evaluate(data[1]) < before  # one step on the pattern helps on another batch of it
        with pytest.raises(ValueError):
            session.train_step(data[0][:, :1])  # one token: nothing to predict
        stray = frame(TrainBackward(step_id="nothing-forwarded"), [tensor_to_proto(torch.zeros(1, 2, 128))])
        with pytest.raises(BadRequestError, match="no forward pass"):
            session.runner.call(session.inner.links[0].call(stray, TrainGrad))
        assert session.step == 1
        assert session.train_step(data[0]) < first  # the session goes on after a refused request
        assert session.step == 2


def test_a_folder_that_is_not_an_adapter_is_refused(swarm, trained_model, tmp_path):
    with pytest.raises(AdapterError):
        FineTuningSession.create(trained_model, initial_peers=swarm.initial_peers, dht_prefix=PREFIX, adapter=tmp_path)


def test_two_data_parallel_chains_keep_their_replicas_identical(swarm, trained_model, initial_adapter):
    """Two chains, each half of every batch: blocks 1:3 on two nodes (their gradients summed node to node), blocks
    0:1 and 3:4 as two sessions on one node each. After 50 steps the replicas hold the same slices, and every loss
    is the one of peft training on the whole batches in one process."""
    data = batches(2048, 50, seed=5)
    losses, model = local_run(trained_model, initial_adapter, data)
    with swarm_session(swarm, trained_model, initial_adapter, data_parallel=2) as session:
        chains = [[link.peer_id for link in chain] for chain in session.inner.chains]
        assert chains[0][1] != chains[1][1] and chains[0][0] == chains[1][0]  # two nodes for 1:3, one for 0:1
        remote = [session.train_step(input_ids) for input_ids in data]
        first, second = session.adapter(0), session.adapter(1)
    drift = max(
        (a - b).abs().max().item()
        for name, a in slice_parameters(first).items()
        for b in [slice_parameters(second)[name]]
    )
    assert drift <= 1e-5
    for step, (ours, theirs) in enumerate(zip(remote, losses, strict=True)):
        assert abs(ours - theirs) < 1e-4, f"step {step}: {ours} vs {theirs}"
    for name, expected in lora_parameters(model).items():
        assert torch.allclose(slice_parameters(first)[name], expected, atol=1e-4, rtol=0), name


def test_micro_batches_pipelined_down_the_chain_take_the_same_steps(swarm, trained_model, initial_adapter):
    """Each batch as two micro-batches following each other down the chain, each node's step taken with the second
    one's backward pass there: the same losses and adapter as peft's whole batches; a TrainApply for the step taken
    already is answered, not applied again."""
    data = batches(2048, 10, seed=9)
    losses, model = local_run(trained_model, initial_adapter, data)
    with swarm_session(swarm, trained_model, initial_adapter, micro_batches=2) as session:
        threads = []
        loss_and_grad = session.inner.layers.loss_and_grad

        def recorded(*args):
            threads.append(threading.get_ident())
            return loss_and_grad(*args)

        session.inner.layers.loss_and_grad = recorded
        remote = [session.train_step(input_ids) for input_ids in data]
        assert threads == [threading.get_ident()] * 20  # the loss ran on this (the calling) thread, per micro-batch
        link = session.inner.links[0]
        message, _ = session.runner.call(link.call(frame(TrainApply(update=10)), TrainApplied))
        assert message.step == 10  # the step it took already
        whole = session.adapter()
    for step, (ours, theirs) in enumerate(zip(remote, losses, strict=True)):
        assert abs(ours - theirs) < 1e-4, f"step {step}: {ours} vs {theirs}"
    for name, expected in lora_parameters(model).items():
        assert torch.allclose(slice_parameters(whole)[name], expected, atol=1e-5, rtol=0), name


def test_a_step_that_runs_out_of_failovers_leaves_the_next_one_at_the_restore_point(
    swarm, trained_model, initial_adapter
):
    """A step whose failures exceed max_failovers raises; the forward pass the nodes hold from it is dropped: the
    next step reopens the chain at the restore point, replays the steps since, and follows peft."""
    data = batches(2048, 4, seed=5)
    losses, _ = local_run(trained_model, initial_adapter, data)
    with swarm_session(swarm, trained_model, initial_adapter) as session:
        session.inner.model.config = session.inner.model.config.replace(max_failovers=0)
        remote = [session.train_step(data[0]), session.train_step(data[1])]
        loss_and_grad = session.inner.layers.loss_and_grad

        def lost(*args):  # after the nodes ran the forward pass, before any gradient goes back
            session.inner.layers.loss_and_grad = loss_and_grad
            raise LinkLost(session.chain[-1].peer_id, "went silent", blame=False)

        session.inner.layers.loss_and_grad = lost
        with pytest.raises(LinkLost):
            session.train_step(data[2])
        assert session.step == 2 and session.failovers == 0
        remote += [session.train_step(data[2]), session.train_step(data[3])]
        assert session.failovers == 1 and session.replayed_steps == 2  # back to step 0, its two steps taken again
    for step, (ours, theirs) in enumerate(zip(remote, losses, strict=True)):
        assert abs(ours - theirs) < 1e-4, f"step {step}: {ours} vs {theirs}"


def test_a_node_lost_mid_training_is_replaced_and_the_run_resumes_from_its_checkpoint(
    swarm, trained_model, initial_adapter, tmp_path
):
    """Checkpoints every 4 steps; after step 6 the chain's middle node stops: the session reopens the chain at step
    4 on the spare, replays steps 5 and 6, and goes on. Closed at step 12 and resumed from the checkpoint folder, it
    ends at step 15 where peft's uninterrupted run ends."""
    data = batches(2048, 15, seed=3)
    losses, model = local_run(trained_model, initial_adapter, data)
    checkpoints = tmp_path / "checkpoints"
    remote = []
    with swarm_session(
        swarm, trained_model, initial_adapter, checkpoint_dir=checkpoints, checkpoint_every=4
    ) as session:
        while session.step < 12:
            if session.step == 6 and session.failovers == 0:
                middle = next(node for node in swarm.nodes if node.peer_id == session.chain[1].peer_id)
                swarm.stop_node(middle)
            remote.append(session.train_step(data[session.step]))
        assert session.failovers == 1 and session.replayed_steps == 2  # lost: steps 5 and 6, at most the interval
        assert middle.peer_id not in {hop.peer_id for hop in session.chain}
    assert latest_step(checkpoints) == 12
    assert sorted(path.name for path in checkpoints.glob("step-*")) == ["step-00000008", "step-00000012"]
    with swarm_session(swarm, trained_model, initial_adapter, checkpoint_dir=checkpoints, resume=True) as resumed:
        assert resumed.step == 12
        while resumed.step < 15:
            remote.append(resumed.train_step(data[resumed.step]))
        folder = resumed.save_pretrained(tmp_path / "adapter")
    for step, (ours, theirs) in enumerate(zip(remote, losses, strict=True)):
        assert abs(ours - theirs) < 1e-4, f"step {step}: {ours} vs {theirs}"
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained_model), folder)
    for name, expected in lora_parameters(model).items():
        assert torch.allclose(lora_parameters(loaded)[name], expected, atol=1e-5, rtol=0), name


def test_a_damaged_checkpoint_is_refused(swarm, trained_model, initial_adapter, tmp_path):
    data = batches(2048, 2)
    with swarm_session(swarm, trained_model, initial_adapter, checkpoint_dir=tmp_path, checkpoint_every=2) as session:
        for input_ids in data:
            session.train_step(input_ids)
    checkpoint = read_checkpoint(tmp_path, num_blocks=4)
    assert checkpoint.step == 2 and {span.peer_id for span in checkpoint.spans} <= {n.peer_id for n in swarm.nodes}
    config = AutoModelForCausalLM.from_pretrained(trained_model).config
    assert load_adapter_slice(tmp_path / "step-00000002" / "adapter", config).sha256 == checkpoint.adapter.sha256
    manifest = tmp_path / "step-00000002" / "manifest.json"
    text = manifest.read_text()
    signer = checkpoint.spans[0].peer_id
    other = next(node.peer_id for node in swarm.nodes if node.peer_id != signer)
    manifest.write_text(text.replace(signer, other, 1))  # claims another node produced the first slice
    with pytest.raises(CheckpointError, match="not signed by that node"):
        read_checkpoint(tmp_path, num_blocks=4)
    manifest.write_text(text)
    next(tmp_path.glob("step-00000002/blocks-0-1.slice.safetensors")).write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError):
        swarm_session(swarm, trained_model, initial_adapter, checkpoint_dir=tmp_path, resume=True)


# ---- edge layers trained whole (peft's modules_to_save) ---------------------------------------------------------------

EDGES = ["lm_head", "model.norm", "model.embed_tokens"]
EDGE_KEYS = {"lm_head": "lm_head", "model.norm": "norm", "model.embed_tokens": "embed_tokens"}


@pytest.fixture(scope="module")
def edges_adapter(trained_model, tmp_path_factory):
    """A fresh peft adapter that also trains the embeddings, the final norm and the LM head whole."""
    base = AutoModelForCausalLM.from_pretrained(trained_model)
    torch.manual_seed(11)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA, modules_to_save=EDGES))
    folder = tmp_path_factory.mktemp("edges-adapter")
    model.save_pretrained(folder)
    return folder


def edge_parameters(model) -> dict[str, torch.Tensor]:
    """{"embed_tokens" | "norm" | "lm_head": weight} of a PeftModel's modules_to_save."""
    out = {}
    for name, parameter in model.named_parameters():
        if ".modules_to_save.default." in name:
            module = name.removeprefix("base_model.model.").split(".modules_to_save")[0]
            out[EDGE_KEYS[module]] = parameter.detach()
    return out


def test_trained_edge_layers_follow_peft_modules_to_save_through_a_failover_and_serve(
    swarm, trained_model, edges_adapter, initial_adapter, tmp_path
):
    """The adapter trains the embeddings, norm and LM head whole on the client, in micro-batches, with checkpoints
    every 3 steps; after step 4 the chain is reopened at the checkpoint (the client's edges go back to step 3 with the
    nodes' slices) and step 4 runs again. Every loss, every LoRA factor and every edge weight ends where peft's
    uninterrupted run with modules_to_save ends; the saved folder loads in PeftModel as that run, and a client naming
    it gives PeftModel's greedy tokens."""
    data = batches(2048, 8, seed=5)
    losses, model = local_run(trained_model, edges_adapter, data)
    checkpoints = tmp_path / "checkpoints"
    with swarm_session(
        swarm, trained_model, edges_adapter, micro_batches=2, checkpoint_dir=checkpoints, checkpoint_every=3
    ) as session:
        assert session.inner.spec.edges == ("embed_tokens", "norm", "lm_head")
        remote = []
        for input_ids in data:
            if session.step == 4:
                session.inner.links[0].broken = True  # as after a pass cut short: back to the checkpoint
            remote.append(session.train_step(input_ids))
        assert session.failovers == 1 and session.replayed_steps == 1
        whole, edges = session.adapter(), session.inner.layers.weights()
        folder = session.save_pretrained(tmp_path / "trained")
    for step, (ours, theirs) in enumerate(zip(remote, losses, strict=True)):
        assert abs(ours - theirs) < 1e-4, f"step {step}: {ours} vs {theirs}"
    for name, expected in lora_parameters(model).items():
        assert torch.allclose(slice_parameters(whole)[name], expected, atol=1e-5, rtol=0), name
    local = edge_parameters(model)
    assert local.keys() == edges.keys() == {"embed_tokens", "norm", "lm_head"}
    start = edge_parameters(peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained_model),
                                                           edges_adapter))  # fmt: skip
    for name, expected in local.items():
        assert torch.allclose(edges[name], expected, atol=1e-5, rtol=0), name
        assert not torch.equal(expected, start[name])  # trained

    checkpoint = read_checkpoint(checkpoints, num_blocks=4)
    assert (
        checkpoint.step == 6
        and checkpoint.edges.step == 6
        and set(checkpoint.edges.moments)
        == {f"{name}.{moment}" for name in local for moment in ("exp_avg", "exp_avg_sq")}
    )
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained_model), folder)
    for name in local:
        assert torch.equal(edge_parameters(loaded)[name], edges[name]), name
    with torch.inference_mode():
        assert torch.allclose(loaded(data[0]).logits, model(data[0]).logits, atol=1e-4, rtol=0)

    # served: a client that names the folder puts the trained edges into its own layers; nodes run the blocks
    prompt = data[0][:1, :6]
    expected = peft_generate(trained_model, folder, prompt, 8)
    assert not torch.equal(expected, peft_generate(trained_model, None, prompt, 8))
    with serving_client(swarm, trained_model, folder) as client:
        wait_for_chain(client)
        assert torch.equal(greedy(client, prompt), expected)
        assert torch.equal(greedy(client, prompt, adapter=str(folder)), expected)  # the same folder per call
        with pytest.raises(AdapterError, match="needs a client of its own"):
            client.generate(prompt, max_new_tokens=2, adapter=str(initial_adapter))
    # a client whose layers are the base model's cannot serve those edges per call: it is told how to
    with serving_client(swarm, trained_model) as plain:
        with pytest.raises(AdapterError, match=r"adapter=FOLDER"):
            plain.generate(prompt, max_new_tokens=2, adapter=str(folder))
