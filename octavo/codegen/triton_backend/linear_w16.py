"""octavo.linear_w16 on the Triton backend: torch's matmul over the widened weight (no template kernel yet)."""

from octavo.codegen.torch_backend.linear import linear_w16

__all__ = ["linear_w16"]
