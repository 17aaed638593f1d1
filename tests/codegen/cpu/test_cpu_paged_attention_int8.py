"""int8 caches under a bfloat16 model's queries: the decode kernel's integer paths against the op's definition.

On AVX-512 builds such decodes multiply int16 queries by the int8 keys and int16 softmax weights by the int8
values, in exact int32 sums (vpdpwssd where the CPU has AVX512_VNNI, vpmaddwd elsewhere);
OCTAVO_CPU_INT8_CACHE_DOT picks the path (float: widen every row, as float32 models always do). Each path must
stay within the error its arithmetic allows of the definition computed in float64, and the two integer forms
must give the same bits.
"""

from __future__ import annotations

import math

import pytest
import torch

from octavo.codegen.cpu_backend.isa import cpu_target
from octavo.ir.ops.attention import paged_attention as reference_op
from tests.codegen.paged_batches import TOLERANCE, copy_batch, make_batch

# (context length, query length): decodes across chunk and block edges, one long enough for several chunks.
DECODES = [(1, 1), (2, 1), (17, 1), (64, 1), (65, 1), (129, 1), (300, 1), (31, 1)]
# (num_heads, num_kv_heads, head_dim, block_size, sliding window, soft cap)
SHAPES = {
    "smollm2": (9, 3, 64, 16, -1, 0.0),
    "d128-gqa8": (8, 1, 128, 16, -1, 0.0),
    "d32-mha": (4, 4, 32, 16, -1, 0.0),
    "d96-window": (6, 2, 96, 16, 40, 0.0),
    "block-larger-than-chunk": (6, 2, 64, 128, -1, 0.0),
    "soft-cap": (6, 2, 64, 16, -1, 1.5),
}
UNIT_ROUNDOFF_BF16 = 2.0 ** -8  # the output's rounding to bfloat16 (unit roundoff 2^-8)
INT16_STEPS = 32767.0


def paths() -> list[str]:
    """OCTAVO_CPU_INT8_CACHE_DOT values that run a kernel this build has (builds below AVX-512 always widen)."""
    if cpu_target().level != "avx512":
        return ["float"]
    return ["float", "madd"] + (["vnni"] if torch.cpu._is_vnni_supported() else [])


def run(batch: dict, path: str, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("OCTAVO_CPU_INT8_CACHE_DOT", path)
    return torch.ops.octavo_cpu.paged_attention(**copy_batch(batch))


def definition_and_bound(batch: dict, written: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The output in float64 from the cached (dequantized) rows, and how far each path may be from it.

    The bound adds, per query row, to the output's own rounding: the int16 softmax weights (each within half a
    step, max w / 65534, of its value: over L rows at most L * max|v| / 65534 once divided by the sum of
    weights, which is at least 1) and the int16 query (each score within scale * max|q| / 65534 * sum|k| of its
    value, which moves the softmax weights by a factor within exp(+-2 eps) and the output by at most
    (exp(2 eps) - 1) * max|v|).
    """
    keys = written["key_cache"].double() * written["key_scale_cache"].double()[..., None]
    values = written["value_cache"].double() * written["value_scale_cache"].double()[..., None]
    query, scale = batch["query"].double(), batch["scale"]
    heads, kv_heads = query.shape[1], keys.shape[2]
    block_size, window, cap = keys.shape[1], batch.get("sliding_window", -1), batch.get("soft_cap", 0.0)
    outputs, bounds = [], []
    for row, length in enumerate(batch["seq_lens"].tolist()):
        token = int(batch["query_start_loc"][row])
        blocks = batch["block_tables"][row, :math.ceil(length / block_size)].long()
        k = keys[blocks].flatten(0, 1)[:length].repeat_interleave(heads // kv_heads, dim=1)
        v = values[blocks].flatten(0, 1)[:length].repeat_interleave(heads // kv_heads, dim=1)
        visible = torch.arange(length) > length - 1 - window if window > 0 else torch.ones(length, dtype=torch.bool)
        k, v = k[visible], v[visible]
        scores = torch.einsum("hd,thd->ht", query[token], k) * scale
        if cap > 0:
            scores = cap * torch.tanh(scores / cap)
        outputs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
        largest_v = v.abs().amax(dim=(0, 2))[:, None]
        eps = scale * query[token].abs().amax(-1) / (2 * INT16_STEPS) * k.abs().sum(-1).amax(0)
        bounds.append(largest_v * (len(k) / (2 * INT16_STEPS) + torch.expm1(2 * eps)[:, None]))
    exact = torch.stack(outputs)
    return exact, UNIT_ROUNDOFF_BF16 * exact.abs() + torch.stack(bounds)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_every_path_is_within_its_arithmetics_error_of_the_definition(shape, cpu_kernels, monkeypatch):
    heads, kv_heads, head_dim, block_size, window, cap = SHAPES[shape]
    batch = make_batch(DECODES, heads, kv_heads, head_dim, block_size=block_size, dtype=torch.bfloat16,
                       cache_dtype=torch.int8, sliding_window=window, seed=head_dim + block_size)
    batch["soft_cap"] = cap
    written = copy_batch(batch)
    expected = reference_op(**written)
    exact, bound = definition_and_bound(batch, written)
    outputs = {path: run(batch, path, monkeypatch) for path in paths()}
    for path, output in outputs.items():
        assert not output.isnan().any(), path
        torch.testing.assert_close(output, expected, **TOLERANCE[torch.bfloat16])
        excess = (output.double() - exact).abs() - bound
        assert excess.max() <= 0, f"{path}: {excess.max():.3g} past the bound"
    if "vnni" in outputs:
        assert torch.equal(outputs["vnni"], outputs["madd"])


@pytest.mark.parametrize("path", paths())
def test_a_decode_gives_the_same_bits_alone_and_in_a_batch(path, cpu_kernels, monkeypatch):
    """Queries and weights are quantized per query: a decode's bits never depend on the other queries."""
    batch = make_batch(DECODES, 9, 3, 64, dtype=torch.bfloat16, cache_dtype=torch.int8, seed=21)
    together = run(batch, path, monkeypatch)
    for row in (2, 6):
        alone = copy_batch(batch)
        token = int(batch["query_start_loc"][row])
        for name in ("query", "key", "value"):
            alone[name] = batch[name][token:token + 1]
        alone.update(slot_mapping=batch["slot_mapping"][token:token + 1],
                     block_tables=batch["block_tables"][row:row + 1], seq_lens=batch["seq_lens"][row:row + 1],
                     query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
        assert torch.equal(run(alone, path, monkeypatch)[0], together[token])


def test_a_float32_models_queries_take_the_exact_path_whatever_is_asked(cpu_kernels, monkeypatch):
    batch = make_batch(DECODES, 6, 2, 64, cache_dtype=torch.int8, seed=5)
    expected = reference_op(**copy_batch(batch))
    outputs = [run(batch, path, monkeypatch) for path in paths()]
    torch.testing.assert_close(outputs[0], expected, **TOLERANCE[torch.float32])
    assert all(torch.equal(output, outputs[0]) for output in outputs)


def test_an_unknown_path_is_refused_by_name(cpu_kernels, monkeypatch):
    batch = make_batch([(20, 1)], 4, 2, 64, dtype=torch.bfloat16, cache_dtype=torch.int8)
    with pytest.raises(RuntimeError, match="OCTAVO_CPU_INT8_CACHE_DOT must be auto, float, madd or vnni, got 'fast'"):
        run(batch, "fast", monkeypatch)
