"""CompiledExecutor: the bound, lowered graph compiled ahead of time by AOTInductor, run without Python dispatch.

The graph is exported once with torch.export (every runtime dimension
symbolic: tokens, sequences, block-table width, logits rows, KV pool size) and
compiled by AOTInductor into a shared library whose C++ wrapper calls the
kernels: Inductor's own C++ loops for the pointwise octavo ops, which are
decomposed into ATen so that Inductor fuses them (norms, RoPE, activations,
fused_pointwise groups, with the views around them), GEMMs for the linears,
and the backend's opaque custom ops (paged attention, 16-bit linears) through
the dispatcher. One package serves every step shape, so the decode ladder's
buckets and prefills of any length share it.

The graph is frozen: weights are constants of the package, and Inductor
prepacks every linear's weight for oneDNN's GEMMs (up to 1.7x faster than
MKL on unpacked weights for prefill-sized GEMMs, measured on an AMD
AVX-512 machine, where MKL takes a generic path); a bfloat16 model's linears on
the cpu backend are octavo_cpu::linear_bf16 calls instead, over the plain weight,
which the op packs for its own kernels at its first call. So the package holds a copy
of the weights: it is a cache of this machine, never part of the artifact,
and lives under ``cache_root()/executor``, keyed by the artifact's file
checksums (weights included), the backend, the lowered graph's code (which
names the kernels chosen for this machine), the names, shapes and dtypes of
the weights as lowering packed them (a kernel's packing is baked into the
package), the CPU's vector ISA, the thread
count (generated loops are parallelized for it), the torch and octavo
versions, this module's format and, for the program of one rank of a
parallel engine, the rank's position and world size (its weights are its
shard). A rank's package names its collectives' groups logically ("tp"), so
it holds nothing of one launch's process groups. Inductor's own scratch files go under
``cache_root()/inductor`` unless TORCHINDUCTOR_CACHE_DIR says otherwise. A
warm start loads the package in well under a second plus reading its weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.fx import GraphModule

from octavo.cache_dir import cache_root
from octavo.runtime.executor import GraphExecutor
from octavo.runtime.inductor_patches import stable_int_array_declarations, without_extern_kernel_comments
from octavo.version import __version__

logger = logging.getLogger(__name__)

FORMAT = 4
"""Bumped whenever what this module compiles changes, so that older packages are not reused."""

LIBRARY, OP_TABLE = "model.so", "model.json"

DECOMPOSED_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul",
                  "fused_pointwise", "embedding_w8", "embedding_w4")
"""Pointwise octavo ops (and the quantized embedding gathers) whose torch kernels are inlined as ATen for
Inductor to fuse (the rest stay opaque)."""

# Example sizes of the symbolic dimensions, distinct so that no two dimensions look alike while tracing.
_EXAMPLE_SIZES = {"T": 5, "B": 3, "B + 1": 4, "max_blocks": 6, "N": 2, "num_blocks": 7, "max_loras": 9}


class CompilationUnavailableError(RuntimeError):
    """The compiled executor cannot be built here (no C++ compiler, or the compile failed)."""


def package_key(manifest: dict, backend: str, lowered: GraphModule, scope: dict | None = None) -> str:
    """sha256 of everything that decides the compiled code (see the module docstring)."""
    payload = {
        **({"scope": scope} if scope else {}),
        "format": FORMAT,
        "artifact_files": manifest.get("files", {}),
        "backend": backend,
        # The kernels lowering chose on this machine (for quantized linears they depend on its bf16 support).
        "lowered_graph": hashlib.sha256(lowered.code.encode()).hexdigest(),
        # The package holds the weights as packed at load: a kernel's packing (shape, dtype) is part of the code.
        "constants": hashlib.sha256(repr([(name, tuple(tensor.shape), str(tensor.dtype))
                                          for name, tensor in lowered.named_buffers()]).encode()).hexdigest(),
        "decomposed": DECOMPOSED_OPS,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "octavo": __version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def package_path(manifest: dict, backend: str, lowered: GraphModule, scope: dict | None = None) -> Path:
    """The package directory: the compiled library (model.so, weights inside) and its op table (model.json)."""
    return cache_root() / "executor" / package_key(manifest, backend, lowered, scope)


def check_compiler() -> None:
    """Raise CompilationUnavailableError naming what is missing when Inductor cannot build C++ here."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        raise CompilationUnavailableError(f"no C++ compiler found ({compiler}, g++ or clang++ on PATH); "
                                          "install one (e.g. apt install g++) to compile the graph")


