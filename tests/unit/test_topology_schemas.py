"""Precomputed sharding schemas (nesa_node.topology.schemas, balancing.best_placement): classes, classifier, apply."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.routing.scenarios import SCENARIOS, City, ClusterJoin, LinkDegradation, Outage
from nesa_node.routing.simulate import Simulator
from nesa_node.routing.snapshot import NodeView, SwarmSnapshot
from nesa_node.sharding.balancing import (
    best_placement,
    join_span,
    placement_from_snapshot,
    served_throughput,
)
from nesa_node.topology.graph import swarm_graph
from nesa_node.topology.homology import diagrams, features
from nesa_node.topology.schemas import (
    CLASSIFIER_COORDINATES,
    Schema,
    SchemaBook,
    apply_schema,
    book_from_dict,
    book_to_dict,
    bottleneck_throughput,
    build_book,
    classify,
    k_medoids,
    silhouette,
)

# one 200-node global swarm (cities 0-6 Europe, 7-11 North America, 12-16 Asia) in five topological states
NODES = 200
BASE = replace(SCENARIOS["global-1000"], name="global-200-states", num_nodes=NODES, duration_s=3 * 3600)
EUROPE, AMERICA, ASIA = tuple(range(7)), tuple(range(7, 12)), tuple(range(12, 17))
STATES = {
    "all up": {},
    "asia down": {"outages": (Outage(ASIA, 0.0),)},
    "europe down": {"outages": (Outage(EUROPE, 0.0),)},
    "cluster joined": {"joins": (ClusterJoin(City("Sao Paulo", -23.5, -46.6), NODES // 5, 0.0),)},
    "transatlantic slow": {"degradations": (LinkDegradation(EUROPE, AMERICA, 4.0, 0.0),)},
}
BOOK_PER_STATE = 6  # snapshots per state in the book: times 300 s + 600 s * i, remeasure seeds 0..5
HELD_OUT_PER_STATE = 3  # other times (390 s + 900 s * i) and other remeasure seeds (1000 + i)
ACCURACY_BAR = 0.9  # held-out snapshots whose class's schema is picked (measured 1.0 here; 0.8-1.0 over seeds)


def topology(snapshot):
    return diagrams(swarm_graph(snapshot))


@pytest.fixture(scope="module")
def swarm():
    simulators = [Simulator(replace(BASE, **events)) for events in STATES.values()]
    book_snapshots = [
        sim.snapshot(300.0 + 600.0 * i, remeasure_seed=i) for sim in simulators for i in range(BOOK_PER_STATE)
    ]
    held_out = [
        sim.snapshot(390.0 + 900.0 * i, remeasure_seed=1000 + i)
        for sim in simulators
        for i in range(HELD_OUT_PER_STATE)
    ]
    book_diagrams = [topology(snapshot) for snapshot in book_snapshots]
    book = build_book(book_snapshots, rng=np.random.default_rng(0), snapshot_diagrams=book_diagrams)
    vectors = [features(topology(snapshot)) for snapshot in held_out]
    best = [bottleneck_throughput(best_placement(placement_from_snapshot(snapshot))) for snapshot in held_out]
    return {
        "book": book,
        "book_snapshots": book_snapshots,
        "book_diagrams": book_diagrams,
        "book_labels": [classify(book, features(entry))[0] for entry in book_diagrams],
        "held_out": held_out,
        "vectors": vectors,
        "best_tps": np.array(best),
        "state": np.repeat(np.arange(len(STATES)), HELD_OUT_PER_STATE),
    }


def test_the_book_finds_the_simulated_states(swarm):
    book = swarm["book"]
    assert len(book.schemas) == len(STATES)  # the silhouette chose the number of classes
    labels = np.array(swarm["book_labels"]).reshape(len(STATES), BOOK_PER_STATE)
    assert all(len(set(row)) == 1 for row in labels.tolist())  # each state is one class ...
    assert len(set(labels[:, 0].tolist())) == len(STATES)  # ... and the classes differ
    assert all(schema.fit > 0.95 and schema.snapshots == BOOK_PER_STATE for schema in book.schemas)


def test_held_out_snapshots_get_their_states_schema(swarm):
    expected = np.array(swarm["book_labels"]).reshape(len(STATES), BOOK_PER_STATE)[:, 0]
    picked = np.array([classify(swarm["book"], vector)[0] for vector in swarm["vectors"]])
    accuracy = float(np.mean(picked == expected[swarm["state"]]))
    print(f"held-out accuracy {accuracy:.3f} over {picked.size} snapshots")
    assert accuracy >= ACCURACY_BAR


def test_picked_schema_is_within_5_percent_of_recomputing(swarm):
    ratios = []
    for snapshot, vector, best in zip(swarm["held_out"], swarm["vectors"], swarm["best_tps"], strict=True):
        assignment = apply_schema(snapshot, swarm["book"], feature_vector=vector)
        assert not assignment.recomputed
        ratios.append(assignment.throughput_tps / best)
    ratios = np.array(ratios)
    print(f"picked schema / recomputed bottleneck throughput: mean {ratios.mean():.4f}, worst {ratios.min():.4f}")
    assert ratios.min() >= 0.95


def test_a_wrong_states_schema_costs_throughput(swarm):
    """The classifier matters: Europe's nodes placed by the all-up schema leave Europe's share of the model thin."""
    book, labels = swarm["book"], np.array(swarm["book_labels"]).reshape(len(STATES), BOOK_PER_STATE)[:, 0]
    index = int(np.flatnonzero(swarm["state"] == list(STATES).index("europe down"))[0])
    # a book holding only the all-up schema, with no radius: it applies that schema to any snapshot
    all_up = replace(book, schemas=(book.schemas[labels[0]],), radius=math.inf)
    vector = swarm["vectors"][index]
    wrong = apply_schema(swarm["held_out"][index], all_up, feature_vector=vector).throughput_tps
    right = apply_schema(swarm["held_out"][index], book, feature_vector=vector).throughput_tps
    assert wrong < 0.9 * swarm["best_tps"][index] < right
    # with the book's radius, Europe down is far from the all-up class: recomputed, not the wrong schema
    guarded = apply_schema(swarm["held_out"][index], replace(all_up, radius=book.radius), feature_vector=vector)
    assert guarded.far and guarded.throughput_tps > 0.9 * swarm["best_tps"][index]


def test_same_seed_same_book_and_assignment(swarm):
    again = build_book(swarm["book_snapshots"], rng=np.random.default_rng(0), snapshot_diagrams=swarm["book_diagrams"])
    for first, second in zip(swarm["book"].schemas, again.schemas, strict=True):
        assert first.lengths == second.lengths and np.array_equal(first.centroid, second.centroid)
        assert all(np.array_equal(a, b) for a, b in zip(first.starts, second.starts, strict=True))
    snapshot, vector = swarm["held_out"][0], swarm["vectors"][0]
    assert apply_schema(snapshot, swarm["book"], feature_vector=vector).starts == (
        apply_schema(snapshot, again, feature_vector=vector).starts
    )


def test_relabelling_nodes_relabels_the_assignment_only(swarm):
    snapshot = swarm["held_out"][4]
    order = np.random.default_rng(1).permutation(len(snapshot.nodes))
    renamed = tuple(replace(snapshot.nodes[index], peer_id=f"peer-{position}") for position, index in enumerate(order))
    new_name = {snapshot.nodes[index].peer_id: f"peer-{position}" for position, index in enumerate(order)}
    relabelled = replace(snapshot, nodes=renamed)
    first = apply_schema(snapshot, swarm["book"])  # features computed inside, from each snapshot's own diagrams
    second = apply_schema(relabelled, swarm["book"])
    assert first.label == second.label and first.distance == pytest.approx(second.distance, abs=1e-9)
    assert {new_name[peer]: start for peer, start in first.starts.items()} == second.starts


def one_class_book(num_blocks: int, lengths: list[int], starts: list[list[int]]) -> SchemaBook:
    centroid = np.zeros(len(CLASSIFIER_COORDINATES))
    schema = Schema(0, centroid, tuple(lengths), tuple(np.array(value, np.int64) for value in starts), 1.0, 1.0, 1)
    return SchemaBook(num_blocks, np.ones(num_blocks), np.ones(len(CLASSIFIER_COORDINATES)), (schema,))


@st.composite
def snapshots_and_books(draw):
    """A small swarm and a one-class book with an arbitrary template (any starts, some lengths missing)."""
    blocks = draw(st.integers(2, 12))
    count = draw(st.integers(1, 14))
    nodes = []
    for index in range(count):
        length = draw(st.integers(1, blocks))
        start = draw(st.integers(0, blocks - length))
        tps = draw(st.floats(0.1, 50.0))
        nodes.append(NodeView(f"n{index}", start, start + length, inference_tps=tps, region=draw(st.integers(0, 2))))
    known = sorted(draw(st.sets(st.integers(1, blocks), max_size=4)))
    starts = [draw(st.lists(st.integers(0, blocks - length), min_size=0, max_size=6)) for length in known]
    return SwarmSnapshot(blocks, tuple(nodes)), one_class_book(blocks, known, starts)


@settings(max_examples=60, deadline=None)
@given(snapshots_and_books())
def test_an_applied_schema_never_leaves_a_block_unserved_that_recomputing_serves(case):
    snapshot, book = case
    vector = np.zeros(max(CLASSIFIER_COORDINATES) + 1)
    assignment = apply_schema(snapshot, book, feature_vector=vector)
    placement = assignment.placement
    _, servers = served_throughput(placement.num_blocks, placement.start, placement.length, placement.throughput)
    best = best_placement(placement_from_snapshot(snapshot))
    _, best_servers = served_throughput(best.num_blocks, best.start, best.length, best.throughput)
    if np.all(best_servers >= 1):
        assert np.all(servers >= 1)
    assert np.array_equal(np.sort(placement.length), np.sort(best.length))  # same nodes, same span lengths


def test_best_placement_beats_the_joining_rule_and_the_current_spans():
    snapshot = Simulator(replace(BASE, **STATES["asia down"])).snapshot(600.0)
    placement = placement_from_snapshot(snapshot)
    start, served = placement.start.copy(), np.zeros(placement.num_blocks)
    for node in range(placement.start.size):  # nodes joining in peer-id order
        start[node] = join_span(served, placement.demand, int(placement.length[node]))
        served[start[node] : start[node] + placement.length[node]] += placement.throughput[node]
    joined = replace(placement, start=start)
    best = best_placement(placement)
    assert bottleneck_throughput(best) >= max(bottleneck_throughput(joined), bottleneck_throughput(placement))
    # never above the bound of perfectly even coverage: sum of tps * length / blocks
    assert bottleneck_throughput(best) <= (placement.throughput * placement.length).sum() / placement.num_blocks
    assert np.array_equal(best.length, placement.length) and best.peer_ids == placement.peer_ids
    with pytest.raises(ValueError):
        best_placement(placement, max_rounds=-1)


def test_k_medoids_and_silhouette_on_separated_groups():
    rng = np.random.default_rng(2)
    points = np.concatenate([rng.normal(0, 1, (10, 2)), rng.normal(50, 1, (12, 2)), rng.normal((0, 80), 1, (8, 2))])
    distances = np.linalg.norm(points[:, None] - points[None], axis=2)
    labels, medoids = k_medoids(distances, 3, rng=np.random.default_rng(0))
    assert labels.tolist() == [0] * 10 + [1] * 12 + [2] * 8  # numbered by first member
    assert [labels[medoid] for medoid in medoids] == [0, 1, 2]
    assert silhouette(distances, labels) > 0.9 > silhouette(distances, np.arange(30) % 3)
    with pytest.raises(ValueError):
        k_medoids(distances, 31, rng=np.random.default_rng(0))


def test_bad_inputs_are_rejected(swarm):
    with pytest.raises(ValueError):
        build_book(swarm["book_snapshots"][:1], rng=np.random.default_rng(0))
    with pytest.raises(ValueError):
        build_book(swarm["book_snapshots"][:3], rng=np.random.default_rng(0), snapshot_diagrams=[])
    other_model = SwarmSnapshot(8, (NodeView("a", 0, 8, inference_tps=1.0),))
    with pytest.raises(ValueError):
        apply_schema(other_model, swarm["book"], feature_vector=swarm["vectors"][0])


def test_a_schema_that_would_leave_a_gap_is_recomputed():
    nodes = (NodeView("a", 0, 2, inference_tps=2.0), NodeView("b", 2, 4, inference_tps=1.0))
    book = one_class_book(4, [2], [[0]])  # every node of length 2 at block 0: blocks 2 and 3 unserved
    assignment = apply_schema(SwarmSnapshot(4, nodes), book, feature_vector=np.zeros(max(CLASSIFIER_COORDINATES) + 1))
    assert assignment.recomputed and sorted(assignment.starts.values()) == [0, 2]
    assert assignment.throughput_tps == pytest.approx(1.0)


def test_held_out_snapshots_of_the_books_states_are_within_its_radius(swarm):
    book = swarm["book"]
    distances = [classify(book, vector)[1] for vector in swarm["vectors"]]
    print(f"held-out distances: max {max(distances):.2f}, radius {book.radius:.2f}")
    assert all(book.knows(distance) for distance in distances)
    assert book.radius == pytest.approx(
        1.2 * max(classify(book, features(entry))[1] for entry in swarm["book_diagrams"])
    )


def test_a_state_the_book_never_saw_is_far_and_recomputed(swarm):
    """A book of four states; the fifth (Europe down) is far from all of them: the assignment is recomputed."""
    left_out = list(STATES).index("europe down")
    keep = [index for index in range(len(swarm["book_snapshots"])) if index // BOOK_PER_STATE != left_out]
    book = build_book(
        [swarm["book_snapshots"][index] for index in keep],
        rng=np.random.default_rng(0),
        snapshot_diagrams=[swarm["book_diagrams"][index] for index in keep],
    )
    for index in np.flatnonzero(swarm["state"] == left_out).tolist():
        snapshot, vector = swarm["held_out"][index], swarm["vectors"][index]
        assignment = apply_schema(snapshot, book, feature_vector=vector)
        assert assignment.far and assignment.recomputed and assignment.distance > book.radius
        assert np.array_equal(
            assignment.placement.start, best_placement(placement_from_snapshot(snapshot, book.demand)).start
        )
    for index in np.flatnonzero(swarm["state"] != left_out).tolist():  # the others still get their schema
        assert not apply_schema(swarm["held_out"][index], book, feature_vector=swarm["vectors"][index]).far


def test_a_book_survives_json_exactly(swarm):
    book = swarm["book"]
    again = book_from_dict(json.loads(json.dumps(book_to_dict(book))))
    assert again.num_blocks == book.num_blocks and again.radius == book.radius
    assert np.array_equal(again.demand, book.demand) and np.array_equal(again.scale, book.scale)
    for first, second in zip(book.schemas, again.schemas, strict=True):
        assert (first.label, first.lengths, first.snapshots) == (second.label, second.lengths, second.snapshots)
        assert np.array_equal(first.centroid, second.centroid) and first.fit == second.fit
        assert all(np.array_equal(a, b) for a, b in zip(first.starts, second.starts, strict=True))
    for snapshot, vector in zip(swarm["held_out"], swarm["vectors"], strict=True):
        assert apply_schema(snapshot, again, feature_vector=vector).starts == (
            apply_schema(snapshot, book, feature_vector=vector).starts
        )
    unbounded = book_from_dict(book_to_dict(replace(book, radius=math.inf)))
    assert unbounded.radius == math.inf and unbounded.knows(1e300)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            yield from _paths(item, (*prefix, index))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_damaged_book_is_refused_with_a_value_error_only(swarm, data):
    book = book_to_dict(swarm["book"])
    path = data.draw(st.sampled_from(list(_paths(book))[1:]))
    parent = book
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()):
        parent[path[-1]] = data.draw(JSON_VALUES)
    elif isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])
    try:
        loaded = book_from_dict(json.loads(json.dumps(book)))
    except ValueError as error:
        assert str(error)
        return
    # what loads is a usable book: every template start lies inside the model
    for schema in loaded.schemas:
        for length, starts in zip(schema.lengths, schema.starts, strict=True):
            assert np.all((starts >= 0) & (starts + length <= loaded.num_blocks))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda book: book.update(format="other/1"), "format"),
        (lambda book: book.update(num_blocks=True), "num_blocks"),
        (lambda book: book["demand"].append(1.0), "demand"),
        (lambda book: book["demand"].__setitem__(0, 0.0), "positive"),
        (lambda book: book["scale"].__setitem__(0, 0.0), "scale"),
        (lambda book: book.update(radius=-1.0), "radius"),
        (lambda book: book.update(schemas=[]), "schemas"),
        (lambda book: book["schemas"].append(dict(book["schemas"][0])), "share a label"),
        (lambda book: book["schemas"][0]["template"][0].update(starts=[10**6]), "start"),
        (lambda book: book["schemas"][0]["template"].append(dict(book["schemas"][0]["template"][0])), "ascending"),
        (lambda book: book["schemas"][0].pop("centroid"), "lacks centroid"),
    ],
)
def test_each_kind_of_damage_is_named(swarm, change, message):
    book = json.loads(json.dumps(book_to_dict(swarm["book"])))
    change(book)
    with pytest.raises(ValueError, match=message):
        book_from_dict(book)
