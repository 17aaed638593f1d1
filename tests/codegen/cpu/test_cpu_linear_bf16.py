"""The C++ linear_bf16 (a bfloat16 model's linear on its own weight) against its definition, on every kernel path.

Definition: out = bf16(sum_k x_k w_k + b), the products exact in float32 (two bfloat16 numbers), the sum in
float32, rounded to bfloat16 once. A float32 sum of K + 1 terms in any order is within gamma_(K+1) * sum |x_k w_k|
(+ |b|) of the exact sum (gamma_n = n u / (1 - n u), u = 2^-24), and rounding to bfloat16 moves it by at most
2^-8 of its magnitude (8 significant bits). The test allows 2^-8 |exact| + 2 gamma_(K+1) * magnitude (the
second factor covering the rounding's share of the summation error) plus 2^-120 (vdpbf16ps flushes denormal
products and sums to zero; none arise at these magnitudes). The exact value is computed in float64.

Paths: up to 8 rows the GEMV (vdpbf16ps on AVX512_BF16 CPUs, its weights asked for with either prefetch hint
that OCTAVO_CPU_READ_ONCE_PREFETCH names, widening FMAs elsewhere, and where OCTAVO_CPU_BF16_GEMV=widening asks
for it in the AVX-512 build); above, AMX tiles on CPUs with AMX, the GEMV's
dot kernel over tiles of rows on AVX512_BF16 CPUs without AMX (and where OCTAVO_CPU_BF16_GEMM=dot asks for it on
AMX CPUs), ATen's linear elsewhere and where OCTAVO_CPU_BF16_GEMM=aten asks for it.
tests/codegen/cpu/test_cpu_lower_isa_levels.py runs this file again on the AVX2 build.
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.cpu_backend.isa import cpu_target

ROWS = [1, 2, 3, 5, 8, 9, 31, 33, 64, 70]


def assert_within_definition(output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> None:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    assert output.shape == exact.shape and output.dtype == torch.bfloat16
    terms = x.shape[-1] + 1
    gamma = terms * 2.0 ** -24 / (1 - terms * 2.0 ** -24)
    bound = 2.0 ** -8 * exact.abs() + 2 * gamma * magnitude + 2.0 ** -120
    excess = (output.double() - exact).abs() - bound
    worst = divmod(int(excess.argmax()), exact.shape[1])
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3g} at {worst}"


# (OCTAVO_CPU_BF16_GEMV, OCTAVO_CPU_BF16_GEMM, OCTAVO_CPU_READ_ONCE_PREFETCH, the rows whose kernel the three
# choose): the CPU's own choice for every row count, then each kernel a variable can ask for where this build has it.
def kernel_choices() -> list[tuple[str, str, str, list[int]]]:
    target = cpu_target()
    gemv_rows = [rows for rows in ROWS if rows <= 8]
    choices = [("", "", "", ROWS), ("", "aten", "", [rows for rows in ROWS if rows > 8])]
    if target.avx512_bf16:
        choices.append(("", "dot", "", [rows for rows in ROWS if rows > 8]))
        choices.extend(("", "", hint, gemv_rows) for hint in ("nta", "t0"))  # the same sums, either hint
    if target.level == "avx512":  # the widening GEMV of AVX-512 CPUs without AVX512_BF16
        choices.append(("widening", "", "", gemv_rows))
    return choices


@pytest.mark.parametrize("choice", kernel_choices(), ids=lambda choice: "-".join(
    f"{name}={value or 'default'}" for name, value in zip(("gemv", "gemm", "prefetch"), choice[:3], strict=True)))
@pytest.mark.parametrize("shape", [(96, 64), (37, 100), (70, 1536)], ids=["aligned", "odd", "deep"])
def test_matches_definition(shape, choice, cpu_kernels, monkeypatch):
    """N = 37 is no multiple of a block of columns, K = 100 none of a tile's depth, K = 1536 is split in parts."""
    gemv, gemm, prefetch, row_counts = choice
    monkeypatch.setenv("OCTAVO_CPU_BF16_GEMV", gemv)
    monkeypatch.setenv("OCTAVO_CPU_BF16_GEMM", gemm)
    monkeypatch.setenv("OCTAVO_CPU_READ_ONCE_PREFETCH", prefetch)
    n, k = shape
    generator = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    for rows in row_counts:
        x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
        assert_within_definition(torch.ops.octavo_cpu.linear_bf16(x, weight, bias), x, weight, bias)
        assert_within_definition(torch.ops.octavo_cpu.linear_bf16(x, weight), x, weight, None)


