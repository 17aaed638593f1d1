"""The octavo:: custom op set. Importing this package registers every op with torch.library."""

from octavo.ir.ops import activation, attention, collectives, fused_pointwise, norm, rotary  # noqa: F401

OCTAVO_NAMESPACE = "octavo"
