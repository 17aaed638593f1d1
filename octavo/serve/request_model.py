"""The base of every request body: strict types, valid Unicode, unknown fields, explicit nulls.

`StrictModel`: a JSON string is not a number, `1.0` is not an integer, infinities and NaN are
rejected. An unknown field is ignored and logged as a warning, as vLLM does (clients send fields of
newer API versions, and echo back whole response messages), except two kinds, which are a 400 that
names them rather than an answer without them: the fields of vLLM's that change what is generated
and that this server does not serve (UNSERVED_FIELDS), unless set to their "off" value, and a field
of the other endpoint (`OTHER_ENDPOINT_FIELDS`: `messages` sent to /v1/completions, `echo` to
/v1/chat/completions). `Text` and `JsonObject` refuse lone surrogates, which JSON can spell
("\\ud800") and no tokenizer or UTF-8 encoder accepts; `JsonObject` also refuses NaN and the
infinities anywhere inside it (Python's JSON reader accepts `NaN`, `Infinity` and `1e999`; JSON has no
such numbers). `NullMeansDefault`: the fields it names take an explicit null as their default.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

SURROGATE = re.compile("[\ud800-\udfff]")

logger = logging.getLogger(__name__)


def valid_unicode(text: str) -> str:
    """`text` unless it holds a surrogate code point, which is not a character (JSON's lone "\\udXXX")."""
    found = SURROGATE.search(text)
    if found is not None:
        raise ValueError(f"not valid Unicode: lone surrogate U+{ord(found.group()):04X} at character "
                         f"{found.start()}")
    return text


def valid_unicode_json(value: Any) -> Any:
    """`value` unless a key or string anywhere inside it holds a surrogate code point, or a number inside it is
    NaN or infinite, which JSON cannot spell (walked without recursion)."""
    pending = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, str):
            valid_unicode(node)
        elif isinstance(node, float) and not math.isfinite(node):
            raise ValueError(f"not a JSON number: {node} (JSON has no NaN or infinities)")
        elif isinstance(node, dict):
            for key, item in node.items():
                valid_unicode(key)
                pending.append(item)
        elif isinstance(node, list):
            pending.extend(node)
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]
JsonObject = Annotated[dict[str, Any], AfterValidator(valid_unicode_json)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenIds = list[TokenId]


UNSERVED_FIELDS = {
    **dict.fromkeys(["guided_whitespace_pattern", "structural_tag"], "guided decoding the grammar engine here "
                    "(xgrammar) has not"),
    **dict.fromkeys(["use_beam_search", "best_of", "length_penalty"], "beam search and best-of sampling"),
    "allowed_token_ids": "restricting the vocabulary",
    "bad_words": "banned words",
    "prompt_logprobs": "prompt logprobs",
    "logits_processors": "custom logits processors",
    "truncate_prompt_tokens": "prompt truncation",
    "chat_template": "a chat template given with the request (the artifact's template is used)",
    "documents": "documents for the chat template",
}
"""vLLM's request fields that change what is generated and that this server does not serve: what each asks."""


def _asks_for_nothing(name: str, value: Any) -> bool:
    """Whether an UNSERVED_FIELDS value is that field's "off" (null, false, empty, best_of 1, length_penalty 1),
    which clients send by default: ignored like any unknown field."""
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return value == 1 and not isinstance(value, bool) and name in ("best_of", "length_penalty")


class StrictModel(BaseModel):
    """A request object: strict types; unknown fields ignored (a warning names them), unserved ones and the
    other endpoint's refused."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    OTHER_ENDPOINT_FIELDS: ClassVar[dict[str, str]] = {}
    """Fields of another endpoint's request that this one does not take -> that endpoint's path."""

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = cls.model_fields.keys() | {field.alias for field in cls.model_fields.values() if field.alias}
        unknown = [name for name in data if name not in known]
        for name in unknown:
            if isinstance(name, str) and SURROGATE.search(name):  # no text of a request may be invalid
                raise PydanticCustomError("string_unicode", "a field name that is not valid Unicode")
            if name in UNSERVED_FIELDS and not _asks_for_nothing(name, data[name]):
                raise PydanticCustomError("unserved_field", "'{field}' asks for {what}, which this server does not "
                                          "serve", {"field": name, "what": UNSERVED_FIELDS[name]})
            if name in cls.OTHER_ENDPOINT_FIELDS:
                raise PydanticCustomError("other_endpoint_field", "'{field}' is a parameter of {endpoint}, not of "
                                          "this endpoint", {"field": name, "endpoint": cls.OTHER_ENDPOINT_FIELDS[name]})
        if unknown:
            logger.warning("ignoring unknown field%s of %s: %s", "s" if len(unknown) > 1 else "", cls.__name__,
                           ", ".join(repr(name) for name in unknown))
        return data


class NullMeansDefault(StrictModel):
    """A model whose fields named in `NULL_MEANS_DEFAULT` take an explicit null as their default."""

    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.NULL_MEANS_DEFAULT):
            return {name: value for name, value in data.items()
                    if not (value is None and name in cls.NULL_MEANS_DEFAULT)}
        return data
