"""Chain selection with eq. 18 (select_chain with params): exactness against exhaustive search, coverage, the beam
search, the batched search, alternatives, and what is skipped."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.errors import NoRouteError
from nesa_node.routing.chain import select_chain, select_chains, usable_nodes
from nesa_node.routing.cost import RoutingParams, append_cost, chain_cost, request_base
from nesa_node.routing.snapshot import ChainRequest, CostBreakdown, Hop, NodeView, SwarmSnapshot

REGIONS = ((1.0, 30.0), (30.0, 2.0))


@st.composite
def swarms(draw, max_nodes=8, max_blocks=6):
    blocks = draw(st.integers(1, max_blocks))
    nodes = []
    for index in range(draw(st.integers(1, max_nodes))):
        start = draw(st.integers(0, blocks - 1))
        end = draw(st.integers(start + 1, blocks))
        nodes.append(
            NodeView(
                f"p{index}",
                start,
                end,
                online=draw(st.booleans()) or draw(st.booleans()),  # 3 in 4 online
                inference_tps=draw(st.floats(1.0, 100.0)),
                cache_tokens_left=draw(st.sampled_from([0, 10_000])),
                region=draw(st.integers(-1, 1)),
                access_ms=draw(st.floats(0.0, 20.0)),
                bandwidth_mbps=draw(st.floats(5.0, 1000.0)),
                load=draw(st.floats(0.0, 0.9)),
                reliability=draw(st.floats(0.0, 1.0)),
                rtt_ms=draw(st.none() | st.floats(1.0, 100.0)),
            )
        )
    return SwarmSnapshot(blocks, tuple(nodes), hidden_size=4096, region_latency_ms=REGIONS)


requests = st.builds(
    ChainRequest,
    max_length=st.sampled_from([0, 100]),
    partial_spans=st.booleans(),
    prompt_tokens=st.integers(0, 500),
    new_tokens=st.integers(0, 50),
    client_region=st.integers(-1, 1),
)
params = st.builds(RoutingParams, st.floats(0.25, 3.0), st.floats(0.25, 3.0), st.floats(0.0, 3.0))


def exhaustive(snapshot: SwarmSnapshot, request: ChainRequest, params: RoutingParams) -> float:
    """Least eq. 18 cost over every chain (depth-first over hops, cutting prefixes that already cost more than
    the best complete chain: costs are never negative)."""
    usable = usable_nodes(snapshot, request)
    terms = request_base(snapshot, request).terms(params)
    blocks, best = snapshot.num_blocks, [math.inf]

    def extend(block, previous, spent):
        if spent >= best[0]:
            return
        if block == blocks:
            best[0] = min(best[0], spent + float(terms.client_leg[previous[-1]]))
            return
        for index, node in enumerate(snapshot.nodes):
            if not usable[index] or index == previous[-1] or not node.start_block <= block < node.end_block:
                continue
            if not request.partial_spans and node.start_block != block:
                continue
            stops = range(block + 1, node.end_block + 1) if request.partial_spans else (node.end_block,)
            for stop in stops:
                cost = append_cost(terms, previous, index, stop - block, params).total
                extend(stop, previous + [index], spent + cost)

    extend(0, [-2], 0.0)
    return best[0]


def check_chain(snapshot: SwarmSnapshot, request: ChainRequest, chain) -> None:
    """Every block of the range exactly once, in order, each hop inside a usable node's span."""
    by_id = {node.peer_id: node for node in snapshot.nodes}
    usable = usable_nodes(snapshot, request)
    index = {node.peer_id: i for i, node in enumerate(snapshot.nodes)}
    position = request.start_block
    for hop in chain.hops:
        node = by_id[hop.peer_id]
        assert hop.start_block == position < hop.end_block
        assert node.start_block <= hop.start_block and hop.end_block <= node.end_block
        assert usable[index[hop.peer_id]]
        if not request.partial_spans:
            assert (hop.start_block, hop.end_block) == (node.start_block, node.end_block)
        position = hop.end_block
    assert position == (snapshot.num_blocks if request.end_block is None else request.end_block)


