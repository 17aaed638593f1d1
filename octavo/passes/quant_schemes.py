"""Weight quantization schemes: what each `--quant` option does to linears, the embedding and lm_head.

A scheme is the plug-in point of quantize_weights. The pass asks the scheme, in order:

1. ``prepare(graph_module, ctx)``: transform float weights before anything is quantized.
   It may rewrite ``ctx.weights`` in place as long as the graph computes the same function
   in exact arithmetic; AWQ folds its per-input-channel scales here (``W[:, j] *= s[j]`` on
   the linears that read a norm's output, ``norm_weight[j] /= s[j]`` on that norm).
2. ``quantize_linear(name, weight, ctx)`` for every linear weight (after fusion, so one call
   per fused qkv / gate_up weight) that has no value supplied in ``ctx.provided_weights``:
   returns the QuantizedWeight to store. RTN by default; calibrated schemes return their own
   already computed values (scales, zeros, packed q) here.
3. ``quantize_vocab(name, weight, ctx)`` for the embedding table and lm_head (tied or not).

``prepare`` must not write into the tensors of ``ctx.weights`` (compile_variants shares them
between artifacts): it puts new tensors in their place. A calibrated scheme (``calibrated=True``)
finds the calibration text's token ids in ``ctx.calibration`` (a Calibration; the compiler
tokenizes ``--calibration FILE`` or the built-in text and runs the float model on it, leaving the
statistics of every linear's input in ``ctx.calibration.linear_inputs``, see weight_input_stats),
and the manifest records which text it was and how many of its tokens were used.

Registering a scheme: ``register_scheme("w4-awq", factory)`` where ``factory(config)``
returns a QuantScheme (subclass; pass ``**vocab_options(config)`` to honour --vocab-quant);
that also removes the name from NOT_YET_AVAILABLE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor
from torch.fx import GraphModule

from octavo.config import CompileConfig
from octavo.errors import OctavoError
from octavo.ir.linear_input_stats import LinearInputStats
from octavo.ir.quantized_layout import FP8, W4, W8, QuantizedWeight
from octavo.passes.quantize_rtn import quantize_fp8, quantize_w4, quantize_w8

DEFAULT_W4_GROUP_SIZE = 32
"""Chosen by measurement on SmolLM2 (perplexity per group size): see quantize_weights' docstring."""
CALIBRATION_RUNS = 32
CALIBRATION_RUN_TOKENS = 512
"""Calibrated schemes see at most 32 runs of 512 tokens (16384; the default text has about 14.5k)."""

VOCAB_LAYOUTS = {"int8": W8, "w4": W4, "none": None}
VOCAB_REASONS = {
    "int8": "the embedding table and the lm_head (one tensor when tied) are int8 with one scale per vocabulary "
            "row (GGUF's Q8_0 table kept as it is): measured on SmolLM2 (w4, 8191 tokens), 4 bits there cost "
            "+5.7% perplexity (15.22 against 14.39) for 0.33x instead of 0.37x of the bf16 weights; float would "
            "leave a fifth of the model's bytes unquantized",
    "w4": "the embedding table and the lm_head are 4-bit groups of 32 like the linears (--vocab-quant w4): the "
          "smallest artifact, at a perplexity cost (SmolLM2: +5.7%)",
    "none": "the embedding table and the lm_head stay float (--vocab-quant none)",
}


@dataclass
class QuantScheme:
    """RTN quantization into ``layout`` (w8, w4 or fp8); embedding and lm_head per ``vocab_layout``.

    ``group_size`` None means one scale per output channel (w8); ``vocab_layout`` None leaves
    the embedding and lm_head in float. ``calibrated`` schemes read ``ctx.calibration``.
    """

    name: str
    layout: str
    group_size: int | None
    vocab_layout: str | None = W8
    vocab_reason: str = VOCAB_REASONS["int8"]
    calibrated: bool = False
    activations: str | None = None  # "int8": the linears' inputs are rounded to int8 at run time (w8a8)

    def prepare(self, graph_module: GraphModule, ctx) -> None:
        """Pre-transforms of float weights (none for RTN)."""

    def quantize_linear(self, name: str, weight: Tensor, ctx) -> QuantizedWeight:
        return rtn(self.layout, weight, self.group_size)

    def quantize_vocab(self, name: str, weight: Tensor, ctx) -> QuantizedWeight:
        return rtn(self.vocab_layout, weight, DEFAULT_W4_GROUP_SIZE if self.vocab_layout == W4 else None)

    def describe(self) -> dict:
        record = {"scheme": self.name, "layout": self.layout, "group_size": self.group_size,
                  "calibrated": self.calibrated}
        if self.activations is not None:
            record["activations"] = {"dtype": self.activations,
                                     "granularity": "groups of 64 columns of a row, dynamic, symmetric",
                                     "except": "the linear that produces the logits"}
        return record

    def sequential_key(self) -> tuple | None:
        """None when the scheme reads statistics of the float model; else what its sequential statistics depend on.

        A sequential scheme's statistics come from a calibration run in which every linear already
        uses the value ``replace_calibrated_weight`` gives it (see frontend.calibration), so
        calibrations can only be shared between configs with the same key.
        """
        return None

    def replace_calibrated_weight(self, name: str, weight: Tensor, stats: LinearInputStats,
                                  calibration: Calibration) -> Tensor:
        """The value the sequential calibration run uses for traced weight `name` from then on (the weight itself)."""
        return weight


