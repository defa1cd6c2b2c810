"""Verification benchmark: audits' false alarms, each cheat's detection, and what commitments, audits and majority
votes cost, in one run on an in-process swarm.

A tiny seeded Llama (--layers 4, --hidden 64) on 9 honest nodes of this process: spans 0:1, 1:3, 3:4 (4 layers), three
nodes each (the chain's node, an auditor, a second auditor to confirm a failed check), each holding one random LoRA
adapter (for `wrong_adapter`). Clients are AsyncDistributedModels on a loop thread of their own.

1. False positives: generations of --prompt 1000 + --new-tokens 24 tokens through AsyncDistributedModel.generate with
   verify="audit:1.0" (all 32 windows of each of 3 hops checked), codec rotating none / fp16 / blockwise8, until
   --honest-windows were checked; every audit counts (a wrapper on `model.audit`: a re-run after a blame counts too).
2. Detection, per mode of devtools/malicious.py (noisy at rate 0.01, "noise on 1% of steps", and 1.0): a fresh cheater
   of the middle span in a chain routed around the honest middle nodes; commit=True sessions, one decoding from a
   32-token prompt to --attack-windows windows and one of run 1's shape (prefill windows); noisy@0.01 gets
   --noisy-sessions decode sessions and no prefill one (a prefill is one step: one noise draw for 31 windows). Each
   record of the cheater is checked with `compare` against the audit's own re-execution (Auditor._reexecute: the
   first span from the client's embeddings, then the middle span, each on an honest node), so d = failed windows /
   windows is measured window by window (the audit's counters stop at its first confirmed failure); the first hop's
   honest windows are checked alike. `client.audit(session)` must then blame the cheater at hop 1, and only it. At
   p = --rate: P(flagged within 200 windows) = 1 - (1 - p d)^200 (target >= 0.9999 for modes cheating on every
   step), expected windows to flag 1 / (p d); both assume the confirming re-execution agrees (it did in each session).
3. Commitment cost: bytes of a commitment and of a signed record (one per 32 tokens per hop; target <= 300); decode
   step wall time of commit=True against commit=False sessions on one chain, alternating (target <= 1.02x); the
   nodes' time in WindowLog.add/take (wrapped in this process) against their compute_s; at hidden 4096 the CPU time
   of InputHasher + WindowCommitter.add/finish + RecordSigner.sign per window (float32), against a MEASURED decode
   step of one Llama-7B-shaped float32 block on this CPU, and against an ESTIMATED GPU step (--est-gpu-step-ms).
4. Audit compute: run 1's shape with explicit sessions, Auditor(model, p).audit(session) at p = 1 and --rate,
   alternating: audit wall time / generation wall time, nodes' compute_seconds in the audit / in the generation (and
   generate's own audits from run 1). The replay prefill runs to the last sampled window: cost falls much less than p.
5. Majority of 3: decode tokens/s with verify="majority:3" against "off" (alternating), the vote's counts, and the
   largest difference between honest replicas (relative to RMS) against the vote's tolerance.
6. Known-answer canaries (verify="canary:P", client/canaries.py): --canary-count canaries of 32 tokens built from the
   model folder; false positives: every honest node sent canaries for --canary-rounds rounds (target 0 failed); per
   cheat of run 2 but wrong_adapter (canaries run the base weights), a fresh cheater of the middle span sent
   --canary-attacks canaries: d = failed / sent, and since a node is blamed only when two canaries in a row fail,
   P(blamed per check) = d^2 (independent draws) and P(blamed within 20 generations at p = --rate) =
   1 - (1 - p d^2)^20; `CanaryChecker.check` must then blame that node alone. Cost: one node's canary check (wall
   time) against a generation of --canary-generation-tokens through the 3-hop chain.

One JSON line on stdout, progress on stderr. Defaults: about 10 min on a shared 2-core CPU (run 1, 10,080 windows: ~2 min;
noisy@0.01 of run 2: ~4 min; run 6: ~1 min).

    python bench/verify.py [--honest-windows 10000] [--layers 4] [--hidden 64] [--attack-windows 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.bootstrap import BootstrapPeer  # noqa: E402
from nesa_node.client import majority  # noqa: E402
from nesa_node.client.async_model import AsyncDistributedModel  # noqa: E402
from nesa_node.client.audit import Auditor  # noqa: E402
from nesa_node.client.canaries import CanaryChecker  # noqa: E402
from nesa_node.client.model import LoopThread  # noqa: E402
from nesa_node.client.session import InferenceSession  # noqa: E402
from nesa_node.devtools.malicious import make_malicious  # noqa: E402
from nesa_node.devtools.tiny_model import TinyModelSpec, init_tiny_model  # noqa: E402
from nesa_node.errors import NesaError  # noqa: E402
from nesa_node.routing.snapshot import Chain, Hop  # noqa: E402
from nesa_node.server.config import NodeConfig  # noqa: E402
from nesa_node.server.node import Node  # noqa: E402
from nesa_node.server.window_log import WindowLog  # noqa: E402
from nesa_node.verification.canaries import build_canaries  # noqa: E402
from nesa_node.verification.commitment import (  # noqa: E402
    WINDOW_TOKENS,
    InputHasher,
    WindowCommitment,
    WindowCommitter,
    compare,
    tolerance_for,
)
from nesa_node.verification.receipts import HopRecord, RecordSigner  # noqa: E402

PREFIX = "bench-verify"
COPIES = 3  # nodes per span: the chain's, an auditor, a second auditor that confirms a failed check
CODECS = ("none", "fp16", "blockwise8")
CASES = [  # (name, make_malicious mode, its settings); noisy's scale is --noise-scale
    ("perturbed", "perturbed", {}), ("nf4_as_announced", "nf4_as_announced", {}), ("skip_block", "skip_block", {}),
    ("wrong_adapter", "wrong_adapter", {}), ("noisy@0.01", "noisy", {"rate": 0.01}), ("noisy@1", "noisy", {"rate": 1.0}),
    ("lazy", "lazy", {}),
]  # fmt: skip
KINDS = ("decode", "prefill")  # cheated sessions: decoding from a 32-token prompt; of the false-positive shape
FLAG_WINDOWS, FLAG_TARGET = 200, 0.9999  # the "flagged within 200 windows with probability >= 99.99%"
WINDOW_LOG = {"seconds": 0.0}  # the nodes' time in WindowLog.add / take (see `timed`)


def log(message: str) -> None:
    print(f"[verify {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class InProcessSwarm:
    """A bootstrap peer and nodes of this process on one loop thread (what tests/support/swarm.py's LocalSwarm does)."""

    def __init__(self) -> None:
        self.runner = LoopThread("bench-swarm-loop", loop_factory=asyncio.new_event_loop)
        self.nodes: list[Node] = []
        self.bootstrap = self.run(BootstrapPeer.create(dht_prefixes=(PREFIX,)))
        self.initial_peers = list(self.run(self.bootstrap.visible_maddrs()))

    def run(self, coroutine, timeout: float = 180.0):
        return self.runner.call(coroutine, timeout=timeout)

    def start_node(self, model_path: str, start: int, end: int, **settings) -> Node:
        config = NodeConfig(model_path=model_path, start_block=start, end_block=end).with_settings(
            initial_peers=tuple(self.initial_peers), measure_throughput=False, announce_period_s=2.0, trigger="off",
            dht_prefix=PREFIX, **settings,
        )  # fmt: skip
        node = self.run(Node.create(config))
        self.run(node.start())
        self.nodes.append(node)
        return node

    def stop_node(self, node: Node) -> None:
        self.nodes.remove(node)
        self.run(node.shutdown())

    def close(self) -> None:
        for stoppable in [*self.nodes, self.bootstrap]:
            with contextlib.suppress(Exception):  # shutting down anyway
                self.run(stoppable.shutdown(), timeout=60)
        self.runner.stop()


class Clients:
    """AsyncDistributedModels on one loop thread of their own (the nodes' loop stays theirs)."""

    def __init__(self, path: str, peers: list[str]) -> None:
        self.runner = LoopThread("bench-client-loop")
        self.path, self.peers, self.models = path, peers, []

    def call(self, coroutine, timeout: float = 900.0):
        return self.runner.call(coroutine, timeout=timeout)

    def connect(self, wanted: set[str], **settings) -> AsyncDistributedModel:
        model = self.call(AsyncDistributedModel.from_pretrained(self.path, initial_peers=self.peers, dht_prefix=PREFIX, dtype="float32", **settings))  # fmt: skip
        self.models.append(model)
        self.call(wait_for_peers(model, wanted))
        return model

    def close(self) -> None:
        for model in self.models:
            with contextlib.suppress(Exception):  # shutting down anyway
                self.call(model.close(), timeout=60)
        self.runner.stop()


async def wait_for_peers(model, wanted: set[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not wanted <= {record.info.peer_id for record in await model.swarm.node_records(fresh=True)}:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the client did not see {len(wanted)} nodes within {timeout_s} s")
        await asyncio.sleep(0.2)


def save_random_adapter(model_path: str, folder: Path, seed: int) -> Path:
    """A random PEFT LoRA adapter of the model (rank 4, B not zero), saved in `folder`."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=4))
    model.save_pretrained(folder)
    return folder


def node_compute(nodes) -> float:
    """Seconds the nodes spent in their blocks so far (their own counter)."""
    return sum(node.compute.compute_seconds for node in nodes)


def timed(method):
    """`method`, adding its wall time to WINDOW_LOG: the nodes' WindowLog.add (input hash and commitment copy per step;
    a window's commitment and signature at its end) and take (a window closed early), wrapped in this process."""

    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            WINDOW_LOG["seconds"] += time.perf_counter() - started

    return call


class AuditMeter:
    """Wraps `model.audit` (generate calls it once per run) to count every outcome and time it."""

    def __init__(self, model, nodes) -> None:
        self.checks, self.blamed = Counter(), []
        self.seconds = self.compute = 0.0
        audit = model.audit

        async def metered(session):
            compute, started = node_compute(nodes), time.perf_counter()
            try:
                outcome = await audit(session)
            finally:
                self.seconds += time.perf_counter() - started
                self.compute += node_compute(nodes) - compute
            self.checks.update(outcome.checks)
            self.blamed.extend(blame.peer_id for blame in outcome.blamed)
            return outcome

        model.audit = metered


def random_prompt(generator: torch.Generator, tokens: int) -> torch.Tensor:
    return torch.randint(3, 1000, (1, tokens), generator=generator)


def ratio(numerator: float, denominator: float, digits: int = 3) -> float | None:
    return round(numerator / denominator, digits) if denominator > 0 else None


# -- 1. false positives ------------------------------------------------------------------------------------------
def false_positives(args, clients: Clients, models: dict, nodes) -> tuple[dict, dict, list]:
    meters = {codec: AuditMeter(model, nodes) for codec, model in models.items()}
    generator = torch.Generator().manual_seed(17)
    wall = compute = 0.0
    generations = errors = checked = 0
    started = time.perf_counter()
    while checked < args.honest_windows:
        codec = CODECS[generations % len(CODECS)]
        prompt = random_prompt(generator, args.prompt)
        before, began = node_compute(nodes), time.perf_counter()
        try:
            clients.call(models[codec].generate(prompt, max_new_tokens=args.new_tokens))
        except NesaError as error:  # every chain tried was blamed: counted, the run goes on
            errors += 1
            log(f"generation {generations} ({codec}) failed: {error!r}")
        wall += time.perf_counter() - began
        compute += node_compute(nodes) - before
        generations += 1
        checked = sum(meter.checks["passed"] + meter.checks["failed"] for meter in meters.values())
        if generations % 30 == 0:
            log(f"false positives: {checked} windows checked, {generations} generations")
    count = sum((meter.checks for meter in meters.values()), Counter())
    audit_s = sum(meter.seconds for meter in meters.values())
    audit_compute = sum(meter.compute for meter in meters.values())
    result = {
        "windows_checked": checked, "windows_failed": count["failed"],
        "false_positive_rate": ratio(count["failed"], checked, 6), "inconclusive": count["inconclusive"],
        "unrecorded": count["unrecorded"], "generations": generations, "generation_errors": errors,
        "honest_nodes_blamed": len({peer for meter in meters.values() for peer in meter.blamed}),
        "honest_nodes_banned": len({peer for model in models.values() for peer in model.swarm.banned()}),
        "by_codec": {c: {"checked": m.checks["passed"] + m.checks["failed"], "failed": m.checks["failed"]} for c, m in meters.items()},
        "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    generate_p1 = {  # generate's own audits at p = 1: the audit's share of each generate call
        "audit_s_vs_serving_s": ratio(audit_s, wall - audit_s),
        "audit_compute_vs_serving_compute": ratio(audit_compute, compute - audit_compute), "generations": generations,
    }  # fmt: skip
    records = [r for m in models.values() if m.last_receipts for s in m.last_receipts.sessions for r in s.records]
    return result, generate_p1, records


# -- 2. detection ------------------------------------------------------------------------------------------------
async def cheated_session(model, chain, adapter_id, prompt, new_tokens: int) -> dict:
    """Generate through `chain` with hop records, check every record of hops 0 and 1 against honest re-executions,
    then audit the session as a client does."""
    session = InferenceSession(
        model.swarm, chain, model.config, batch=1, max_length=prompt.shape[1] + new_tokens, adapter=adapter_id,
        commit=True,
    )  # fmt: skip
    async with session:
        output = await model.generate(prompt, max_new_tokens=new_tokens, session=session)
        await session.fetch_records(final=True)
        hidden = model.embed(output[:, : output.shape[1] - 1])  # what the client sent the first node (lossless)
        dtype = str(model.dtype).removeprefix("torch.")
        tolerance, per_hop = tolerance_for(dtype, dtype), []
        for index, hop in enumerate(session.chain.hops[:2]):
            # the audit's own re-execution, on a node other than the hop's
            executed = await model.auditor._reexecute(session, hop.start_block, hop.end_block, hidden, exclude={hop.peer_id})  # fmt: skip
            if executed is None:
                raise RuntimeError(f"no other node re-executed blocks {hop.start_block}:{hop.end_block}")
            hidden = executed[0]
            failed = [not compare(WindowCommitment.from_bytes(r.commitment), hidden[:, r.token_start : r.token_end], tolerance).matches for r in session.records if r.hop == index]  # fmt: skip
            per_hop.append((len(failed), sum(failed)))
        outcome = await model.audit(session)
    return {"per_hop": per_hop, "outcome": outcome}


def detection(args, swarm: InProcessSwarm, clients: Clients, model, adapter: str, middle: tuple[int, int]) -> dict:
    honest_middle = frozenset(n.peer_id for n in swarm.nodes if n.current_info().start_block == middle[0])
    generator = torch.Generator().manual_seed(5)
    p, results = args.rate, {}
    for name, mode, settings in CASES:
        rare = name == "noisy@0.01"
        if mode == "noisy":
            settings = {**settings, "scale": args.noise_scale}
        windows = args.noisy_windows if rare else args.attack_windows
        decode = ("decode", WINDOW_TOKENS, windows * WINDOW_TOKENS - WINDOW_TOKENS + 1)  # exactly `windows` windows
        shapes = [decode] * (args.noisy_sessions if rare else 1) + ([] if rare else [("prefill", args.prompt, args.new_tokens)])  # fmt: skip
        began = time.perf_counter()
        cheat = swarm.start_node(clients.path, *middle, adapters=(adapter,))
        sessions = []
        try:
            misbehaviour = make_malicious(cheat, mode, seed=2, **settings)
            clients.call(wait_for_peers(model, {cheat.peer_id}))
            adapter_id = clients.call(model.resolve_adapter(adapter)) if mode == "wrong_adapter" else None
            longest = max(prompt + new for _, prompt, new in shapes)
            chain = clients.call(model.choose_chain(max_length=longest, exclude=honest_middle, adapter=adapter_id))
            if chain.peer_ids[1] != cheat.peer_id:
                raise RuntimeError(f"the chain {chain.peer_ids} does not go through the cheater")
            for kind, prompt, new in shapes:  # one chain: the audit of the first session bans the cheater from routing
                found = clients.call(cheated_session(model, chain, adapter_id, random_prompt(generator, prompt), new))
                sessions.append((kind, found))
        except Exception as error:  # a crash of the code under test is a finding: reported, the other modes run
            log(f"detection {name} failed: {error!r}")
            results[name] = {"error": repr(error)[:300]}
            continue
        finally:
            swarm.stop_node(cheat)
        tally = Counter()
        for kind, found in sessions:
            (first_windows, first_failed), (windows, failed) = found["per_hop"]
            tally.update({kind: windows, f"{kind}_failed": failed, "first": first_windows, "first_failed": first_failed})  # fmt: skip
            blamed = found["outcome"].blamed
            tally["right"] += [b.peer_id for b in blamed] == [cheat.peer_id] and blamed[0].hop == 1
        audited, failed = sum(tally[kind] for kind in KINDS), sum(tally[f"{kind}_failed"] for kind in KINDS)
        d = failed / audited if audited else 0.0
        flagged = 1 - (1 - p * d) ** FLAG_WINDOWS
        blamed = sessions[0][1]["outcome"].blamed
        results[name] = {
            "windows": audited, "failed": failed, "d_per_window": round(d, 4),
            "failed_by_kind": {kind: f"{tally[kind + '_failed']}/{tally[kind]}" for kind in KINDS if tally[kind]},
            f"p_flag_{FLAG_WINDOWS}_windows": round(flagged, 6),
            "expected_windows_to_flag": round(1 / (p * d), 1) if d > 0 else None,
            "meets_target": flagged >= FLAG_TARGET if not rare else None,
            "right_node_blamed": f"{tally['right']}/{len(sessions)}",
            "honest_first_hop_failed": f"{tally['first_failed']}/{tally['first']}",
            "audit_reasons": list(blamed[0].reasons) if blamed else [],
        }  # fmt: skip
        if mode == "noisy":  # a window of decode steps is noised when any of its 32 steps is
            results[name]["tampered_steps"] = f"{misbehaviour.tampered_steps}/{misbehaviour.steps}"
            results[name]["d_expected_decode"] = round(1 - (1 - settings["rate"]) ** WINDOW_TOKENS, 4)
        log(f"detection {name}: d = {failed}/{audited}, right node blamed in {tally['right']}/{len(sessions)} sessions "
            f"({time.perf_counter() - began:.0f} s)")  # fmt: skip
    return {"rate": p, "flag_windows": FLAG_WINDOWS, "modes": results}


# -- 3. commitment cost ------------------------------------------------------------------------------------------
async def timed_session(model, chain, commit: bool, prompt, new_tokens: int) -> list:
    max_length = prompt.shape[1] + new_tokens
    async with InferenceSession(model.swarm, chain, model.config, batch=1, max_length=max_length, commit=commit) as s:
        await model.generate(prompt, max_new_tokens=new_tokens, session=s)
    return s.timings[1:]  # decode steps (the first is the prompt's prefill)


def step_cost(args, clients: Clients, model, nodes, records) -> dict:
    chain = clients.call(model.choose_chain(max_length=WINDOW_TOKENS + args.timing_tokens))
    generator = torch.Generator().manual_seed(9)
    steps: dict[bool, list] = {True: [], False: []}
    log_s = commit_compute = 0.0
    for repeat in range(args.timing_repeats + 1):  # the first pair warms up
        for commit in (True, False) if repeat % 2 else (False, True):
            log_before, compute_before = WINDOW_LOG["seconds"], node_compute(nodes)
            prompt = random_prompt(generator, WINDOW_TOKENS)
            timings = clients.call(timed_session(model, chain, commit, prompt, args.timing_tokens))
            if repeat:
                steps[commit].extend(timings)
                if commit:
                    log_s += WINDOW_LOG["seconds"] - log_before
                    commit_compute += node_compute(nodes) - compute_before
    wall = {commit: statistics.median(t.wall_s for t in steps[commit]) for commit in steps}
    compute = {commit: statistics.median(t.compute_s for t in steps[commit]) for commit in steps}
    commitments, encoded = [len(r.commitment) for r in records], [len(r.to_bytes()) for r in records]
    return {
        "records_sized": len(records), "commitment_bytes_max": max(commitments),
        "commitment_bytes_mean": round(statistics.mean(commitments), 1), "signed_record_bytes_max": max(encoded),
        "signature_bytes": max(len(r.signature) for r in records), "commitment_meets_300_bytes": max(commitments) <= 300,
        "signed_record_meets_300_bytes": max(encoded) <= 300,
        "decode_step_ms_commit": round(1000 * wall[True], 3), "decode_step_ms_plain": round(1000 * wall[False], 3),
        "decode_step_commit_vs_plain": ratio(wall[True], wall[False], 4), "meets_1_02": wall[True] / wall[False] <= 1.02,
        "chain_compute_ms_per_step_commit": round(1000 * compute[True], 3),
        "chain_compute_ms_per_step_plain": round(1000 * compute[False], 3),
        "node_window_log_s_vs_node_compute_s": ratio(log_s, commit_compute), "decode_steps_timed_each": len(steps[True]),
    }  # fmt: skip


def commit_cost_4096(args) -> dict:
    """CPU time per window of a node's commitment work at hidden 4096 (float32, batch 1, 32 decode steps)."""
    from hivemind.utils.crypto import RSAPrivateKey

    hidden = 4096
    signer = RecordSigner(RSAPrivateKey())
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 1, hidden, generator=generator) for _ in range(WINDOW_TOKENS)]
    outputs = [torch.randn(1, 1, hidden, generator=generator) for _ in range(WINDOW_TOKENS)]
    per_step, finish, sign = [], [], []
    for window in range(args.commit_windows + 2):  # two warm-ups (sign tables, projections)
        committer, hasher = WindowCommitter(hidden), InputHasher()
        started = time.perf_counter()
        for step_input, step_output in zip(inputs, outputs, strict=True):
            hasher.update(step_input)
            committer.add(step_output)
        added = time.perf_counter()
        commitment, digest = committer.finish().to_bytes(), hasher.digest()
        finished = time.perf_counter()
        signer.sign(HopRecord(
            session_id="bench", hop=0, span_start=0, span_end=1, window=window, token_start=0,
            token_end=WINDOW_TOKENS, input_hash=digest, commitment=commitment, weights_hash="bench", adapter_hash="",
            codec="none", peer_id=signer.peer_id,
        ))  # fmt: skip
        if window >= 2:
            per_step.append((added - started) / WINDOW_TOKENS)
            finish.append(finished - added)
            sign.append(time.perf_counter() - finished)
    window_s = WINDOW_TOKENS * statistics.median(per_step) + statistics.median(finish) + statistics.median(sign)
    step_ms = 1000 * window_s / WINDOW_TOKENS
    result = {
        "commitment_bytes": len(commitment), "hash_and_add_us_per_step": round(1e6 * statistics.median(per_step), 1),
        "finish_ms_per_window": round(1000 * statistics.median(finish), 3),
        "sign_ms_per_window": round(1000 * statistics.median(sign), 3), "cpu_ms_per_window": round(1000 * window_s, 3),
        "cpu_ms_per_step_amortized": round(step_ms, 4), "est_gpu_step_ms_ESTIMATE": args.est_gpu_step_ms,
        "vs_est_gpu_step_ESTIMATE": ratio(step_ms, args.est_gpu_step_ms, 4),
    }  # fmt: skip
    if not args.skip_block_4096:
        block_ms = block_step_ms_4096(args.block_repeats)
        result["one_block_cpu_step_ms_measured"] = round(block_ms, 2)
        result["vs_one_block_cpu_step_measured"] = ratio(step_ms, block_ms, 5)
    return result


def block_step_ms_4096(repeats: int) -> float:
    """Median ms of one token through one Llama-7B-shaped decoder block (float32, this CPU, no KV history)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32)
    times = []
    with torch.inference_mode():
        layer = LlamaDecoderLayer(config, layer_idx=0).eval()
        hidden, positions = torch.randn(1, 1, 4096), torch.zeros(1, 1, dtype=torch.long)
        embeddings = LlamaRotaryEmbedding(config)(hidden, positions)
        for _ in range(repeats + 1):
            started = time.perf_counter()
            layer(hidden, position_embeddings=embeddings, position_ids=positions, attention_mask=None)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


# -- 4. audit compute --------------------------------------------------------------------------------------------
async def audited_generation(model, auditor: Auditor, prompt, new_tokens: int, nodes) -> dict:
    async with model.inference_session(max_length=prompt.shape[1] + new_tokens, prompt_tokens=prompt.shape[1]) as s:
        compute, started = node_compute(nodes), time.perf_counter()
        await model.generate(prompt, max_new_tokens=new_tokens, session=s)
        generated, served = time.perf_counter(), node_compute(nodes)
        outcome = await auditor.audit(s)
        audited = time.perf_counter()
    return {
        "serve_s": generated - started, "audit_s": audited - generated, "serve_compute": served - compute,
        "audit_compute": node_compute(nodes) - served, "windows": outcome.windows, "sampled": outcome.sampled,
        "failed": outcome.checks["failed"],
    }  # fmt: skip


def audit_cost(args, clients: Clients, model, nodes) -> dict:
    generator = torch.Generator().manual_seed(23)
    runs: dict[float, list] = {1.0: [], args.rate: []}
    auditors = {rate: Auditor(model, rate, random.Random(31)) for rate in runs}
    for index in range(args.audit_generations):
        for rate in (1.0, args.rate) if index % 2 else (args.rate, 1.0):
            prompt = random_prompt(generator, args.prompt)
            runs[rate].append(clients.call(audited_generation(model, auditors[rate], prompt, args.new_tokens, nodes)))
    result = {}
    for rate, items in runs.items():
        total = {key: sum(item[key] for item in items) for key in items[0]}
        result[f"p={rate:g}"] = {
            "audit_s_vs_serving_s": ratio(total["audit_s"], total["serve_s"]),
            "audit_compute_vs_serving_compute": ratio(total["audit_compute"], total["serve_compute"]),
            "windows_sampled": f"{total['sampled']}/{total['windows']}", "failed": total["failed"],
            "generations": len(items),
        }  # fmt: skip
    return result


# -- 5. majority of 3 --------------------------------------------------------------------------------------------
async def decode_run(model, prompt, new_tokens: int) -> tuple[float, dict | None]:
    """(decode tokens/s after the first token, the session's vote counts when it votes)."""
    async with model.inference_session(max_length=prompt.shape[1] + new_tokens) as session:
        times = [time.perf_counter() async for _ in model.stream(prompt, max_new_tokens=new_tokens, session=session)]
        verification = getattr(session, "verification", None)
    return (len(times) - 1) / (times[-1] - times[0]), verification


def majority_cost(args, clients: Clients, plain, voting) -> dict:
    generator = torch.Generator().manual_seed(41)
    tps: dict[str, list[float]] = {"off": [], "majority:3": []}
    checks: Counter = Counter()
    for repeat in range(args.majority_repeats + 1):  # the first pair warms up
        prompt = random_prompt(generator, 16)
        for name in ("off", "majority:3") if repeat % 2 else ("majority:3", "off"):
            model = plain if name == "off" else voting
            rate, verification = clients.call(decode_run(model, prompt, args.majority_tokens))
            if repeat:
                tps[name].append(rate)
                checks.update(verification["checks"] if verification else {})
    largest, agree = [0.0], majority.agree

    def recording_agree(first, second, tolerance):  # after the timed runs: it costs a pass over each pair
        if first.shape == second.shape:
            scale = max(first.float().pow(2).mean().sqrt().item(), 1e-12)
            largest[0] = max(largest[0], (first.float() - second.float()).abs().max().item() / scale)
        return agree(first, second, tolerance)

    majority.agree = recording_agree
    try:
        _, verification = clients.call(decode_run(voting, random_prompt(generator, 16), args.majority_tokens))
        checks.update(verification["checks"])
    finally:
        majority.agree = agree
    off, voted = statistics.median(tps["off"]), statistics.median(tps["majority:3"])
    return {
        "decode_tps_off": round(off, 2), "decode_tps_majority3": round(voted, 2),
        "majority3_vs_off": ratio(voted, off), "vote_checks": dict(checks),
        "honest_replica_max_diff_vs_rms": float(f"{largest[0]:.3g}"), "vote_tolerance": majority.TOLERANCE["float32"],
        "new_tokens": args.majority_tokens,
    }  # fmt: skip


# -- 6. known-answer canaries ------------------------------------------------------------------------------------
def hop_of(node) -> Hop:
    info = node.current_info()
    return Hop(node.peer_id, info.start_block, info.end_block)


def canary_figures(args, swarm: InProcessSwarm, clients: Clients, model, honest, middle: tuple[int, int]) -> dict:
    canaries = build_canaries(clients.path, count=args.canary_count, tokens=WINDOW_TOKENS, seed=7)
    checker = CanaryChecker(model, 1.0, canaries, random.Random(3))
    sent = failed = 0
    began = time.perf_counter()
    for _ in range(args.canary_rounds):
        for node in honest:
            reasons = clients.call(checker.failures(hop_of(node), checker.rng.randrange(canaries.count), "float32"))
            sent += 1
            failed += reasons is None or bool(reasons)
    check_s = (time.perf_counter() - began) / max(sent, 1)
    generator = torch.Generator().manual_seed(9)
    generation_s = []
    for _ in range(3):
        prompt = random_prompt(generator, WINDOW_TOKENS)
        began = time.perf_counter()
        clients.call(model.generate(prompt, max_new_tokens=args.canary_generation_tokens, do_sample=False))
        generation_s.append(time.perf_counter() - began)
    honest_figures = {
        "canaries_sent": sent, "failed_or_unanswered": failed, "check_ms_per_node": round(1000 * check_s, 1),
        "generation_ms": round(1000 * statistics.median(generation_s), 1),
        "check_per_node_vs_generation": ratio(check_s, statistics.median(generation_s)),
    }  # fmt: skip
    log(f"6. canaries, honest: {honest_figures}")
    modes = {}
    for name, mode, settings in CASES:
        if mode == "wrong_adapter":
            continue
        if mode == "noisy":
            settings = {**settings, "scale": args.noise_scale}
        cheat = swarm.start_node(clients.path, *middle)
        try:
            make_malicious(cheat, mode, seed=2, **settings)
            clients.call(wait_for_peers(model, {cheat.peer_id}))
            hop = hop_of(cheat)
            fails = sum(
                bool(clients.call(checker.failures(hop, checker.rng.randrange(canaries.count), "float32")))
                for _ in range(args.canary_attacks)
            )
            outcome = clients.call(checker.check(Chain(hops=(hop,))))
        except Exception as error:  # a crash of the code under test is a finding: reported, the other modes run
            log(f"canaries {name} failed: {error!r}")
            modes[name] = {"error": repr(error)[:300]}
            continue
        finally:
            swarm.stop_node(cheat)
        d = fails / args.canary_attacks
        modes[name] = {
            "failed": f"{fails}/{args.canary_attacks}", "d_per_canary": round(d, 4), "p_blamed_per_check": round(d * d, 4),
            "p_blamed_within_20_generations": round(1 - (1 - args.rate * d * d) ** 20, 4),
            "check_blamed_it": [blame.peer_id for blame in outcome.blamed] == [cheat.peer_id],
        }  # fmt: skip
        log(f"6. canaries, {name}: {modes[name]}")
    return {"count": canaries.count, "tokens": canaries.tokens, "rate": args.rate, "honest": honest_figures,
            "modes": modes}  # fmt: skip


# -- main --------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--layers", type=int, default=4, help="blocks of the tiny model (4 or more)")
    add("--hidden", type=int, default=64, help="hidden size of the tiny model")
    add("--honest-windows", type=int, default=10000, help="windows to check for false positives")
    add("--prompt", type=int, default=1000, help="prompt tokens of the honest (and prefill) generations")
    add("--new-tokens", type=int, default=24, help="new tokens of the honest (and prefill) generations")
    add("--rate", type=float, default=0.05, help="the sampled audit rate p")
    add("--attack-windows", type=int, default=32, help="windows of each cheated decode session")
    add("--noisy-windows", type=int, default=62, help="windows of each noisy@0.01 session (62 at most)")
    add("--noisy-sessions", type=int, default=8, help="decode sessions of noisy@0.01")
    add("--noise-scale", type=float, default=0.1, help="noisy mode's noise, times each token's RMS")
    add("--timing-repeats", type=int, default=6, help="commit / plain session pairs timed")
    add("--timing-tokens", type=int, default=128, help="decode steps of each timed session")
    add("--commit-windows", type=int, default=30, help="hidden-4096 windows committed and signed")
    add("--block-repeats", type=int, default=5, help="timed steps of the hidden-4096 block")
    add("--skip-block-4096", action="store_true", help="do not build the 800 MB hidden-4096 block")
    add("--est-gpu-step-ms", type=float, default=2.0, help="ESTIMATED decode step of a GPU node at hidden 4096 "
        "(8 Llama-7B blocks in bfloat16 on an H100: 3.2 GB of weights at ~3 TB/s, plus kernel launches)")  # fmt: skip
    add("--audit-generations", type=int, default=10, help="explicit audited generations per rate")
    add("--majority-repeats", type=int, default=3, help="majority / off pairs timed")
    add("--majority-tokens", type=int, default=64, help="new tokens of each majority / off run")
    add("--canary-count", type=int, default=8, help="canaries of 32 tokens built for run 6")
    add("--canary-rounds", type=int, default=30, help="canaries sent to each honest node")
    add("--canary-attacks", type=int, default=16, help="canaries sent to each cheater")
    add(
        "--canary-generation-tokens", type=int, default=32, help="new tokens of the generation a check is timed against"
    )
    args = parser.parse_args()
    if args.layers < 4:
        parser.error("--layers must be 4 or more (the middle span needs two blocks for skip_block)")
    args.noisy_windows = min(args.noisy_windows, 62)  # positions within the tiny model's 2048
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    WindowLog.add, WindowLog.take = timed(WindowLog.add), timed(WindowLog.take)
    first = max(1, args.layers // 4)  # the middle span has two blocks or more: skip_block skips one after its first
    spans = [(0, first), (first, args.layers - first), (args.layers - first, args.layers)]
    with tempfile.TemporaryDirectory(prefix="nesa-bench-verify-") as workdir:
        spec = TinyModelSpec(layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2, intermediate=2 * args.hidden, seed=1)  # fmt: skip
        path = str(init_tiny_model(Path(workdir) / "tiny-llama", spec))
        adapter = str(save_random_adapter(path, Path(workdir) / "adapter", seed=4))
        swarm, clients = InProcessSwarm(), None
        try:
            honest = [swarm.start_node(path, start, end, adapters=(adapter,)) for start, end in spans for _ in range(COPIES)]  # fmt: skip
            wanted = {node.peer_id for node in honest}
            log(f"{len(honest)} nodes up on spans {spans} ({time.perf_counter() - started:.0f} s)")
            clients = Clients(path, swarm.initial_peers)
            audited = {codec: clients.connect(wanted, verify="audit:1.0", compression=codec) for codec in CODECS}
            plain = clients.connect(wanted, verify="off", compression="none")
            voting = clients.connect(wanted, verify="majority:3", compression="none")
            majority_figures = majority_cost(args, clients, plain, voting)
            log(f"5. majority of 3: {majority_figures}")
            audit_figures = audit_cost(args, clients, audited["none"], honest)
            log(f"4. audit cost: {audit_figures}")
            fp_figures, audit_figures["generate_p=1"], records = false_positives(args, clients, audited, honest)
            log(f"1. false positives: {fp_figures}")
            commit_figures = step_cost(args, clients, audited["none"], honest, records)
            commit_figures["hidden_4096"] = commit_cost_4096(args)
            log(f"3. commitment cost: {commit_figures}")
            detection_figures = detection(args, swarm, clients, audited["none"], adapter, spans[1])
            canary_results = canary_figures(args, swarm, clients, plain, honest, spans[1])
        finally:
            if clients is not None:
                clients.close()
            swarm.close()
    print(json.dumps({
        "bench": "verify", "layers": args.layers, "hidden": args.hidden, "spans": spans, "nodes_per_span": COPIES,
        "false_positives": fp_figures, "detection": detection_figures, "commitment": commit_figures,
        "audit_compute": audit_figures, "majority": majority_figures, "canaries": canary_results, "seconds": round(time.perf_counter() - started, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
