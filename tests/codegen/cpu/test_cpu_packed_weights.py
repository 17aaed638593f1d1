"""The packed copy linear_bf16 multiplies by: its layout against the one bf16_packing.h defines, and its pages.

Layout (the definition): W [N, K] as blocks of 32 weight rows; block b holds round_up(K, 32) / 2 rows of 32-bit
words, word (p, c) = W[32 b + c, 2 p] in its low 16 bits and W[32 b + c, 2 p + 1] in its high 16 bits, zero past
N and K.

Pages: packed copies are carved from mappings advised for transparent huge pages (MADV_HUGEPAGE), so that the GEMV
streams them on 2 MiB pages; weights the quantized linears read where they lie are moved onto huge pages at their
first call (MADV_COLLAPSE). Whether Linux hands out a huge page depends on its settings, read here from
/sys/kernel/mm/transparent_hugepage: with "enabled" at always or madvise and "defrag" at a mode that compacts
memory for an advised fault (always, madvise, defer+madvise), every 2 MiB page inside a packed copy must be a huge
one; a collapse needs Linux 6.1 or later and "enabled" other than never, whatever "defrag" says. With "enabled" at
never, no page may be huge. OCTAVO_CPU_HUGE_PAGES=0 drops both (then, with "enabled" at madvise, no page of a
packed copy may be huge); another value is refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

THP = Path("/sys/kernel/mm/transparent_hugepage")
HUGE_PAGE = 2 << 20


def thp_mode(name: str) -> str:
    """The selected mode of a THP setting ("[madvise]" in "always [madvise] never"), or "" where there is none."""
    try:
        text = (THP / name).read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


def reference_packing(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    blocks, pairs = -(-n // 32), -(-k // 32) * 16
    padded = torch.zeros(blocks * 32, 2 * pairs, dtype=torch.int64)
    padded[:n, :k] = weight.view(torch.int16).to(torch.int64) & 0xFFFF
    words = padded[:, 0::2] | (padded[:, 1::2] << 16)  # [blocks * 32, pairs]
    return words.view(blocks, 32, pairs).transpose(1, 2).to(torch.int64)


def huge_bytes_of(address: int) -> int:
    """AnonHugePages (bytes) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and all(c in "0123456789abcdef-" for c in fields[0]):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def whole_huge_pages(address: int, nbytes: int) -> int:
    first, end = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return max(0, (end - first) // HUGE_PAGE)


@pytest.mark.parametrize("shape", [(64, 64), (37, 100), (96, 1536)], ids=["aligned", "odd", "deep"])
def test_the_packed_copy_has_the_defined_layout(shape, cpu_kernels):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=generator).to(torch.bfloat16)
    packed = torch.ops.octavo_cpu.linear_bf16_packed(weight)
    assert packed.dtype == torch.int32 and packed.is_contiguous()
    assert torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, reference_packing(weight) & 0xFFFFFFFF)


def test_packed_copies_lie_on_huge_pages_where_linux_gives_them(cpu_kernels):
    weight = torch.randn(3072, 1024).to(torch.bfloat16)  # 6 MiB packed: two or more whole 2 MiB pages inside
    packed = torch.ops.octavo_cpu.linear_bf16_packed(weight)
    whole = whole_huge_pages(packed.data_ptr(), packed.nbytes)
    assert whole >= 2
    enabled, defrag = thp_mode("enabled"), thp_mode("defrag")
    if enabled in ("always", "madvise") and defrag in ("always", "madvise", "defer+madvise"):
        assert huge_bytes_of(packed.data_ptr()) >= whole * HUGE_PAGE
    elif enabled in ("never", ""):
        assert huge_bytes_of(packed.data_ptr()) == 0
    # Other settings hand out a huge page only where one is free at once: the layout test above covers the values.
    x = torch.randn(1, 1024).to(torch.bfloat16)
    exact = x.double() @ weight.double().T
    assert (torch.ops.octavo_cpu.linear_bf16(x, weight).double() - exact).abs().max() < 0.05 * exact.abs().max()


def test_weights_read_in_place_are_moved_onto_huge_pages(cpu_kernels):
    qweight = torch.randint(-128, 128, (4096, 1024), dtype=torch.int8)  # 4 MiB: at least one whole 2 MiB page
    scales = torch.rand(4096, 1) * 0.01
    x = torch.randn(1, 1024).to(torch.bfloat16)
    before = qweight.clone()
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 1024, True)
    assert torch.equal(qweight, before)
    exact = x.double() @ (qweight.double() * scales.double()).T
    assert (output.double() - exact).abs().max() < 0.05 * exact.abs().max()
    release = tuple(int(part) for part in os.uname().release.split(".")[:2] if part.isdigit())
    whole = whole_huge_pages(qweight.data_ptr(), qweight.nbytes)
    if thp_mode("enabled") in ("always", "madvise") and release >= (6, 1):
        assert huge_bytes_of(qweight.data_ptr()) >= whole * HUGE_PAGE
    elif thp_mode("enabled") in ("never", ""):
        assert huge_bytes_of(qweight.data_ptr()) == 0


_PACK_IN_A_CHILD = """
import json, torch
from octavo.codegen.cpu_backend.build import load_cpu_kernels
from tests.codegen.cpu.test_cpu_packed_weights import huge_bytes_of, reference_packing
load_cpu_kernels()
weight = torch.randn(3072, 1024).to(torch.bfloat16)
try:
    packed = torch.ops.octavo_cpu.linear_bf16_packed(weight)
except RuntimeError as error:
    print(json.dumps({"error": str(error).splitlines()[0]}))
else:
    equal = torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, reference_packing(weight) & 0xFFFFFFFF)
    print(json.dumps({"huge": huge_bytes_of(packed.data_ptr()), "equal": equal}))
"""


def pack_in_a_child(value: str) -> dict:
    environment = {**os.environ, "OCTAVO_CPU_HUGE_PAGES": value}
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, "-c", _PACK_IN_A_CHILD], cwd=root, env=environment,
                            capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_huge_pages_can_be_turned_off_and_a_bad_switch_is_refused(cpu_kernels):
    off = pack_in_a_child("0")
    assert off["equal"]
    if thp_mode("enabled") in ("madvise", "never", ""):  # "always" backs unadvised memory with huge pages too
        assert off["huge"] == 0
    refused = pack_in_a_child("yes")
    assert "OCTAVO_CPU_HUGE_PAGES must be 0 or 1" in refused["error"]