class CompiledExecutor:
    """Runs the graph of `eager` (a GraphExecutor, already bound and lowered) as an AOTInductor package.

    `run(inputs)` takes the same inputs as GraphExecutor.run. Compiles into the
    cache on first use for this (artifact, backend, machine, `scope`); raises
    CompilationUnavailableError when it cannot.
    """

    kind = "compiled"

    def __init__(self, eager: GraphExecutor, manifest: dict, backend: str, scope: dict | None = None):
        if eager.device.type != "cpu":
            raise CompilationUnavailableError("the compiled executor runs on CPU")
        self.eager = eager
        self.graph_module = eager.graph_module
        self.input_names = eager.input_names
        self.device = eager.device
        self.path = package_path(manifest, backend, eager.graph_module, scope)
        self.compile_seconds = 0.0
        if not (self.path / LIBRARY).is_file():
            check_compiler()
            logger.warning("compiling the graph for this machine (first use of this artifact here, up to a minute "
                           "for a small model; cached in %s)", self.path.parent)
            start = time.perf_counter()
            compile_package(eager, manifest["signature"], self.path)
            self.compile_seconds = time.perf_counter() - start
            logger.info("compiled the graph into %s in %.1fs", self.path, self.compile_seconds)
        start = time.perf_counter()
        # The library is loaded in place (no copy to a temporary directory, as a .pt2 package would be).
        self._runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(self.path / LIBRARY), 1)
        self.load_seconds = time.perf_counter() - start

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        missing = [name for name in self.input_names if name not in inputs]
        if missing:
            raise KeyError(f"graph inputs not provided: {missing}")
        rows = inputs["logits_indices"].shape[0]
        if rows == 0:
            # The package is compiled for at least one logits row: compute one, return none.
            inputs = {**inputs, "logits_indices": inputs["logits_indices"].new_zeros(1)}
        with torch.inference_mode():
            logits = self._runner.run([inputs[name] for name in self.input_names])[0]
        return logits[:rows]


def export_graph(eager: GraphExecutor, signature: dict) -> torch.export.ExportedProgram:
    """torch.export of the lowered graph with DECOMPOSED_OPS inlined and every runtime dimension symbolic.

    `signature` is the manifest's graph signature: each input's dtype and shape, whose named
    dimensions (T, B, B + 1, max_blocks, N, num_blocks) become symbolic.
    """
    from torch.export import Dim

    seqs = Dim("B", min=1)
    dims = {"T": Dim("T", min=1), "B": seqs, "B + 1": seqs + 1, "max_blocks": Dim("max_blocks", min=1),
            "N": Dim("N", min=1), "num_blocks": Dim("num_blocks", min=1), "max_loras": Dim("max_loras", min=1)}
    graph_module = _decomposed_copy(eager.graph_module)
    inputs = signature["inputs"]
    example, dynamic = [], []
    for name in eager.input_names:
        if name not in inputs:
            raise CompilationUnavailableError(f"the artifact's signature does not describe graph input {name}")
        shape, spec = [], {}
        for axis, size in enumerate(inputs[name]["shape"]):
            if isinstance(size, int):
                shape.append(size)
                continue
            if size not in dims:
                raise CompilationUnavailableError(f"graph input {name} has an unknown dimension {size!r}")
            shape.append(_EXAMPLE_SIZES[size])
            spec[axis] = dims[size]
        example.append(torch.zeros(shape, dtype=getattr(torch, inputs[name]["dtype"])))
        dynamic.append(spec or None)
    with torch.no_grad():
        return torch.export.export(graph_module, tuple(example), dynamic_shapes=tuple(dynamic), strict=False)


