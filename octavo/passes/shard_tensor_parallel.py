"""shard_tensor_parallel: one rank's program of a Megatron-style tensor-parallel layout."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes, op_name
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, is_weight, only_user
from octavo.passes.registry import register_pass
from octavo.passes.tensor_parallel_experts import expert_shard
from octavo.passes.tensor_parallel_layout import (
    column_range,
    even_share,
    head_rows,
    head_shard,
    row_ranges,
    vocab_rows,
    vocab_shard,
)
from octavo.passes.tensor_parallel_patterns import VIEWS, find_lm_head, gate_and_up, rewrite_head_counts
from octavo.passes.tensor_parallel_weights import (
    EMBEDDINGS,
    LINEARS,
    args_of,
    bias_of,
    column_slices,
    in_features,
    weight_tensor_nodes,
)

aten = torch.ops.aten
octavo = torch.ops.octavo

GROUP = "tp"
"""The logical group name the collectives of this pass carry (the runtime binds it to a process group)."""

_LAYOUT_OPS = (aten.transpose.int, aten.permute.default, aten.select.int, aten.unsqueeze.default,
               aten.squeeze.dim, aten.clone.default)
# Ops that read a weight but are correct on every rank with the whole weight (they act on replicated
# hidden states, or per head on whole heads).
_REPLICATED_WEIGHT_OPS = (octavo.rms_norm.default, octavo.fused_add_rms_norm.default,
                          octavo.rotary_embedding.default)
_MERGED_GATES = (octavo.silu_and_mul.default, octavo.gelu_and_mul.default)


@register_pass("shard_tensor_parallel",
               "split attention by heads, MLPs by columns then rows, embedding and lm_head by vocabulary")
def shard_tensor_parallel(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Rewrite the graph into the program of rank ``r`` of a tensor-parallel group of ``tp`` ranks.

    Runs when ``ctx.rank.tp_size > 1`` (else the graph is unchanged); weights
    in ``ctx.weights`` are replaced by the rank's slices (same names).

    - Attention (per ``octavo.paged_attention``): the q, k and v projections
      (merged by fuse_qkv or separate) keep the output rows of the rank's
      query heads ``[r*Hq/tp, (r+1)*Hq/tp)`` and of the KV heads those read;
      when ``tp > Hkv`` each KV head is replicated on ``tp/Hkv`` ranks. The
      split sizes and the head counts written in views between the
      projections, the attention and o_proj become the local ones. o_proj
      keeps the matching input columns and is followed by
      ``octavo.all_reduce`` (a bias is added once, after the reduction).
    - MLP (per gated SiLU: ``octavo.silu_and_mul``, ``silu(g) * u`` or a
      fused_pointwise computing exactly that):
      gate and up keep intermediate columns ``[r*I/tp, (r+1)*I/tp)``, down_proj
      the matching input columns, followed by ``octavo.all_reduce``.
    - Mixture of experts (per ``octavo.moe``): every expert split by its
      intermediate columns like a gated MLP (tensor_parallel_experts says why
      not expert parallelism), the router replicated, followed by
      ``octavo.all_reduce``. A linear with one output feature on the MoE's
      input (Qwen2-MoE's shared-expert gate) is computed whole on every rank.
    - Embedding: the rank holds vocabulary rows ``[r*ceil(V/tp), ...)``
      (zero-padded past V); ids outside them look up row 0 and are zeroed;
      ``octavo.all_reduce`` sums the one rank's row with zeros.
    - lm_head: the same vocabulary rows; the rank's logits columns are joined
      by ``octavo.all_gather`` along the last dim and cut back to V columns.
    - Quantized linears and embeddings (w8, w4, fp8) split the same way, their
      qweight, scales and offsets together; by input columns only on whole
      quantization groups (see tensor_parallel_weights).

    The KV layout in ``ctx.kv_layout`` becomes the rank's (its head counts).
    Sizes that do not divide raise PassError naming them; so does any op that
    reads a weight and is not one of the above or a norm/rotary op. Stats: tp_size, tp_rank,
    attention_layers, mlp_layers, all_reduce, all_gather, and moe_layers when there are some.
    """
    position = ctx.rank
    if position is None or position.tp_size == 1:
        ctx.stats["tp_size"] = 1
        return graph_module
    if ctx.kv_layout is None:
        raise PassError("shard_tensor_parallel needs the KV layout (run after match_attention)")
    _Sharder(graph_module, ctx, position.tp_size, position.tp_rank).run()
    return graph_module


