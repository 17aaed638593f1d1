"""Names of the graph inputs that every layer agrees on.

The frontend traces a model into a graph whose token inputs are TOKEN_INPUTS
(``input_ids`` int64 [T], ``positions`` int64 [T]); passes read them by name
(fuse_rope evaluates the rotary tables over ``positions``); the runtime feeds
them every step.
"""

from __future__ import annotations

INPUT_IDS = "input_ids"
POSITIONS = "positions"
TOKEN_INPUTS = (INPUT_IDS, POSITIONS)
