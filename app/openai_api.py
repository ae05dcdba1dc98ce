"""Texel behind OpenAI's API: the translation between OpenAI's image-generation and
model-listing bodies and Texel's own. The routes are declared in app/routes.py, where
`POST /v1/images/generations` takes the path of `/generate`; errors on them get OpenAI's
shape in app/errors.py.
"""

from __future__ import annotations

import base64
import re
import time
from typing import Any

from pydantic import ValidationError

from app.errors import ApiError, validation_error
from app.schemas import (
    MAX_IMAGES,
    MAX_PROMPT_CHARS,
    MAX_SIDE,
    MAX_STEPS,
    SIZE_MULTIPLE,
    GenerateRequest,
    ImageData,
    ImagesGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
)
from app.serving import Runtime
from app.settings import Settings
from models.errors import InputError

SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")  # ASCII digits: "３２x３２" is no size
# /generate's fields under the names OpenAI's body gives them.
OPENAI_FIELDS = {
    "width": "size",
    "height": "size",
    "num_images": "n",
    "num_inference_steps": "steps",
}
TASKS = {"image": "image_generation", "formula": "formula_recognition"}


def generate_request(body: ImagesGenerationRequest, model: str) -> GenerateRequest:
    """The /generate request an OpenAI images request stands for, validated as /generate
    validates its own (422 naming OpenAI's field)."""
    if body.model is not None and body.model != model:
        raise ApiError(
            404,
            "model_not_found",
            f"the model {body.model!r} is not this server's image model, {model!r} "
            "(GET /v1/models lists every model it serves)",
            param="model",
        )
    if body.response_format == "url":
        raise ApiError(
            400,
            "unsupported_response_format",
            "response_format 'url' is not supported: Texel stores no images, it answers "
            "them; ask for b64_json (the default)",
            param="response_format",
        )
    if body.stream:
        raise ApiError(
            422,
            "invalid_parameter",
            "stream: true is not supported here: the images come whole, in one answer; "
            "send false or leave it out (/generate streams progress as server-sent events)",
            param="stream",
        )
    width, height = _size(body.size)
    try:
        return GenerateRequest(
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            width=width,
            height=height,
            num_inference_steps=body.steps,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            num_images=1 if body.n is None else body.n,
        )
    except ValidationError as exc:
        raise validation_error([_in_openai_terms(e) for e in exc.errors()]) from None


def _size(size: str | None) -> tuple[int | None, int | None]:
    """(width, height) of OpenAI's `WIDTHxHEIGHT`; None for the model's own size."""
    if size is None or size == "auto":
        return None, None
    match = SIZE.fullmatch(size.strip())
    if match is None:
        raise ApiError(
            422,
            "invalid_parameter",
            f"size must be WIDTHxHEIGHT in pixels, such as 512x512, or auto; got {size!r}",
            param="size",
        )
    return int(match[1]), int(match[2])


def _in_openai_terms(error: dict) -> dict:
    """A validation error of /generate's request, named by OpenAI's field, and saying
    which side of `size` it is about."""
    name = str(error["loc"][0]) if error.get("loc") else ""
    renamed = OPENAI_FIELDS.get(name)
    if renamed is None:
        return error
    message = f"{error['msg']} (the {name})" if renamed == "size" else error["msg"]
    return {**error, "loc": (renamed,), "msg": message}


def name_in_openai_terms(exc: InputError) -> None:
    """An adapter's refusal of /generate's field, told by OpenAI's field: `param`, and the
    message where it names the field (`size` keeps `width` or `height`: which side)."""
    renamed = OPENAI_FIELDS.get(exc.param or "")
    if renamed is None:
        return
    if renamed != "size":
        exc.message = exc.message.replace(exc.param, renamed)
    exc.param = renamed


def images_response(pngs: list[bytes], seeds: tuple[int, ...]) -> ImagesResponse:
    return ImagesResponse(
        created=int(time.time()),
        data=[
            ImageData(b64_json=base64.b64encode(png).decode("ascii"), seed=seed)
            for png, seed in zip(pngs, seeds, strict=True)
        ],
    )


def model_list(runtime: Runtime, created: int) -> ModelList:
    """Every model this server serves, with its state and limits."""
    return ModelList(data=[model_card(runtime, key, created) for key in runtime.models])


def find_model(runtime: Runtime, name: str, created: int) -> ModelCard:
    for key, model in runtime.models.items():
        if model.name == name:
            return model_card(runtime, key, created)
    raise ApiError(404, "model_not_found", f"the model {name!r} is not served here", param="model")


def model_card(runtime: Runtime, key: str, created: int) -> ModelCard:
    """A model as OpenAI lists one, with Texel's limits for it: those of the settings,
    and what the engine says of the loaded model (its defaults, for example)."""
    return ModelCard(
        id=runtime.model_label(key),
        created=created,
        task=TASKS.get(key, key),
        state=runtime.model_state(key)[0],
        limits=_limits(runtime, key),
    )


def _limits(runtime: Runtime, key: str) -> dict[str, Any]:
    limits = {**_setting_limits(runtime.settings, key), **_description(runtime, key)}
    if "max_side" in limits:
        # The largest side a request may ask for: a multiple of the model's size multiple,
        # which the setting need not be.
        multiple = limits.get("size_multiple", SIZE_MULTIPLE)
        limits["max_side"] -= limits["max_side"] % multiple
    return limits


def _setting_limits(settings: Settings, key: str) -> dict[str, Any]:
    if key == "image":
        return {
            "max_side": min(settings.image.max_side, MAX_SIDE),
            "max_steps": min(settings.image.max_steps, MAX_STEPS),
            "max_images": MAX_IMAGES,
            "max_prompt_chars": MAX_PROMPT_CHARS,
        }
    if key == "formula":
        return {
            "max_upload_bytes": settings.max_upload_bytes,
            "max_image_pixels": settings.max_image_pixels,
        }
    return {}


def _description(runtime: Runtime, key: str) -> dict[str, Any]:
    """The limits an engine that has the model ready states of it (`Model.describe`): an
    image model's defaults and size multiple, and any `max_*` entry a model describes."""
    for state in runtime.states.get(key, {}).values():
        if state.state == "ready":
            return _limits_described(state.description)
    return {}


def _limits_described(description: dict[str, Any]) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    defaults = description.get("defaults") or {}
    if "width" in defaults and "height" in defaults:
        limits["default_size"] = f"{defaults['width']}x{defaults['height']}"
    if "steps" in defaults:
        limits["default_steps"] = defaults["steps"]
    if "guidance" in defaults:
        limits["default_guidance_scale"] = defaults["guidance"]
    if "size_multiple" in description:
        limits["size_multiple"] = description["size_multiple"]
    limits.update({k: v for k, v in description.items() if k.startswith("max_")})
    return limits