def rtn(layout: str, weight: Tensor, group_size: int | None) -> QuantizedWeight:
    """RTN of ``weight`` into ``layout``; w4 needs a group size, w8 takes None for per-channel."""
    if layout == W8:
        return quantize_w8(weight, group_size)
    if layout == W4:
        return quantize_w4(weight, group_size or DEFAULT_W4_GROUP_SIZE)
    if layout == FP8:
        return quantize_fp8(weight)
    raise ValueError(f"unknown layout {layout!r}")


@dataclass
class Calibration:
    """Calibration text as token ids (the whole text, in order), for calibrated schemes (ctx.calibration).

    ``source`` names the text ("default": the standard library docstrings' calibration part,
    else the file given); ``sha256`` is the text's digest. ``linear_inputs`` maps weight
    placeholder names of the traced graph to the statistics of their linear's input over the
    ``runs`` runs (``run_tokens`` tokens in all) the compiler ran the float model on (a sequential
    scheme: the model whose earlier linears are already quantized); ``solved`` is where a
    sequential scheme keeps what it computed during that run, by traced weight name. The
    manifest records ``description``.
    """

    source: str
    sha256: str
    token_ids: list[int]
    linear_inputs: dict[str, LinearInputStats] = field(default_factory=dict)
    runs: int = 0
    run_tokens: int = 0
    solved: dict = field(default_factory=dict)

    @property
    def description(self) -> dict:
        return {"source": self.source, "sha256": self.sha256, "tokens": len(self.token_ids),
                "runs": self.runs, "tokens_used": self.run_tokens}

    def calibration_runs(self) -> list[list[int]]:
        """What the float model runs on: up to CALIBRATION_RUNS runs of CALIBRATION_RUN_TOKENS tokens, in text
        order, or the whole text as one run when it is shorter than one."""
        runs = self.samples(CALIBRATION_RUN_TOKENS, CALIBRATION_RUNS)
        return runs or ([self.token_ids] if len(self.token_ids) >= 2 else [])

    def samples(self, length: int, count: int | None = None) -> list[list[int]]:
        """Consecutive, non-overlapping runs of `length` tokens (at most `count` of them), in text order."""
        runs = [self.token_ids[start:start + length] for start in range(0, len(self.token_ids) - length + 1, length)]
        return runs if count is None else runs[:count]


def weight_input_stats(name: str, ctx) -> LinearInputStats | None:
    """Calibration statistics of the input of the linear with weight `name` (a fused weight: its first part's,
    which all parts share), None without calibration or when the compiler recorded none."""
    calibration = ctx.calibration
    if calibration is None:
        return None
    parts = ctx.merged_weights.get(name, [name])
    return calibration.linear_inputs.get(parts[0])


SchemeFactory = Callable[[CompileConfig], QuantScheme]

def vocab_options(config: CompileConfig) -> dict:
    """The QuantScheme fields that --vocab-quant decides (for scheme factories)."""
    return {"vocab_layout": VOCAB_LAYOUTS[config.vocab_quant], "vocab_reason": VOCAB_REASONS[config.vocab_quant]}


SCHEMES: dict[str, SchemeFactory] = {
    "w8": lambda config: QuantScheme("w8", W8, config.group_size, **vocab_options(config)),
    "w8a8": lambda config: QuantScheme("w8a8", W8, None, activations="int8", **vocab_options(config)),
    "w4": lambda config: QuantScheme("w4", W4, config.group_size or DEFAULT_W4_GROUP_SIZE, **vocab_options(config)),
    "fp8": lambda config: QuantScheme("fp8", FP8, None, **vocab_options(config)),
}

NOT_YET_AVAILABLE: dict[str, str] = {}


def _awq(config: CompileConfig) -> QuantScheme:
    from octavo.passes.quantize_awq import AWQScheme

    return AWQScheme("w4-awq", W4, config.group_size or DEFAULT_W4_GROUP_SIZE, calibrated=True,
                     **vocab_options(config))


def _gptq(config: CompileConfig) -> QuantScheme:
    from octavo.passes.quantize_gptq import GPTQScheme

    return GPTQScheme("w4-gptq", W4, config.group_size or DEFAULT_W4_GROUP_SIZE, calibrated=True,
                      act_order=config.gptq_act_order, **vocab_options(config))


def _awq_gptq(config: CompileConfig) -> QuantScheme:
    from octavo.passes.quantize_awq_gptq import AWQGPTQScheme

    return AWQGPTQScheme("w4-awq-gptq", W4, config.group_size or DEFAULT_W4_GROUP_SIZE, calibrated=True,
                         act_order=config.gptq_act_order, **vocab_options(config))


def register_scheme(name: str, factory: SchemeFactory) -> None:
    """Make ``--quant name`` available (see the module docstring)."""
    SCHEMES[name] = factory
    NOT_YET_AVAILABLE.pop(name, None)


register_scheme("w4-awq", _awq)
register_scheme("w4-gptq", _gptq)
register_scheme("w4-awq-gptq", _awq_gptq)


def scheme_for(config: CompileConfig) -> QuantScheme | None:
    """The scheme of ``config.quant`` (None for "none"); a clear error for schemes not yet built."""
    if config.quant == "none":
        return None
    if config.quant in SCHEMES:
        if config.group_size is not None and config.quant == "fp8":
            raise OctavoError("fp8 uses one scale per output channel: --group-size does not apply")
        return SCHEMES[config.quant](config)
    if config.quant in NOT_YET_AVAILABLE:
        raise OctavoError(f"--quant {config.quant} is not yet available in this version of Octavo: "
                          f"{NOT_YET_AVAILABLE[config.quant]} is being built; use --quant w4 (round to nearest) "
                          "meanwhile")
    raise OctavoError(f"unknown quantization scheme {config.quant!r}; available: {', '.join(sorted(SCHEMES))}")