@dataclass
class _Projection:
    """Where the query, key or value of an attention comes from: a linear, maybe one chunk of its split."""

    linear: Node
    split: Node | None
    chunk: int | None
    path: list[Node]


@dataclass
class _Sharder:
    graph_module: GraphModule
    ctx: PassContext
    tp_size: int
    tp_rank: int
    handled: set[Node] = field(default_factory=set)
    sliced: dict[str, tuple] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("attention_layers", "mlp_layers", "all_reduce", "all_gather", "moe_layers"), 0))

    def run(self) -> None:
        layout = self.ctx.kv_layout
        self.heads = head_shard(layout["num_heads"], layout["num_kv_heads"], layout["head_dim"],
                                self.tp_size, self.tp_rank)
        attentions = find_nodes(self.graph_module, octavo.paged_attention.default)
        if not attentions:
            raise PassError("shard_tensor_parallel found no octavo.paged_attention node")
        for attention in attentions:
            self._shard_attention(attention)
        for gate in self._gated_mlps():
            self._shard_mlp(gate)
        for moe in find_nodes(self.graph_module, octavo.moe.default):
            self._shard_moe(moe)
        for gate in self._scalar_gates():
            self.handled.add(gate)
        for embedding in [node for op in EMBEDDINGS for node in find_nodes(self.graph_module, op)]:
            self._shard_embedding(embedding)
        self._shard_lm_head()
        self._check_every_weight_user_handled()
        self.ctx.kv_layout = {**layout, "num_heads": len(self.heads.q_heads),
                              "num_kv_heads": len(self.heads.kv_heads)}
        counts = {name: count for name, count in self.counts.items() if count or name != "moe_layers"}
        self.ctx.stats.update({"tp_size": self.tp_size, "tp_rank": self.tp_rank, **counts})

    # ---- attention ----

    def _shard_attention(self, attention: Node) -> None:
        heads = self.heads
        layout = self.ctx.kv_layout
        roles = {"query": (layout["num_heads"], heads.q_heads), "key": (layout["num_kv_heads"], heads.kv_heads),
                 "value": (layout["num_kv_heads"], heads.kv_heads)}
        sources = {role: self._trace_projection(attention.args[index], role, attention)
                   for index, role in enumerate(roles)}
        for role, source in sources.items():
            total, owned = roles[role]
            rewrite_head_counts(source.path, total, len(owned), heads.head_dim)
        self._shard_projections(sources, roles)
        path, o_proj = self._trace_output(attention)
        rewrite_head_counts(path, layout["num_heads"], len(heads.q_heads), heads.head_dim)
        self._shard_row_parallel(o_proj, head_rows(heads.q_heads, heads.head_dim))
        self.counts["attention_layers"] += 1

    def _trace_projection(self, node: Node, role: str, attention: Node) -> _Projection:
        """Follow the attention's `role` input back to its projection through layout ops, per-head norms
        and the rotary embedding."""
        path: list[Node] = []
        while True:
            if is_call(node, *VIEWS, *_LAYOUT_OPS):
                path.append(node)
                node = node.args[0]
            elif is_call(node, octavo.rms_norm.default):
                weight = self.ctx.weights.get(getattr(node.args[1], "name", None))
                if weight is None or weight.numel() != self.heads.head_dim:
                    raise PassError(f"shard_tensor_parallel: the {role} of {attention.name} passes through "
                                    f"{node.name}, a norm that is not per head; it cannot be split by heads")
                path.append(node)
                node = node.args[0]
            elif is_call(node, operator.getitem) and is_call(node.args[0], octavo.rotary_embedding.default):
                path.append(node)
                node = node.args[0].args[node.args[1]]
            elif is_call(node, operator.getitem) and is_call(node.args[0], aten.split_with_sizes.default):
                split = node.args[0]
                self._check_projection(split.args[0], role, attention)
                return _Projection(split.args[0], split, node.args[1], path)
            elif is_call(node, *LINEARS):
                self._check_projection(node, role, attention)
                return _Projection(node, None, None, path)
            else:
                raise PassError(f"shard_tensor_parallel cannot follow the {role} of {attention.name} back to its "
                                f"projection through {_describe(node)}")

    def _check_projection(self, linear: Node, role: str, attention: Node) -> None:
        if not is_call(linear, *LINEARS) or not is_weight(linear.args[1], self.ctx):
            raise PassError(f"shard_tensor_parallel: the {role} of {attention.name} comes from {_describe(linear)}, "
                            "not a linear over a weight; it cannot be split by heads")

    def _shard_projections(self, sources: dict[str, _Projection], roles: dict[str, tuple[int, range]]) -> None:
        head_dim = self.heads.head_dim
        linears = {source.linear for source in sources.values()}
        if len(linears) == 1:
            self._shard_merged_qkv(sources, roles)
            return
        if len(linears) != 3 or any(source.split is not None for source in sources.values()):
            raise PassError("shard_tensor_parallel: q, k and v come from a partly merged projection "
                            f"({', '.join(sorted(node.name for node in linears))}); expected one merged or three")
        for role, source in sources.items():
            self._shard_column_parallel(source.linear, [head_rows(roles[role][1], head_dim)])

    def _shard_merged_qkv(self, sources: dict[str, _Projection], roles: dict[str, tuple[int, range]]) -> None:
        split = next(iter(sources.values())).split
        if split is None or any(source.split is not split for source in sources.values()):
            raise PassError("shard_tensor_parallel: q, k and v read one linear but not through one split")
        sizes = list(split.args[1])
        chunks = {source.chunk: role for role, source in sources.items()}
        if sorted(chunks) != list(range(len(sizes))) or split.args[2] not in (-1, 2):
            raise PassError(f"shard_tensor_parallel: {split.name} does not split exactly into q, k and v")
        head_dim = self.heads.head_dim
        rows, local_sizes, offset = [], [], 0
        for chunk, size in enumerate(sizes):
            total, owned = roles[chunks[chunk]]
            if size != total * head_dim:
                raise PassError(f"shard_tensor_parallel: {split.name} chunk {chunk} has {size} columns, expected "
                                f"{total} heads x {head_dim}")
            rows.append(head_rows(owned, head_dim, offset))
            local_sizes.append(len(owned) * head_dim)
            offset += size
        self._shard_column_parallel(split.args[0], rows)
        split.args = (split.args[0], local_sizes, *split.args[2:])

    def _trace_output(self, attention: Node) -> tuple[list[Node], Node]:
        """The layout ops from the attention output to o_proj, and o_proj."""
        path, node = [], attention
        while True:
            user = only_user(node)
            if is_call(user, *LINEARS) and user.args[0] is node and is_weight(user.args[1], self.ctx):
                return path, user
            if not is_call(user, *VIEWS, *_LAYOUT_OPS):
                raise PassError(f"shard_tensor_parallel cannot follow {attention.name}'s output to o_proj: "
                                f"{node.name} has users {[_describe(u) for u in node.users]}")
            path.append(user)
            node = user

    # ---- MLP ----

    def _gated_mlps(self) -> list[Node]:
        """The gating nodes: silu_and_mul, gelu_and_mul, silu(gate) * up, or a fused_pointwise computing it."""
        return [node for node in self.graph_module.graph.nodes
                if is_call(node, *_MERGED_GATES) or gate_and_up(node) is not None]

    def _shard_mlp(self, gate: Node) -> None:
        if is_call(gate, *_MERGED_GATES):
            self._shard_fused_gate_up(gate)
        else:
            self._shard_unfused_gate_up(gate, *gate_and_up(gate))
        down = only_user(gate)
        if not (is_call(down, *LINEARS) and down.args[0] is gate and is_weight(down.args[1], self.ctx)):
            raise PassError(f"shard_tensor_parallel: the gated MLP output {gate.name} does not feed one down "
                            "projection linear")
        self._shard_row_parallel(down, self._intermediate_columns(down))
        self.counts["mlp_layers"] += 1

    def _intermediate_columns(self, down: Node) -> range:
        if down.args[1].name in self.sliced:
            raise PassError(f"shard_tensor_parallel: down projection weight {down.args[1].name} is read twice")
        return even_share(in_features(down, self.ctx.weights), self.tp_size, self.tp_rank, "MLP intermediate size")

    def _shard_fused_gate_up(self, gate: Node) -> None:
        merged = gate.args[0]
        if not (is_call(merged, *LINEARS) and is_weight(merged.args[1], self.ctx)):
            raise PassError(f"shard_tensor_parallel: {gate.name} does not read a gate/up linear directly "
                            f"({_describe(merged)})")
        total = int(self.ctx.weights[merged.args[1].name].shape[0])
        columns = even_share(total // 2, self.tp_size, self.tp_rank, "MLP intermediate size")
        self._shard_column_parallel(merged, [columns, range(total // 2 + columns.start, total // 2 + columns.stop)])

    def _shard_unfused_gate_up(self, gate: Node, gate_input: Node, up_input: Node) -> None:
        sources = [self._mlp_source(gate_input, gate), self._mlp_source(up_input, gate)]
        if all(split is None for _, split, _ in sources):
            for linear, _, _ in sources:
                size = int(self.ctx.weights[linear.args[1].name].shape[0])
                self._shard_column_parallel(linear, [even_share(size, self.tp_size, self.tp_rank,
                                                                "MLP intermediate size")])
            return
        (linear, split, gate_chunk), (other, other_split, up_chunk) = sources
        if split is not other_split or linear is not other or sorted((gate_chunk, up_chunk)) != [0, 1]:
            raise PassError(f"shard_tensor_parallel: the gate and up of {gate.name} are neither two linears nor "
                            "the two halves of one split")
        sizes = list(split.args[1])
        columns = [even_share(size, self.tp_size, self.tp_rank, "MLP intermediate size") for size in sizes]
        self._shard_column_parallel(linear, [columns[0], range(sizes[0] + columns[1].start,
                                                               sizes[0] + columns[1].stop)])
        split.args = (split.args[0], [len(part) for part in columns], *split.args[2:])

    def _mlp_source(self, node: Node, gate: Node) -> tuple[Node, Node | None, int | None]:
        if is_call(node, operator.getitem) and is_call(node.args[0], aten.split_with_sizes.default):
            split = node.args[0]
            if is_call(split.args[0], *LINEARS) and is_weight(split.args[0].args[1], self.ctx):
                return split.args[0], split, node.args[1]
        if is_call(node, *LINEARS) and is_weight(node.args[1], self.ctx):
            return node, None, None
        raise PassError(f"shard_tensor_parallel: an input of the gated MLP {gate.name} comes from "
                        f"{_describe(node)}, not a linear")

    # ---- mixtures of experts ----

    def _shard_moe(self, moe: Node) -> None:
        """Every expert split by intermediate columns (tensor_parallel_experts), then all_reduce."""
        for index, (key, make_slice) in expert_shard(moe.args, self.ctx.weights, self.tp_size, self.tp_rank).items():
            self._slice_weight(moe.args[index], key, make_slice)
        graph = self.graph_module.graph
        with graph.inserting_before(moe.next):
            reduced = graph.call_function(octavo.all_reduce.default, (moe, GROUP, self.tp_size))
        moe.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
        self.handled.add(moe)
        self.counts["moe_layers"] += 1
        self.counts["all_reduce"] += 1

    def _scalar_gates(self) -> list[Node]:
        """Linears with one output feature on an octavo.moe's (replicated) input: computed whole on every rank."""
        moe_inputs = {_through_views(moe.args[0]) for moe in find_nodes(self.graph_module, octavo.moe.default)}
        return [linear for linear in find_nodes(self.graph_module, aten.linear.default)
                if is_weight(linear.args[1], self.ctx) and self.ctx.weights[linear.args[1].name].shape[0] == 1
                and _through_views(linear.args[0]) in moe_inputs]

    # ---- embedding and lm_head ----

    def _shard_embedding(self, embedding: Node) -> None:
        tables = weight_tensor_nodes(embedding)
        ids = embedding.args[args_of(embedding).indices]
        if not all(is_weight(table, self.ctx) for table in tables) or embedding.kwargs:
            raise PassError(f"shard_tensor_parallel cannot shard {_describe(embedding)} by vocabulary")
        shard = vocab_shard(self._vocab_rows(tables[0]), self.tp_size, self.tp_rank)
        for table in tables:
            self._slice_weight(table, ("vocab", shard), lambda tensor: vocab_rows(tensor, shard))
        graph = self.graph_module.graph
        with graph.inserting_before(embedding):
            shifted = graph.call_function(aten.sub.Tensor, (ids, shard.start))
            below = graph.call_function(aten.lt.Scalar, (shifted, 0))
            above = graph.call_function(aten.ge.Scalar, (shifted, shard.size))
            outside = graph.call_function(aten.bitwise_or.Tensor, (below, above))
            local_ids = graph.call_function(aten.masked_fill.Scalar, (shifted, outside, 0))
        if embedding.target is aten.embedding.default:
            # padding_idx (and the other trailing arguments) only change gradients; a global row index has no
            # meaning for the rank's rows, so none is passed on.
            embedding.args = (tables[0], local_ids)
        else:
            index = args_of(embedding).indices
            embedding.args = (*embedding.args[:index], local_ids, *embedding.args[index + 1:])
        with graph.inserting_before(embedding.next):
            mask = graph.call_function(aten.unsqueeze.default, (outside, -1))
            zeroed = graph.call_function(aten.masked_fill.Scalar, (embedding, mask, 0.0))
            reduced = graph.call_function(octavo.all_reduce.default, (zeroed, GROUP, self.tp_size))
        embedding.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not zeroed)
        self.handled.add(embedding)
        self.counts["all_reduce"] += 1

    def _shard_lm_head(self) -> None:
        lm_head = find_lm_head(self.graph_module)
        tables = weight_tensor_nodes(lm_head)
        if not all(is_weight(table, self.ctx) for table in tables) or bias_of(lm_head) is not None:
            raise PassError(f"shard_tensor_parallel cannot shard the lm_head {_describe(lm_head)} by vocabulary")
        vocab = self._vocab_rows(tables[0])
        shard = vocab_shard(vocab, self.tp_size, self.tp_rank)
        for table in tables:
            self._slice_weight(table, ("vocab", shard), lambda tensor: vocab_rows(tensor, shard))
        graph = self.graph_module.graph
        with graph.inserting_before(lm_head.next):
            gathered = graph.call_function(octavo.all_gather.default, (lm_head, GROUP, self.tp_size, -1))
            padded = shard.size * self.tp_size > vocab  # on every rank: the gathered rows include the padding
            result = graph.call_function(aten.slice.Tensor, (gathered, -1, 0, vocab)) if padded else gathered
        lm_head.replace_all_uses_with(result, delete_user_cb=lambda user: user is not gathered)
        self.handled.add(lm_head)
        self.counts["all_gather"] += 1

    def _vocab_rows(self, weight: Node) -> int:
        if weight.name in self.sliced:
            return self.sliced[weight.name][1].vocab_size
        return int(self.ctx.weights[weight.name].shape[0])

    # ---- linears and weights ----

    def _shard_column_parallel(self, linear: Node, rows: list[range]) -> None:
        """Keep output rows `rows` (in order) of the linear's weight tensors and bias."""
        key = ("rows", tuple((part.start, part.stop) for part in rows))
        for parameter in [*weight_tensor_nodes(linear), bias_of(linear)]:
            if parameter is not None:
                self._slice_weight(parameter, key, lambda tensor: row_ranges(tensor, rows))
        self.handled.add(linear)

    def _shard_row_parallel(self, linear: Node, columns: range) -> None:
        """Keep input columns `columns` of the weight; sum the partial outputs with all_reduce."""
        spec, bias = args_of(linear), bias_of(linear)
        slices = column_slices(linear, self.ctx.weights, columns)
        for tensor, part in zip(weight_tensor_nodes(linear), slices.ranges, strict=True):
            if part is not None:
                self._slice_weight(tensor, ("columns", part.start, part.stop),
                                   lambda weight, part=part: column_range(weight, part))
        args = list(linear.args)
        if spec.bias is not None and len(args) > spec.bias:
            args[spec.bias] = None  # added once, after the reduction
        if slices.group_size is not None:
            args[spec.group_size] = slices.group_size
        linear.args = tuple(args)
        graph = self.graph_module.graph
        with graph.inserting_before(linear.next):
            reduced = graph.call_function(octavo.all_reduce.default, (linear, GROUP, self.tp_size))
            result = graph.call_function(aten.add.Tensor, (reduced, bias)) if bias is not None else reduced
        linear.replace_all_uses_with(result, delete_user_cb=lambda user: user is not reduced)
        self.handled.add(linear)
        self.counts["all_reduce"] += 1

    def _slice_weight(self, node: Node, key: tuple, make_slice) -> None:
        """Replace a weight by its rank's slice, once; a weight two ops would slice differently is an error."""
        if node.name in self.sliced:
            if self.sliced[node.name] != key:
                raise PassError(f"shard_tensor_parallel: weight {node.name} is read by ops that split it differently")
            return
        tensor = make_slice(self.ctx.weights[node.name])
        self.ctx.weights[node.name] = tensor
        with self.ctx.fake_mode:
            node.meta["val"] = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.sliced[node.name] = key

    def _check_every_weight_user_handled(self) -> None:
        for node in self.graph_module.graph.find_nodes(op="placeholder"):
            if node.name not in self.ctx.weights:
                continue
            for user in node.users:
                if user not in self.handled and not is_call(user, *_REPLICATED_WEIGHT_OPS):
                    raise PassError(f"shard_tensor_parallel cannot shard {_describe(user)} (it reads weight "
                                    f"{node.name}) yet: tensor parallelism covers linears of attention, gated "
                                    "MLPs and mixtures of experts, the embedding and the lm_head")


def _through_views(node: Node) -> Node:
    while is_call(node, *VIEWS):
        node = node.args[0]
    return node


def _describe(node) -> str:
    return f"{op_name(node)} ({node.name})" if isinstance(node, Node) else repr(node)

