"""The defaults of `octavo serve`'s limits, in a module that imports nothing: the command line's parser
shows them, and building it must not load the server (fastapi) or the engine."""

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20

DEFAULT_WORKERS = 1
"""Threads that tokenize prompts. One: a second would take a second core from the engine's decoding when
prompts flood in."""
