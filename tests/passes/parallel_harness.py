"""Run every rank's program of a parallel layout in one process, for the tests of the parallel passes.

The ranks of a tensor-parallel group run on threads; each collective node is
evaluated from every rank's input by the op's reference definition
(octavo.ir.ops.collectives), so the sharded programs are checked without
torch.distributed. Pipeline stages run one after the other, the boundary
values of one stage feeding the next.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Interpreter

from octavo.config import RankPosition
from octavo.ir.ops.collectives import all_gather_reference, all_reduce_reference
from octavo.passes.rank_program import RankProgram, prepare_rank_program
from octavo.runtime.kv_cache import pool_shapes

octavo = torch.ops.octavo
BLOCK_SIZE = 16


class _Exchange:
    """One tensor-parallel group's meeting point: each rank leaves its value, all read the result."""

    def __init__(self, size: int):
        self.values: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def combine(self, rank: int, value: torch.Tensor, reduce) -> torch.Tensor:
        self.values[rank] = value
        self.barrier.wait()
        result = reduce(list(self.values))
        self.barrier.wait()
        return result


class _RankInterpreter(Interpreter):
    def __init__(self, graph_module: GraphModule, exchange: _Exchange, tp_rank: int):
        super().__init__(graph_module)
        self.exchange = exchange
        self.tp_rank = tp_rank

    def call_function(self, target, args, kwargs):
        if target is octavo.all_reduce.default:
            return self.exchange.combine(self.tp_rank, args[0], all_reduce_reference)
        if target is octavo.all_gather.default:
            return self.exchange.combine(self.tp_rank, args[0], lambda values: all_gather_reference(values, args[3]))
        return super().call_function(target, args, kwargs)


def run_graph(graph_module: GraphModule, feed: dict[str, torch.Tensor], exchange: _Exchange | None = None,
              tp_rank: int = 0):
    names = [node.name for node in graph_module.graph.find_nodes(op="placeholder")]
    with torch.inference_mode():
        return _RankInterpreter(graph_module, exchange or _Exchange(1), tp_rank).run(*[feed[n] for n in names])


def make_caches(kv_layout: dict, num_blocks: int) -> dict[str, torch.Tensor]:
    """Every KV pool of the layout (and the scale pools of a quantized cache), zeroed."""
    return {name: torch.zeros((num_blocks, *shape), dtype=dtype) for name, (shape, dtype) in
            pool_shapes(kv_layout).items()}


@dataclass
class ParallelPrograms:
    """Every rank's program of a tp x pp layout and its KV cache; `run(step)` returns the logits."""

    programs: list[list[RankProgram]]  # [stage][tp rank]
    caches: list[list[dict[str, torch.Tensor]]]

    @classmethod
    def prepare(cls, artifact, tp_size: int, pp_size: int, num_blocks: int = 16) -> ParallelPrograms:
        programs = [[prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest,
                                          RankPosition(tp_size, tp_rank, pp_size, stage))
                     for tp_rank in range(tp_size)] for stage in range(pp_size)]
        caches = [[make_caches(program.kv_layout, num_blocks) for program in stage] for stage in programs]
        return cls(programs, caches)

    def run(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        carried: dict[str, torch.Tensor] = {}
        for stage, caches in zip(self.programs, self.caches, strict=True):
            exchange = _Exchange(len(stage))
            results: list = [None] * len(stage)
            errors: list[BaseException] = []

            def run_rank(tp_rank: int, program: RankProgram, cache: dict, exchange=exchange, results=results,
                         errors=errors, carried=carried) -> None:
                try:
                    feed = {**step, **cache, **program.weights, **carried}
                    results[tp_rank] = run_graph(program.graph_module, feed, exchange, tp_rank)
                except BaseException as error:  # surfaced below, on the test's thread
                    errors.append(error)
                    exchange.barrier.abort()

            threads = [threading.Thread(target=run_rank, args=(index, program, cache))
                       for index, (program, cache) in enumerate(zip(stage, caches, strict=True))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
            for other in results[1:]:  # every rank of a group ends with the same values
                for mine, theirs in zip(_as_tuple(results[0]), _as_tuple(other), strict=True):
                    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
            if isinstance(results[0], tuple):
                carried = {f"stage_input_{index}": value for index, value in enumerate(results[0])}
            else:
                return results[0]
        raise AssertionError("the last stage returned boundary values instead of logits")


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@dataclass
class ScriptedSequence:
    tokens: list[int]
    blocks: list[int]


def mixed_steps(vocab_size: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Step inputs of a short scripted schedule: chunked prefill next to prefill and decode, a sequence
    reusing another's full prefix block (as prefix caching does), parallel decodes.

    Each step is a list of (sequence, first token, number of tokens); every sequence samples its last
    token's logits row.
    """
    generator = torch.Generator().manual_seed(seed)

    def tokens(count: int) -> list[int]:
        return torch.randint(3, vocab_size, (count,), generator=generator).tolist()

    first = ScriptedSequence(tokens(22), [0, 1])
    second = ScriptedSequence(tokens(8), [2])
    shared = ScriptedSequence(first.tokens[:16] + tokens(12), [0, 3])  # block 0 is first's, already full
    schedule = [
        [(first, 0, 12), (second, 0, 5)],
        [(first, 12, 8), (second, 5, 1)],
        [(second, 6, 1), (first, 20, 1), (shared, 16, 11)],
        [(first, 21, 1), (shared, 27, 1), (second, 7, 1)],
    ]
    return [_step_inputs(step) for step in schedule]


def _step_inputs(step: list[tuple[ScriptedSequence, int, int]]) -> dict[str, torch.Tensor]:
    input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
    width = max(len(seq.blocks) for seq, _, _ in step)
    tables = torch.zeros(len(step), width, dtype=torch.int32)
    for row, (seq, first, count) in enumerate(step):
        for position in range(first, first + count):
            input_ids.append(seq.tokens[position])
            positions.append(position)
            slots.append(seq.blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        tables[row, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        seq_lens.append(first + count)
        starts.append(starts[-1] + count)
    return {
        "input_ids": torch.tensor(input_ids), "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots), "block_tables": tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "logits_indices": torch.tensor(starts[1:]) - 1,
    }
