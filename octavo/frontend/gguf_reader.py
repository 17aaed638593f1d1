"""One parse of a GGUF file's metadata, shared by every transformers reader of that file.

gguf.GGUFReader walks every metadata value (a 49k-token vocabulary and its merges are about
a million small reads: seconds per parse), and transformers builds a fresh reader for each
thing it loads from a GGUF: the config, the tokenizer's config, the model's config and its
tensors. Octavo parses the file once (`read_gguf`) and, while `sharing(reader)` is active,
hands that reader to every construction of a reader of the same file. The reader's memory
map is read-only and transformers only reads from it, so sharing it changes nothing they
compute.

For the same reason `sharing` memoizes two pure functions of the file:
gguf.get_tensor_name_map (transformers rebuilds gguf's tensor-name table, thousands of
formatted names, for every submodule of the model, ~400 for a 30-layer llama, always for the
same architecture and layer count, and only looks names up in it), and transformers'
metadata-only load_gguf_checkpoint(path) (it converts every metadata value, vocabulary
included, and the config, tokenizer and model loaders each ask for it; every caller gets its
own deep copy, so none sees another's edits).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from octavo.errors import ModelSourceError

_lock = threading.RLock()
_converted_metadata: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reader -> [load_gguf_checkpoint result]


def read_gguf(path: Path):
    """A gguf.GGUFReader of `path` (read-only), or a ModelSourceError naming the file.

    The reader slices a plain-array view of the file's memory map rather than the np.memmap
    itself: the same bytes and fields, but each of the million small slices a vocabulary takes
    skips np.memmap's per-slice Python hook (half the parse time).
    """
    try:
        import gguf

        class PlainArrayGGUFReader(gguf.GGUFReader):
            @property
            def data(self):
                return self._array

            @data.setter
            def data(self, mapped):
                self._array = mapped.view(np.ndarray)  # keeps the memory map alive as its base

        return PlainArrayGGUFReader(path)
    except Exception as error:
        raise ModelSourceError(f"{path} is not a readable GGUF file: {error}") from error


def architecture_of(reader) -> str:
    """general.architecture of a parsed GGUF file (GGUF names match HF model types for Octavo's table)."""
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def special_token_ids(reader) -> dict[str, int]:
    """The GGUF's own special token ids, by role ("bos", "eos", ...): tokenizer.ggml.<role>_token_id."""
    ids = {}
    for role in ("bos", "eos", "unknown", "padding"):
        field = reader.fields.get(f"tokenizer.ggml.{role}_token_id")
        if field is not None:
            ids[role] = int(field.parts[field.data[0]][0])
    return ids


@contextlib.contextmanager
def sharing(reader, path: Path) -> Iterator[None]:
    """While active, gguf.GGUFReader(`path`) (read-only) returns `reader` instead of parsing the file again.

    Also memoizes gguf.get_tensor_name_map and transformers' metadata-only load_gguf_checkpoint of
    this file (the latter per reader, across `sharing` blocks; see the module docstring). Readers of
    other files, or opened for writing, are built as usual. The swaps are process-wide (transformers
    looks these up in their modules at each call), so they are held under a lock.
    """
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    original, original_name_map, original_load = gguf.GGUFReader, gguf.get_tensor_name_map, loader.load_gguf_checkpoint
    target = os.path.realpath(path)
    metadata = _converted_metadata.setdefault(reader, [])

    def load_gguf_checkpoint(file, return_tensors=False, model_to_load=None, torch_dtype=None):
        if return_tensors or os.path.realpath(file) != target:
            return original_load(file, return_tensors, model_to_load, torch_dtype)
        if not metadata:
            metadata.append(original_load(file))
        return copy.deepcopy(metadata[0])

    class SharedGGUFReader(original):
        def __new__(cls, file, mode="r"):
            if mode == "r" and os.path.realpath(file) == target:
                return reader  # not an instance of this class, so __init__ does not run again
            return super().__new__(cls)

    with _lock:
        gguf.GGUFReader, gguf.get_tensor_name_map = SharedGGUFReader, functools.cache(original_name_map)
        loader.load_gguf_checkpoint = load_gguf_checkpoint
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original, original_name_map
            loader.load_gguf_checkpoint = original_load