def test_leading_dimensions_and_no_rows(cpu_kernels):
    weight = torch.randn(40, 64).to(torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    output = torch.ops.octavo_cpu.linear_bf16(x, weight)
    assert output.shape == (2, 3, 40)
    assert_within_definition(output.reshape(6, 40), x.reshape(6, 64), weight, None)
    assert torch.ops.octavo_cpu.linear_bf16(torch.empty(0, 64, dtype=torch.bfloat16), weight).shape == (0, 40)


def test_the_packed_copy_follows_the_weight(cpu_kernels):
    """The kernel packs a weight at its first call and reuses that copy while the weight lives unchanged: a weight
    written in place, and a new weight at the very address of a freed one, must not see the stale copy."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
    many = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    memory = bytearray(96 * 64 * 2)
    for _ in range(3):
        weight = torch.frombuffer(memory, dtype=torch.bfloat16).view(96, 64)  # a new tensor over the same bytes
        weight.copy_(torch.randn(96, 64, generator=generator))
        for rows in (x, many):
            assert_within_definition(torch.ops.octavo_cpu.linear_bf16(rows, weight), rows, weight, None)
        before = torch.ops.octavo_cpu.linear_bf16(x, weight)
        weight.mul_(2)
        assert torch.equal(torch.ops.octavo_cpu.linear_bf16(x, weight), (before.float() * 2).to(torch.bfloat16))
        del weight


def test_bad_arguments_name_what_is_wrong(cpu_kernels):
    x = torch.randn(2, 8).to(torch.bfloat16)
    weight = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="input must be a bfloat16"):
        torch.ops.octavo_cpu.linear_bf16(x.float(), weight)
    with pytest.raises(RuntimeError, match="weight must be a 2-d bfloat16"):
        torch.ops.octavo_cpu.linear_bf16(x, weight.float())
    with pytest.raises(RuntimeError, match="does not end in 16"):
        torch.ops.octavo_cpu.linear_bf16(x, torch.randn(4, 16).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias must be a bfloat16 tensor"):
        torch.ops.octavo_cpu.linear_bf16(x, weight, torch.randn(4))


def test_an_unknown_kernel_choice_is_refused(cpu_kernels, monkeypatch):
    weight = torch.randn(4, 8).to(torch.bfloat16)
    monkeypatch.setenv("OCTAVO_CPU_BF16_GEMM", "fast")
    with pytest.raises(RuntimeError, match="OCTAVO_CPU_BF16_GEMM must be aten or dot"):
        torch.ops.octavo_cpu.linear_bf16(torch.randn(9, 8).to(torch.bfloat16), weight)
    if cpu_target().level == "avx512":  # the only build with a choice of GEMV
        monkeypatch.setenv("OCTAVO_CPU_BF16_GEMV", "fast")
        with pytest.raises(RuntimeError, match="OCTAVO_CPU_BF16_GEMV must be widening"):
            torch.ops.octavo_cpu.linear_bf16(torch.randn(1, 8).to(torch.bfloat16), weight)
        monkeypatch.delenv("OCTAVO_CPU_BF16_GEMV")
    if cpu_target().avx512_bf16:  # the vdpbf16ps GEMV, the only kernel with a choice of prefetch hint
        monkeypatch.setenv("OCTAVO_CPU_READ_ONCE_PREFETCH", "t2")
        with pytest.raises(RuntimeError, match="OCTAVO_CPU_READ_ONCE_PREFETCH must be nta or t0"):
            torch.ops.octavo_cpu.linear_bf16(torch.randn(1, 8).to(torch.bfloat16), weight)


def test_fake_kernels_describe_the_output(cpu_kernels):
    weight = torch.randn(24, 40).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.octavo_cpu.linear_bf16.default, (torch.randn(3, 40).to(torch.bfloat16), weight),
                          test_utils=("test_schema", "test_faketensor"))


def _linear_graph() -> torch.fx.GraphModule:
    """x -> four aten.linear: over a bound bf16 weight, the same with a bf16 bias, a bound float32 weight (x cast
    to float32), and a weight that is a graph input; their outputs as a tuple."""
    root = torch.nn.Module()
    generator = torch.Generator().manual_seed(4)
    root.weight = torch.nn.Buffer((torch.randn(24, 40, generator=generator) * 0.1).to(torch.bfloat16))
    root.bias = torch.nn.Buffer(torch.randn(24, generator=generator).to(torch.bfloat16))
    root.weight32 = torch.nn.Buffer(torch.randn(24, 40, generator=generator))
    graph = torch.fx.Graph()
    x, given = graph.placeholder("x"), graph.placeholder("given")
    weight, bias, weight32 = (graph.get_attr(name) for name in ("weight", "bias", "weight32"))
    linear = torch.ops.aten.linear.default
    x32 = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.float32})
    graph.output((graph.call_function(linear, (x, weight)), graph.call_function(linear, (x, weight, bias)),
                  graph.call_function(linear, (x32, weight32)), graph.call_function(linear, (x, given))))
    return torch.fx.GraphModule(root, graph)


def test_cpu_backend_lowers_bound_bf16_linears_to_the_native_kernel(cpu_kernels, monkeypatch):
    """The linears over a bound bfloat16 weight (and bias) call linear_bf16; a float32 weight, or one the graph
    receives, stays ATen's (by default only where an AVX-512 ATen runs on a CPU with AMX tiles or AVX512_BF16).
    OCTAVO_CPU_BF16_LINEAR=aten keeps them all; the torch backend has no such kernel."""
    from octavo.codegen.lowering import lower_graph

    def linear_targets(backend: str) -> list:
        lowered = lower_graph(_linear_graph(), backend, torch.bfloat16)
        return [node.target for node in lowered.graph.nodes if node.op == "call_function" and "linear" in str(node)]

    native, aten = torch.ops.octavo_cpu.linear_bf16.default, torch.ops.aten.linear.default
    default = linear_targets("cpu")
    native_bf16 = torch.backends.cpu.get_cpu_capability().startswith("AVX512") and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert default == ([native, native, aten, aten] if native_bf16 else [aten] * 4)
    monkeypatch.setenv("OCTAVO_CPU_BF16_LINEAR", "native")  # any CPU: the kernel has a path for each
    assert linear_targets("cpu") == [native, native, aten, aten]
    assert linear_targets("torch") == [aten] * 4
    graph_module = lower_graph(_linear_graph(), "cpu", torch.bfloat16)
    x = torch.randn(3, 40).to(torch.bfloat16)
    given = torch.randn(24, 40).to(torch.bfloat16)
    outputs = graph_module(x, given)
    assert_within_definition(outputs[0], x, graph_module.weight, None)
    assert_within_definition(outputs[1], x, graph_module.weight, graph_module.bias)
    monkeypatch.setenv("OCTAVO_CPU_BF16_LINEAR", "aten")
    assert linear_targets("cpu") == [aten] * 4
    monkeypatch.setenv("OCTAVO_CPU_BF16_LINEAR", "fast")
    with pytest.raises(ValueError, match="OCTAVO_CPU_BF16_LINEAR must be native or aten"):
        lower_graph(_linear_graph(), "cpu", torch.bfloat16)
