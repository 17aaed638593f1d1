"""One parse of a GGUF file's metadata, shared by every transformers reader of that file.

gguf.GGUFReader walks every metadata value (a 49k-token vocabulary and its merges are about
a million small reads: seconds per parse), and transformers builds a fresh reader for each
thing it loads from a GGUF: the config, the tokenizer's config, the model's config and its
tensors. Octavo parses the file once (`read_gguf`) and, while `sharing(reader)` is active,
hands that reader to every construction of a reader of the same file. The reader's memory
map is read-only and transformers only reads from it, so sharing it changes nothing they
compute.

For the same reason `sharing` memoizes gguf.get_tensor_name_map: transformers rebuilds
gguf's tensor-name table (thousands of formatted names) for every submodule of the model
(~400 for a 30-layer llama) while mapping GGUF tensor names to HF ones, always for the same
(architecture, layer count), and only looks names up in it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from octavo.errors import ModelSourceError

_lock = threading.RLock()


def read_gguf(path: Path):
    """A gguf.GGUFReader of `path` (read-only), or a ModelSourceError naming the file."""
    try:
        import gguf

        return gguf.GGUFReader(path)
    except Exception as error:
        raise ModelSourceError(f"{path} is not a readable GGUF file: {error}") from error


def architecture_of(reader) -> str:
    """general.architecture of a parsed GGUF file (GGUF names match HF model types for Octavo's table)."""
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


@contextlib.contextmanager
def sharing(reader, path: Path) -> Iterator[None]:
    """While active, gguf.GGUFReader(`path`) (read-only) returns `reader` instead of parsing the file again.

    Readers of other files, or opened for writing, are built as usual. The swap is process-wide
    (transformers looks the class up in the gguf module), so it is held under a lock.
    """
    import gguf

    original, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    target = os.path.realpath(path)

    class SharedGGUFReader(original):
        def __new__(cls, file, mode="r"):
            if mode == "r" and os.path.realpath(file) == target:
                return reader  # not an instance of this class, so __init__ does not run again
            return super().__new__(cls)

    with _lock:
        gguf.GGUFReader, gguf.get_tensor_name_map = SharedGGUFReader, functools.cache(original_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original, original_name_map
