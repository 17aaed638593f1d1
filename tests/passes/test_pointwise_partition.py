"""The partitioner's guarantees on arbitrary DAGs: convex groups, one result each, no cycle after contraction."""

from __future__ import annotations

import itertools

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.passes.pointwise_partition import contracted, is_convex, partition


@st.composite
def random_dags(draw):
    """A DAG on nodes 0..n-1 (edges only go forward), with random fusible and reduction nodes."""
    size = draw(st.integers(2, 18))
    pairs = [(source, target) for source in range(size) for target in range(source + 1, size)]
    edges = draw(st.lists(st.sampled_from(pairs), max_size=3 * size, unique=True))
    fusible = draw(st.sets(st.integers(0, size - 1)))
    reductions = draw(st.sets(st.sampled_from(sorted(fusible)))) if fusible else set()
    dag = nx.DiGraph()
    dag.add_nodes_from(range(size))
    dag.add_edges_from(edges)
    return dag, fusible, reductions


def brute_force_convex(dag: nx.DiGraph, group: set) -> bool:
    """No outside node is reachable from the group and also reaches it (checked pair by pair)."""
    for outside in set(dag.nodes) - group:
        reached = any(nx.has_path(dag, member, outside) for member in group)
        reaches = any(nx.has_path(dag, outside, member) for member in group)
        if reached and reaches:
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(random_dags())
def test_groups_are_convex_single_result_and_contract_to_a_dag(case):
    dag, fusible, reductions = case
    groups = partition(dag, fusible, reductions)
    members = [node for group in groups for node in group]
    assert len(members) == len(set(members)), "groups must be disjoint"
    for group in groups:
        assert len(group) >= 2 and set(group) <= fusible
        assert sum(node in reductions for node in group) <= 1
        inside = set(group)
        leaving = [node for node in group if any(user not in inside for user in dag.successors(node))]
        assert leaving in ([], [group[-1]]), "only the root's value may leave the group"
        assert is_convex(dag, inside) and brute_force_convex(dag, inside)
        position = {node: index for index, node in enumerate(group)}
        assert all(position[source] < position[target] for source, target in dag.subgraph(group).edges), \
            "members are listed in topological order"
    assert nx.is_directed_acyclic_graph(contracted(dag, groups))


@settings(max_examples=100, deadline=None)
@given(random_dags())
def test_is_convex_agrees_with_brute_force_on_any_node_set(case):
    dag = case[0]
    for size in (2, 3):
        for group in itertools.islice(itertools.combinations(sorted(dag.nodes), size), 20):
            assert is_convex(dag, set(group)) == brute_force_convex(dag, set(group))


def test_a_producer_with_an_outside_user_does_not_join():
    # a -> b -> c and a -> c, with b not fusible: fusing a with c would need b both after and before them.
    dag = nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")])
    assert not is_convex(dag, {"a", "c"})
    assert partition(dag, {"a", "c"}) == []


def test_chain_of_fusible_nodes_becomes_one_group_and_a_second_reduction_splits_it():
    dag = nx.DiGraph([(0, 1), (1, 2), (2, 3), (3, 4)])
    assert partition(dag, {0, 1, 2, 3, 4}) == [[0, 1, 2, 3, 4]]
    assert partition(dag, {0, 1, 2, 3, 4}, reductions={1, 3}) == [[2, 3, 4], [0, 1]]


def test_single_nodes_are_not_groups():
    dag = nx.DiGraph([(0, 1), (1, 2)])
    assert partition(dag, {0, 2}) == []


def test_can_add_vetoes_a_member():
    dag = nx.DiGraph([(0, 2), (1, 2), (2, 3)])
    groups = partition(dag, {0, 1, 2, 3}, can_add=lambda group, node: node != 1)
    assert groups == [[0, 2, 3]]