def compile_package(eager: GraphExecutor, signature: dict, path: Path) -> None:
    """Export and AOT-compile the graph of `eager` into the package directory `path` (written atomically).

    AOTInductor leaves its compiled library and the library's table of the custom ops it calls
    back (the .json next to it, which the runner reads) in its cache directory; both are moved
    into the package. (Packaging them as a .pt2 archive to extract them again wrote and read the
    library, weights inside, twice more: 2.3 s of a cold start for SmolLM2.)
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    # Recording a Python stack trace for every traced node is a third of the tracing time, for error
    # messages only: the graph's nodes come from the artifact, not from Python source worth pointing at.
    # (older torch releases, 2.11 among them, have no such switch and always record them.)
    has_switch = hasattr(torch.fx.config, "do_not_emit_stack_traces")
    previous = torch.fx.config.do_not_emit_stack_traces if has_switch else None
    if has_switch:
        torch.fx.config.do_not_emit_stack_traces = True
    probe = probe_vector_isa_in_background()
    try:
        program = export_graph(eager, signature)
        probe.join()
        path.parent.mkdir(parents=True, exist_ok=True)
        # Inductor freezes the graph (folds the weights in, prepacks them for oneDNN) only without autograd.
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".compiling-") as scratch, torch.no_grad(), \
                without_extern_kernel_comments(), stable_int_array_declarations():
            args, kwargs = program.example_inputs
            files = torch._inductor.aot_compile(program.module(check_guards=False), args, kwargs, options={
                "aot_inductor.package": True,  # return the generated files instead of loading the library
                "freezing": True,
                # Each generated kernel is a torch.profiler range (a flag check while no profiler runs).
                "cpp.enable_kernel_profile": True,
                # The wrapper is a straight line of kernel calls, and it is compiled once per machine:
                # optimizing it (O1) took 17.6 s of gcc against 10.5 s at O0 for SmolLM2 and takes 0.45 ms
                # off a 12.5 ms single-sequence decode step (3.6%, its per-op handle and view code inlined).
                "aot_inductor.compile_wrapper_opt_level": "O1",
                # Precompiling the headers of the wrapper and of the kernels took 8.4 s of g++ on a machine
                # that had none yet (Inductor keeps them in the system's temporary directory, for every
                # later compile with this torch) to save 1.7 s of the two compiles (wrapper 5.7 -> 5.0 s,
                # kernels 1.7 -> 0.7 s): a cold start is 6.7 s faster without them, a later compile of
                # another artifact 1.7 s slower.
                "aot_inductor.precompile_headers": False,
            })
            staged = Path(scratch) / "package"
            _stage_library(files, staged)
            if path.exists():  # another process finished the same compile first
                return
            os.replace(staged, path)
    except CompilationUnavailableError:
        raise
    except Exception as error:  # Inductor fails in many ways (compiler errors, unsupported ops)
        raise CompilationUnavailableError(f"compiling the graph failed: {type(error).__name__}: {error}") from error
    finally:
        if has_switch:
            torch.fx.config.do_not_emit_stack_traces = previous


def probe_vector_isa_in_background() -> threading.Thread:
    """Start Inductor's probe of this machine's vector ISAs on another thread and return the thread.

    Before it generates code, Inductor checks each vector ISA the CPU reports by compiling and
    loading a test program that includes ATen's vector headers: about 20 s of g++ on a machine
    whose Inductor cache has never seen them (cached afterwards). The export before it runs Python
    on one core, so the probe's compiler processes overlap it on another. A probe that fails here
    changes nothing: Inductor probes again, in the calling thread, when it needs the answer.
    """
    from torch._inductor import cpu_vec_isa

    def probe() -> None:
        try:
            cpu_vec_isa.pick_vec_isa()
        except Exception as error:  # the compile probes again and reports what matters
            logger.debug("vector ISA probe failed: %s", error)

    thread = threading.Thread(target=probe, name="octavo-vector-isa-probe", daemon=True)
    thread.start()
    return thread


def _stage_library(files: list, directory: Path) -> None:
    """Move the compiled library and its op table out of the files AOTInductor generated into `directory`."""
    directory.mkdir()
    paths = [Path(file) for file in files if isinstance(file, (str, os.PathLike))]
    for suffix, target, move in ((".wrapper.so", LIBRARY, True), (".wrapper.json", OP_TABLE, False)):
        found = [file for file in paths if file.name.endswith(suffix)]
        if len(found) != 1:
            raise CompilationUnavailableError(f"AOTInductor generated {len(found)} files *{suffix}, expected one")
        # The library holds the weights: moved, not copied, so that no second copy stays in Inductor's cache.
        (shutil.move if move else shutil.copyfile)(found[0], directory / target)


def _decomposed_copy(graph_module: GraphModule) -> GraphModule:
    """A copy of the lowered graph whose DECOMPOSED_OPS nodes call the torch kernels (ATen code) instead."""
    from octavo.codegen.torch_backend import PYTHON_KERNELS

    kernels = {op.name().split("::")[1]: kernel for op, kernel in PYTHON_KERNELS.items()}
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            name = node.target.name().split("::")[-1]
            if name in DECOMPOSED_OPS and name in kernels:
                node.target = kernels[name]
    # Built from the finished graph, so the copy takes the weights its get_attr nodes name.
    return GraphModule(graph_module, graph)
