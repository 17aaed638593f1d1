"""The fusion partitioner's core: grouping fusible nodes of a DAG (networkx) without creating cycles.

Kept apart from the FX rewrite (fuse_pointwise.py) so that its guarantees can
be tested on arbitrary random DAGs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable

import networkx as nx

# can_add(group, node): whether `node` may join `group` (shape rules and the like); the default allows all.
CanAdd = Callable[[set, Hashable], bool]


def partition(dag: nx.DiGraph, fusible: Iterable[Hashable], reductions: Iterable[Hashable] = (),
              can_add: CanAdd | None = None) -> list[list[Hashable]]:
    """Disjoint groups of fusible nodes, each to become one node with one result.

    Each group, listed in topological order, has at least 2 nodes, at most one
    of them in `reductions`, and one *root* (its last node) whose value may
    be used outside the group: every other member is used only by members.
    Groups grow from the latest unassigned fusible node (the root) towards
    its producers, latest first, taking a producer once all its users are in
    the group. Since everything in a group then leads to its root, no path
    can leave a group and come back into it (groups are convex) and replacing
    each group by one node keeps the graph acyclic.
    """
    fusible, reductions = set(fusible), set(reductions)
    order = list(nx.topological_sort(dag))
    position = {node: index for index, node in enumerate(order)}
    assigned: set = set()

    def available(node: Hashable) -> bool:
        return node in fusible and node not in assigned

    groups = []
    for root in reversed(order):
        if root not in fusible or root in assigned:
            continue
        group = _grow(dag, root, available, reductions, position, can_add)
        if len(group) >= 2:
            assigned |= group
            groups.append(sorted(group, key=position.__getitem__))
    return groups


def _grow(dag: nx.DiGraph, root: Hashable, available: Callable[[Hashable], bool], reductions: set,
          position: dict, can_add: CanAdd | None) -> set:
    group = {root}
    has_reduction = root in reductions
    # A max-heap on position: a producer is examined only after every later candidate, so by then all of
    # its users that will ever join the group have joined.
    heap = [(-position[node], node) for node in dag.predecessors(root)]
    heapq.heapify(heap)
    while heap:
        _, node = heapq.heappop(heap)
        if node in group or not available(node):
            continue
        if any(user not in group for user in dag.successors(node)):
            continue
        if node in reductions and has_reduction:
            continue
        if can_add is not None and not can_add(group, node):
            continue
        group.add(node)
        has_reduction = has_reduction or node in reductions
        for producer in dag.predecessors(node):
            heapq.heappush(heap, (-position[producer], producer))
    return group


def is_convex(dag: nx.DiGraph, group: Iterable[Hashable]) -> bool:
    """Whether no path leaves `group` and re-enters it (no outside node lies between two members)."""
    members = set(group)
    reachable_from_group = set().union(*(nx.descendants(dag, node) for node in members)) - members
    leads_into_group = set().union(*(nx.ancestors(dag, node) for node in members)) - members
    return not (reachable_from_group & leads_into_group)


def contracted(dag: nx.DiGraph, groups: list[list[Hashable]]) -> nx.DiGraph:
    """`dag` with each group merged into one node (named by its root): what the rewrite produces."""
    representative = {node: group[-1] for group in groups for node in group}
    result = nx.DiGraph()
    result.add_nodes_from(representative.get(node, node) for node in dag.nodes)
    for source, target in dag.edges:
        source, target = representative.get(source, source), representative.get(target, target)
        if source != target:
            result.add_edge(source, target)
    return result
