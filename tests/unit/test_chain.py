import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.errors import NoRouteError
from nesa_node.routing.chain import ChainRequest, NodeView, SwarmSnapshot, select_chain, usable_nodes


def node(peer: str, start: int, end: int, **kwargs) -> NodeView:
    return NodeView(peer_id=peer, start_block=start, end_block=end, cache_tokens_left=10_000, **kwargs)


def test_fewest_hops_wins_then_latency():
    snapshot = SwarmSnapshot(
        num_blocks=8,
        nodes=(
            node("a", 0, 4),
            node("b", 4, 8),
            node("c", 0, 2),
            node("d", 2, 8, rtt_ms=0.1),
            node("e", 0, 8, rtt_ms=90),
        ),
    )
    assert select_chain(snapshot, ChainRequest()).peer_ids == ("e",)
    without_e = ChainRequest(exclude=frozenset({"e"}))
    # a->b and c->d both take two hops; c->d has the lower latency (d measured at 0.1 ms)
    assert select_chain(snapshot, without_e).peer_ids == ("c", "d")


def test_missing_blocks_are_named():
    snapshot = SwarmSnapshot(num_blocks=10, nodes=(node("a", 0, 3), node("b", 5, 10), node("c", 3, 5, online=False)))
    with pytest.raises(NoRouteError, match="blocks 3-4"):
        select_chain(snapshot, ChainRequest())


def test_nodes_without_cache_room_are_skipped():
    snapshot = SwarmSnapshot(num_blocks=2, nodes=(node("a", 0, 2),))
    assert select_chain(snapshot, ChainRequest(max_length=10_000)).peer_ids == ("a",)
    with pytest.raises(NoRouteError):
        select_chain(snapshot, ChainRequest(batch=2, max_length=10_000))


def test_nodes_announcing_a_smaller_step_limit_than_the_step_asks_are_skipped():
    """A replacement found while a prompt's part is under way must take that part whole (its own step limit, as it
    announces it; 0: none announced, not skipped)."""
    snapshot = SwarmSnapshot(
        num_blocks=2, nodes=(node("a", 0, 2, max_step_tokens=100, rtt_ms=0.1), node("b", 0, 2, rtt_ms=50))
    )
    assert select_chain(snapshot, ChainRequest(step_tokens=100)).peer_ids == ("a",)
    assert select_chain(snapshot, ChainRequest(step_tokens=101)).peer_ids == ("b",)
    unannounced = SwarmSnapshot(num_blocks=2, nodes=(node("a", 0, 2, max_step_tokens=100),))
    with pytest.raises(NoRouteError):
        select_chain(unannounced, ChainRequest(step_tokens=101))
    # a node announcing none is held to the client's floor (unannounced_tokens): it takes a part within it only
    floor = ChainRequest(step_tokens=101, unannounced_tokens=256)
    assert select_chain(snapshot, floor).peer_ids == ("b",)
    assert select_chain(snapshot, dataclasses.replace(floor, step_tokens=256)).peer_ids == ("b",)
    with pytest.raises(NoRouteError):
        select_chain(snapshot, dataclasses.replace(floor, step_tokens=257))
    assert list(usable_nodes(snapshot, dataclasses.replace(floor, step_tokens=257))) == [False, False]
    assert list(usable_nodes(snapshot, floor)) == [False, True]
    assert list(usable_nodes(snapshot, dataclasses.replace(floor, unannounced_tokens=0))) == [False, True]


spans = st.lists(st.tuples(st.integers(0, 11), st.integers(1, 6), st.booleans()), max_size=14)


@given(spans)
def test_a_returned_chain_covers_every_block_contiguously_with_usable_nodes(raw):
    nodes = tuple(
        node(f"p{index}", start, min(start + length, 12), online=up) for index, (start, length, up) in enumerate(raw)
    )
    snapshot = SwarmSnapshot(num_blocks=12, nodes=nodes)
    reachable, frontier = {0}, [0]  # block boundaries reachable from 0 through online spans
    while frontier:
        position = frontier.pop()
        for n in nodes:
            if n.online and n.start_block == position and n.end_block not in reachable:
                reachable.add(n.end_block)
                frontier.append(n.end_block)
    try:
        chain = select_chain(snapshot, ChainRequest())
    except NoRouteError:
        assert 12 not in reachable
        return
    position = 0
    by_id = {n.peer_id: n for n in nodes}
    for hop in chain.hops:
        assert hop.start_block == position and by_id[hop.peer_id].online
        position = hop.end_block
    assert position == 12
    assert len(set(chain.peer_ids)) == len(chain.peer_ids)


def test_a_sub_range_request_replaces_exactly_a_lost_span():
    from nesa_node.routing.chain import ChainRequest, NodeView, SwarmSnapshot, select_chain

    nodes = (
        NodeView("a", 0, 1, cache_tokens_left=100),
        NodeView("b", 1, 3, cache_tokens_left=100),
        NodeView("c", 1, 2, cache_tokens_left=100),
        NodeView("d", 2, 3, cache_tokens_left=100),
        NodeView("e", 3, 4, cache_tokens_left=100),
        NodeView("f", 0, 4, cache_tokens_left=100),  # covers the range but starts outside it: unusable here
    )
    snapshot = SwarmSnapshot(num_blocks=4, nodes=nodes)
    chain = select_chain(snapshot, ChainRequest(start_block=1, end_block=3, exclude=frozenset({"b"})))
    assert [(hop.peer_id, hop.start_block, hop.end_block) for hop in chain.hops] == [("c", 1, 2), ("d", 2, 3)]
    with pytest.raises(NoRouteError, match="block 1"):  # f covers block 1 but cannot start a chain there
        select_chain(snapshot, ChainRequest(start_block=1, end_block=3, exclude=frozenset({"b", "c"})))
    with pytest.raises(NoRouteError, match="blocks 1"):
        select_chain(snapshot, ChainRequest(start_block=1, end_block=3, exclude=frozenset({"b", "c", "f"})))
