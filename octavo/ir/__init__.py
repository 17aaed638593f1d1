"""The Octavo IR: the octavo:: op set and graph utilities shared by every layer."""

from octavo.ir import ops  # noqa: F401  (registers the custom ops)
