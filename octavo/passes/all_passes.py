"""Imports every pass module so that each registers itself."""

from octavo.passes import canonicalize, match_attention, prune_logits  # noqa: F401
