"""The octavo:: custom op set. Importing this package registers every op with torch.library."""

from octavo.ir.ops import (  # noqa: F401
    activation,
    attention,
    collectives,
    fused_pointwise,
    linear,
    lora,
    moe,
    norm,
    quantized_linear,
    rotary,
)

OCTAVO_NAMESPACE = "octavo"
