"""LoRA adapters over HTTP, as vLLM serves them: picked by the `model` field, listed by /v1/models,
loaded and unloaded at run time.

POST /v1/load_lora_adapter `{"lora_name", "lora_path"}` reads a PEFT adapter (on the engine thread,
between steps) into a free slot; POST /v1/unload_lora_adapter `{"lora_name"}` frees it. Both answer
200 with a line of text, as vLLM does. An adapter the artifact cannot serve (its rank, its target
modules, no free slot, files that are no PEFT adapter), a name already loaded, or an unknown name to
unload is a 400 naming the field; the engine and the other adapters are unaffected.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from octavo.ir.lora_format import LoraAdapterError
from octavo.serve.errors import APIError
from octavo.serve.request_model import StrictModel, Text

router = APIRouter()


class LoadLoraRequest(StrictModel):
    lora_name: Text
    lora_path: Text


class UnloadLoraRequest(StrictModel):
    lora_name: Text


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    context = request.app.state.context
    if body.lora_name == context.settings.model_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
    try:
        await context.engine.call(lambda engine: engine.load_lora(body.lora_name, body.lora_path))
    except LoraAdapterError as error:
        param = "lora_name" if "already loaded" in str(error) else "lora_path"
        raise APIError(400, str(error), param=param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    context = request.app.state.context
    try:
        await context.engine.call(lambda engine: engine.unload_lora(body.lora_name))
    except LoraAdapterError as error:
        raise APIError(400, str(error), param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def adapter_cards(context) -> list[dict]:
    """/v1/models entries of the loaded adapters (vLLM's: `root` the adapter's path, `parent` the base model)."""
    lora = context.engine.engine.lora
    if lora is None:
        return []
    base = context.settings.model_name
    return [{"id": name, "object": "model", "created": context.created, "owned_by": "octavo",
             "root": path, "parent": base, "max_model_len": context.engine.engine.max_model_len}
            for name, path in sorted(dict(lora.paths).items())]