@settings(max_examples=150, deadline=None)
@given(swarms(), requests, params)
def test_the_exact_search_equals_exhaustive_search(snapshot, request, params):
    best = exhaustive(snapshot, request, params)
    try:
        chain = select_chain(snapshot, request, params=params)
    except NoRouteError:
        assert best == math.inf
        return
    check_chain(snapshot, request, chain)
    assert chain.cost.total == pytest.approx(best, rel=1e-9)
    assert chain.cost == chain_cost(snapshot, request, params, chain.hops)


@settings(max_examples=60, deadline=None)
@given(swarms(max_nodes=6, max_blocks=5), requests, params, st.integers(1, 2))
def test_a_wide_beam_equals_exhaustive_search_for_a_longer_window(snapshot, request, params, window):
    params = RoutingParams(params.gamma, params.beta, params.alpha, window=window, beam_width=100_000)
    best = exhaustive(snapshot, request, params)
    try:
        chain = select_chain(snapshot, request, params=params)
    except NoRouteError:
        assert best == math.inf
        return
    check_chain(snapshot, request, chain)
    assert chain.cost.total == pytest.approx(best, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(swarms(max_nodes=30, max_blocks=12), requests, params, st.integers(0, 2), st.integers(1, 4))
def test_chains_cover_every_block_once_in_order(snapshot, request, params, window, width):
    params = RoutingParams(params.gamma, params.beta, params.alpha, window=window, beam_width=width)
    try:
        chain = select_chain(snapshot, request, params=params)
    except NoRouteError:
        assert exhaustive_reachable(snapshot, request) is False
        return
    check_chain(snapshot, request, chain)


def exhaustive_reachable(snapshot, request) -> bool:
    usable, reached, frontier = usable_nodes(snapshot, request), {0}, [0]
    while frontier:
        block = frontier.pop()
        for index, node in enumerate(snapshot.nodes):
            if usable[index] and node.start_block <= block < node.end_block:
                if not request.partial_spans and node.start_block != block:
                    continue
                targets = range(block + 1, node.end_block + 1) if request.partial_spans else (node.end_block,)
                for target in set(targets) - reached:
                    reached.add(target)
                    frontier.append(target)
    return snapshot.num_blocks in reached


@settings(max_examples=40, deadline=None)
@given(swarms(max_nodes=20, max_blocks=10), requests, st.lists(params, min_size=1, max_size=5))
def test_the_batched_search_picks_chains_of_the_same_cost(snapshot, request, many):
    batched = select_chains(snapshot, request, many)
    for params, result in zip(many, batched, strict=True):
        try:
            single = select_chain(snapshot, request, params=params)
        except NoRouteError:
            assert isinstance(result, NoRouteError)
            continue
        check_chain(snapshot, request, result)
        assert result.cost.total == pytest.approx(single.cost.total, rel=1e-9)


def line(count: int, blocks: int = 4, **kwargs) -> SwarmSnapshot:
    nodes = tuple(
        NodeView(f"n{i}", 0, blocks, inference_tps=10.0 + i, cache_tokens_left=100, **kwargs) for i in range(count)
    )
    return SwarmSnapshot(blocks, nodes)


def test_alternatives_are_node_disjoint_and_best_first():
    snapshot = line(4)
    chain = select_chain(snapshot, ChainRequest(alternatives=5), params=RoutingParams())
    chains = (chain, *chain.alternatives)
    assert len(chains) == 4  # one per node: the fifth alternative does not exist
    used = [peer for found in chains for peer in found.peer_ids]
    assert len(used) == len(set(used))
    costs = [found.cost.total for found in chains]
    assert costs == sorted(costs)
    assert chain.peer_ids == ("n3",)  # the fastest


def test_offline_draining_excluded_and_cacheless_nodes_are_skipped():
    nodes = (
        NodeView("off", 0, 4, online=False, inference_tps=1000, cache_tokens_left=100),
        NodeView("drain", 0, 4, draining=True, inference_tps=1000, cache_tokens_left=100),
        NodeView("full", 0, 4, inference_tps=1000, cache_tokens_left=5),
        NodeView("banned", 0, 4, inference_tps=1000, cache_tokens_left=100),
        NodeView("slow", 0, 4, inference_tps=1, cache_tokens_left=100),
    )
    request = ChainRequest(max_length=10, exclude=frozenset({"banned"}))
    for partial in (False, True):
        chain = select_chain(SwarmSnapshot(4, nodes), replace(request, partial_spans=partial), params=RoutingParams())
        assert chain.peer_ids == ("slow",)
        assert select_chain(SwarmSnapshot(4, nodes), replace(request, partial_spans=partial)).peer_ids == ("slow",)


def test_missing_blocks_are_named_with_params_too():
    nodes = (NodeView("a", 0, 3, cache_tokens_left=10), NodeView("b", 4, 6, cache_tokens_left=10))
    for partial in (False, True):
        with pytest.raises(NoRouteError, match="blocks 3"):
            select_chain(SwarmSnapshot(6, nodes), ChainRequest(partial_spans=partial), params=RoutingParams())


def test_partial_spans_use_part_of_a_span_and_whole_spans_do_not():
    # b is fast on blocks 2-4 but its span starts at 0; a is slow and holds everything
    nodes = (
        NodeView("a", 0, 4, inference_tps=1.0, cache_tokens_left=10),
        NodeView("b", 0, 2, inference_tps=1000.0, cache_tokens_left=10),
        NodeView("c", 1, 4, inference_tps=1000.0, cache_tokens_left=10),
    )
    snapshot = SwarmSnapshot(4, nodes)
    whole = select_chain(snapshot, ChainRequest(), params=RoutingParams())
    assert whole.peer_ids == ("a",)
    partial = select_chain(snapshot, ChainRequest(partial_spans=True), params=RoutingParams())
    assert [(h.peer_id, h.start_block, h.end_block) for h in partial.hops] in (
        [("b", 0, 1), ("c", 1, 4)],
        [("b", 0, 2), ("c", 2, 4)],
    )
    sub = select_chain(snapshot, ChainRequest(partial_spans=True, start_block=2, end_block=3), params=RoutingParams())
    assert [(h.peer_id, h.start_block, h.end_block) for h in sub.hops] == [("c", 2, 3)]


def test_the_default_rule_is_unchanged_and_partial_requests_use_eq_18():
    nodes = (
        NodeView("one", 0, 2, cache_tokens_left=10, rtt_ms=200.0),
        NodeView("a", 0, 1, cache_tokens_left=10, rtt_ms=1.0),
        NodeView("b", 1, 2, cache_tokens_left=10, rtt_ms=1.0),
    )
    snapshot = SwarmSnapshot(2, nodes)
    legacy = select_chain(snapshot, ChainRequest())
    assert legacy.peer_ids == ("one",) and legacy.cost is None  # fewest hops first
    assert select_chain(snapshot, ChainRequest(partial_spans=True)).peer_ids == ("a", "b")
    assert select_chain(snapshot, ChainRequest(), rng=np.random.default_rng(0)).peer_ids == ("one",)


def test_cost_breakdown_adds_up():
    total = CostBreakdown(1.0, 2.0, 3.0) + CostBreakdown(0.5, 0.5, 0.5)
    assert (total.transfer, total.load, total.reliability, total.total) == (1.5, 2.5, 3.5, 7.5)
    assert Hop("a", 0, 1) == Hop("a", 0, 1, ("none",))


@settings(max_examples=60, deadline=None)
@given(swarms(), requests, params)
def test_the_region_bounds_rule_out_only_losers(snapshot, request, params):
    """The bound-and-prune path of the exact search (taken on big swarms) gives the exhaustive optimum too."""
    from nesa_node.routing import search

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(search, "DIRECT_PAIRS", 0)
        try:
            chain = select_chain(snapshot, request, params=params)
        except NoRouteError:
            assert exhaustive(snapshot, request, params) == math.inf
            return
    assert chain.cost.total == pytest.approx(exhaustive(snapshot, request, params), rel=1e-9)


@settings(max_examples=80, deadline=None)
@given(swarms(), requests, params, st.data())
def test_a_request_naming_an_adapter_routes_only_through_nodes_holding_it(snapshot, request, params, data):
    """The chain for adapter "a" is the chain the same search finds on the swarm of the nodes holding "a" alone."""
    holders = data.draw(st.sets(st.sampled_from([node.peer_id for node in snapshot.nodes])))
    snapshot = replace(snapshot, nodes=tuple(
        replace(node, adapters=frozenset({"a", "b"} if node.peer_id in holders else {"b"})) for node in snapshot.nodes
    ))  # fmt: skip
    only = replace(snapshot, nodes=tuple(node for node in snapshot.nodes if node.peer_id in holders))
    request = replace(request, adapter="a")

    def chain_or_none(swarm, wanted):
        try:
            return select_chain(swarm, wanted, params=params)
        except NoRouteError:
            return None

    chain, expected = chain_or_none(snapshot, request), chain_or_none(only, replace(request, adapter=None))
    assert (chain is None) == (expected is None)
    if chain is not None:
        assert set(chain.peer_ids) <= holders
        check_chain(snapshot, request, chain)
        if chain.cost is not None:
            assert chain.cost.total == pytest.approx(expected.cost.total)


@settings(max_examples=60, deadline=None)
@given(swarms(max_nodes=6, max_blocks=5), requests, params, st.data())
def test_a_sendable_adapter_costs_its_transfer_and_holding_it_never_costs_more(snapshot, request, params, data):
    """A client that holds the adapter may use any node, paying to send it where it is missing: the exact search
    still equals the exhaustive one, and one more node holding the adapter never makes the best chain dearer."""
    names = [node.peer_id for node in snapshot.nodes]
    holders = data.draw(st.sets(st.sampled_from(names)))
    extra = data.draw(st.sampled_from(names))
    request = replace(request, adapter="a", adapter_block_bytes=data.draw(st.floats(1e3, 1e8)))

    def holding(peers):
        return replace(snapshot, nodes=tuple(
            replace(node, adapters=frozenset({"a"}) if node.peer_id in peers else frozenset()) for node in snapshot.nodes
        ))  # fmt: skip

    fewer, more = holding(holders), holding(holders | {extra})
    best = exhaustive(fewer, request, params)
    assert usable_nodes(fewer, request).sum() == usable_nodes(fewer, replace(request, adapter=None)).sum()
    if math.isinf(best):
        return
    chain = select_chain(fewer, request, params=params)
    assert chain.cost.total == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert exhaustive(more, request, params) <= best * (1 + 1e-9) + 1e-9


def test_a_fetched_adapter_routes_only_through_nodes_that_can_get_it():
    """Nodes lacking the adapter are usable when the request can get it to them: any node when the client sends
    it (adapter_reachable None), else only those whose blocks the holders cover."""
    nodes = (NodeView("holder", 0, 2, adapters=frozenset({"a"}), cache_tokens_left=10_000),
             NodeView("near", 0, 2, cache_tokens_left=10_000), NodeView("far", 2, 4, cache_tokens_left=10_000))  # fmt: skip
    snapshot = SwarmSnapshot(4, nodes)
    fetched = ChainRequest(adapter="a", adapter_block_bytes=1000.0, adapter_reachable=frozenset({"near"}))
    assert list(usable_nodes(snapshot, fetched)) == [True, True, False]
    assert list(usable_nodes(snapshot, replace(fetched, adapter_reachable=None))) == [True, True, True]
    assert list(usable_nodes(snapshot, replace(fetched, adapter_block_bytes=0.0))) == [True, False, False]
