"""Compile and engine configuration: the one place where defaults live."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from octavo.errors import OctavoError

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("bfloat16", "float16")
DEFAULT_BLOCK_SIZE = 16
QUANT_SCHEMES = ("none", "w8", "w8a8", "w4", "w4-awq", "w4-gptq", "w4-awq-gptq", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
VOCAB_QUANT = ("int8", "w4", "none")
DISTRIBUTED_EXECUTORS = ("auto", "mp", "ray")


@dataclass
class CompileConfig:
    """Options of `octavo compile`.

    Only `dtype`, `weight_dtype`, `block_size`, `disabled_passes` and the
    quantization options (`quant`, `group_size`, `kv_cache_dtype`, `calibration`)
    decide what the artifact computes; they (with the model checksum and the
    versions) form the compile cache key. Dump and print options only change
    what is written for reading. `group_size` None means the scheme's default;
    `calibration` is a text/JSONL file or "default" (the project's own text) for
    schemes that calibrate; `vocab_quant` is how a quantized artifact stores the
    embedding and lm_head.

    `dtype` "auto" is resolved by the compiler for the machine it runs on
    (bfloat16 where the CPU computes it natively, else float32 with bfloat16
    weight storage); the cache key and the manifest hold the resolved choice.
    `weight_dtype` (bfloat16 or float16) stores the linear and embedding
    weights of a float32 artifact in 16 bits; None stores them in `dtype`.
    `dtype_choice` says why a resolved "auto" chose what it did (None when
    the dtype was given).
    """

    dtype: str = "auto"
    weight_dtype: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    disabled_passes: tuple[str, ...] = ()
    quant: str = "none"
    group_size: int | None = None
    kv_cache_dtype: str = "auto"
    calibration: str | None = None
    vocab_quant: str = "int8"
    gptq_act_order: bool = False
    dump_dir: str | None = None
    stop_after: str | None = None
    print_ir_after: tuple[str, ...] = ()
    progress: bool = False
    dtype_choice: str | None = None
    lora_adapters: tuple[str, ...] = ()  # "name=path" of PEFT adapters the artifact serves from the start
    lora_targets: tuple[str, ...] = ()  # module names (PEFT target_modules) that get an octavo.lora
    max_lora_rank: int = 0  # the largest adapter rank the artifact takes (0: the largest given adapter's)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in SUPPORTED_DTYPES:
            raise OctavoError(f"unsupported dtype {self.dtype!r}: choose auto or one of {', '.join(SUPPORTED_DTYPES)}")
        if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_DTYPES:
            raise OctavoError(f"unsupported weight dtype {self.weight_dtype!r}: "
                              f"choose one of {', '.join(WEIGHT_DTYPES)}")
        if self.dtype in WEIGHT_DTYPES and self.weight_dtype not in (None, self.dtype):
            raise OctavoError(f"--weight-dtype {self.weight_dtype} needs float32 compute (--dtype float32 or auto); "
                              f"a {self.dtype} artifact stores its weights in {self.dtype}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise OctavoError(f"block_size must be a positive power of two, got {self.block_size}")
        self.disabled_passes = tuple(self.disabled_passes)
        self.print_ir_after = tuple(self.print_ir_after)
        if self.quant not in QUANT_SCHEMES:
            raise OctavoError(f"unknown quantization {self.quant!r}: choose one of {', '.join(QUANT_SCHEMES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise OctavoError(f"unknown kv cache dtype {self.kv_cache_dtype!r}: choose one of "
                              f"{', '.join(KV_CACHE_DTYPES)}")
        if self.calibration not in (None, "default") and not Path(self.calibration).expanduser().is_file():
            raise OctavoError(f"calibration file {self.calibration} does not exist")
        if self.vocab_quant not in VOCAB_QUANT:
            raise OctavoError(f"unknown vocab quantization {self.vocab_quant!r}: choose one of "
                              f"{', '.join(VOCAB_QUANT)}")
        if self.gptq_act_order and self.quant not in ("w4-gptq", "w4-awq-gptq"):
            raise OctavoError(f"--gptq-act-order applies to --quant w4-gptq or w4-awq-gptq, not {self.quant}")
        if self.quant == "w8a8" and self.group_size is not None:
            raise OctavoError("--quant w8a8 takes one scale per output channel (its kernels scale a row's int8 x "
                              "int8 sums once, after the activations' own steps): drop --group-size")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise OctavoError(f"group_size must be an even number >= 2, got {self.group_size}")
        self.lora_adapters, self.lora_targets = tuple(self.lora_adapters), tuple(self.lora_targets)
        for entry in self.lora_adapters:
            if "=" not in entry or not entry.partition("=")[0] or not entry.partition("=")[2]:
                raise OctavoError(f"--lora takes NAME=PATH (a PEFT adapter directory), got {entry!r}")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 0:
            raise OctavoError(f"max_lora_rank must be an integer >= 0, got {self.max_lora_rank!r}")

    def output_key(self) -> dict:
        """The options that decide the artifact's contents (for the manifest and the cache key)."""
        key = {
            "dtype": self.dtype,
            "block_size": self.block_size,
            "disabled_passes": sorted(self.disabled_passes),
            "stop_after": self.stop_after,
            **self._quantization_key(),
        }
        if self.storage_dtype != self.dtype:  # present only when narrowed (unnarrowed keys stay as they were)
            key["weight_dtype"] = self.storage_dtype
        if self.lora_targets:  # present only with LoRA (keys of other artifacts stay as they were)
            key.update(lora_targets=sorted(self.lora_targets), max_lora_rank=self.max_lora_rank,
                       lora_adapters=sorted(self.lora_adapters))
        return key

    @property
    def storage_dtype(self) -> str:
        """The dtype the linear and embedding weights are stored in."""
        return self.weight_dtype or self.dtype

    def _quantization_key(self) -> dict:
        """Quantization options, present only when set (keeps the key of unquantized artifacts unchanged)."""
        key: dict = {}
        if self.quant != "none":
            key.update(quant=self.quant, group_size=self.group_size, vocab_quant=self.vocab_quant)
        if self.gptq_act_order:
            key["gptq_act_order"] = True
        if self.kv_cache_dtype != "auto":
            key["kv_cache_dtype"] = self.kv_cache_dtype
        if self.calibration is not None:
            key["calibration"] = _file_digest(self.calibration)
        return key


def _file_digest(path: str) -> str:
    """'default' itself, or the sha256 of the calibration file's contents (a renamed file keeps its key)."""
    import hashlib

    if path == "default":
        return path
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError as error:
        raise OctavoError(f"cannot read calibration file {path}: {error}") from error


_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(value: int | str | None) -> int | None:
    """Parse "2GiB", "512MB", "1e9" or an int into a byte count."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _MEMORY_UNITS:
        raise OctavoError(f"cannot parse memory size {value!r}: use e.g. 2GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, parsed from ``METHOD[:PATH]:K[:OPTION...]`` (``--speculative``).

    ``ngram:K`` proposes up to K tokens by prompt lookup (n-grams of ``ngram_min..ngram_max``
    tokens, option ``n=MIN-MAX``); ``draft:PATH:K`` has the draft artifact at PATH propose K tokens.
    Option ``fixed`` always proposes K tokens; by default K is a maximum that a measured cost model
    lowers (down to no speculation) when verifying more tokens would not pay.
    """

    method: str
    num_tokens: int
    draft_path: str | None = None
    adaptive: bool = True
    ngram_min: int = 1
    ngram_max: int = 4

    @classmethod
    def parse(cls, spec: str) -> SpeculativeConfig:
        parts = spec.split(":")
        method = parts[0]
        if method not in ("ngram", "draft"):
            raise OctavoError(f"speculative method must be ngram or draft, got {spec!r} "
                              "(use ngram:K or draft:PATH:K)")
        path, parts = (parts[1], parts[2:]) if method == "draft" and len(parts) >= 3 else (None, parts[1:])
        if not parts or not parts[0].isdigit() or int(parts[0]) < 1:
            raise OctavoError(f"speculative {spec!r}: K, the number of proposed tokens, must be an integer >= 1 "
                              "(use ngram:K or draft:PATH:K)")
        options: dict = {"method": method, "num_tokens": int(parts[0]), "draft_path": path}
        for option in parts[1:]:
            if option in ("fixed", "adaptive"):
                options["adaptive"] = option == "adaptive"
            elif method == "ngram" and re.fullmatch(r"n=\d+-\d+", option):
                options["ngram_min"], options["ngram_max"] = map(int, option[2:].split("-"))
            else:
                raise OctavoError(f"speculative {spec!r}: unknown option {option!r} (fixed, adaptive"
                                  f"{', n=MIN-MAX' if method == 'ngram' else ''})")
        return cls(**options)

    def __post_init__(self) -> None:
        if self.method == "draft" and not self.draft_path:
            raise OctavoError("speculative draft needs the draft artifact's path: draft:PATH:K")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise OctavoError(f"speculative n-gram range must satisfy 1 <= min <= max, got "
                              f"{self.ngram_min}-{self.ngram_max}")


@dataclass
class EngineConfig:
    """Options of the runtime engine (LLM(...), octavo generate/serve/bench).

    Parallel engines: tensor_parallel_size x pipeline_parallel_size ranks.
    `distributed_executor` says who starts them: "mp" (Octavo starts the
    ranks of this machine as processes; with `nnodes` > 1 every machine runs
    the same command with its `node_rank`, and all meet at `distributed_init`,
    tcp://HOST:PORT of node 0), "ray" (an actor per rank on a Ray cluster),
    or "auto":
    the launcher that started this process (torchrun, srun: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT or SLURM's variables) when there is one, else
    "mp". `collective_timeout` bounds every wait within a step (seconds),
    `rendezvous_timeout` the wait for the other ranks at start-up (they load
    and may compile their programs); `pipeline_depth` is how many batches are
    in flight through the stages (default: pipeline_parallel_size).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int | str = "1GiB"
    device: str = "auto"
    backend: str = "auto"
    executor: str = "auto"  # compiled | eager; auto: OCTAVO_EXECUTOR, else compiled where it can be built
    num_threads: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_init: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    collective_timeout: float = 60.0
    rendezvous_timeout: float = 600.0
    distributed_executor: str = "auto"
    pipeline_depth: int | None = None
    speculative: str | SpeculativeConfig | None = None
    max_loras: int = 4  # LoRA adapter slots (artifacts compiled with LoRA)
    lora_modules: tuple[str, ...] = ()  # "name=path" PEFT adapters loaded at start, besides the artifact's own
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lora_modules = tuple(self.lora_modules)
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise OctavoError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        for entry in self.lora_modules:
            if not entry.partition("=")[0] or not entry.partition("=")[2]:
                raise OctavoError(f"--lora-modules takes NAME=PATH (a PEFT adapter directory), got {entry!r}")
        self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        self.swap_space = parse_memory_size(self.swap_space)
        if self.max_num_seqs < 1:
            raise OctavoError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise OctavoError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise OctavoError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise OctavoError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise OctavoError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.backend not in ("auto", "torch", "triton", "cpu"):
            raise OctavoError(f"backend must be auto, torch, triton or cpu, got {self.backend!r}")
        if isinstance(self.speculative, str):
            self.speculative = SpeculativeConfig.parse(self.speculative)
        if self.executor not in ("auto", "compiled", "eager"):
            raise OctavoError(f"executor must be auto, compiled or eager, got {self.executor!r}")
        self._check_parallel()

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise OctavoError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise OctavoError(f"node_rank must be in 0..{self.nnodes - 1} for nnodes {self.nnodes}, "
                              f"got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise OctavoError(f"{self.world_size} ranks (tensor x pipeline parallel size) do not divide evenly over "
                              f"{self.nnodes} nodes")
        if self.nnodes > 1 and not self.distributed_init:
            raise OctavoError("nnodes > 1 needs distributed_init (tcp://HOST:PORT of node 0)")
        if self.distributed_init and not self.distributed_init.startswith("tcp://"):
            raise OctavoError(f"distributed_init must be tcp://HOST:PORT, got {self.distributed_init!r}")
        if self.pipeline_depth is not None and self.pipeline_depth < 1:
            raise OctavoError(f"pipeline_depth must be >= 1, got {self.pipeline_depth}")
        for name in ("collective_timeout", "rendezvous_timeout"):
            if not getattr(self, name) > 0:  # NaN too
                raise OctavoError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.distributed_executor not in DISTRIBUTED_EXECUTORS:
            raise OctavoError(f"distributed_executor must be one of {', '.join(DISTRIBUTED_EXECUTORS)}, "
                              f"got {self.distributed_executor!r}")
        if self.distributed_executor == "ray" and (self.nnodes > 1 or self.distributed_init):
            raise OctavoError("distributed_executor ray places the ranks itself: nnodes, node_rank and "
                              "distributed_init belong to the mp executor")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise OctavoError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


@dataclass(frozen=True)
class RankPosition:
    """Where one rank sits in a tensor x pipeline parallel layout.

    Global rank = pp_rank * tp_size + tp_rank: the ranks of one pipeline
    stage form one tensor-parallel group, and rank 0 is stage 0, shard 0.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> RankPosition:
        if not 0 <= rank < tp_size * pp_size:
            raise OctavoError(f"rank {rank} is outside a layout of {tp_size} x {pp_size} ranks")
        return cls(tp_size, rank % tp_size, pp_size, rank // tp_size)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size
