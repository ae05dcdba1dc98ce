"""Request and response bodies: the single source of truth for validation and OpenAPI."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Bounds no settings can raise; the settings' own (TEXEL_IMAGE__MAX_SIDE and
# TEXEL_IMAGE__MAX_STEPS) are written into the OpenAPI document the server publishes.
MAX_SIDE = 4096
MAX_STEPS = 1000
SIZE_MULTIPLE = 8
MAX_IMAGES = 4  # images of one /generate request
MAX_PROMPT_CHARS = 2000


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable error code, e.g. `queue_full`.")
    message: str = Field(description="What went wrong and what to do about it.")


class ErrorBody(BaseModel):
    error: ErrorDetail


class RecognizeJSON(BaseModel):
    """JSON alternative to the multipart upload."""

    model_config = ConfigDict(extra="forbid", strict=True)

    image_base64: str = Field(
        description="The image file (PNG, JPEG, WebP, BMP or GIF), base64-encoded."
    )


class RecognizeResponse(BaseModel):
    latex: str = Field(description="Normalized LaTeX, tokens separated by spaces.")
    latex_compact: str = Field(description="The same LaTeX without the separating spaces.")
    confidence: float | None = Field(
        None,
        description="How sure the model was of this answer, from 0 to 1: the geometric mean "
        "of the probabilities of the tokens it chose. Not a calibrated chance of being right: "
        "low values mark readings to check. null for a picture with no ink, or when the "
        "model's scores were not numbers (a checkpoint that overflows).",
    )
    model: str = Field(description="The model that answered.")
    batch_size: int = Field(
        description="Size of the batch this request ran in; 0 for an answer from the cache."
    )
    timings_ms: dict[str, float] = Field(description="Milliseconds spent in each stage.")
    cached: bool = Field(
        False,
        description="The answer came from this server's recognition cache: the same image "
        "bytes were recognized before by the same model and decoding settings.",
    )


class GenerateRequest(BaseModel):
    # strict: a field of the wrong JSON type (`"64"`, `true` for a number) is refused,
    # not converted
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="What to draw.")
    negative_prompt: str | None = Field(
        None,
        max_length=MAX_PROMPT_CHARS,
        description="What to steer away from (needs guidance > 1).",
    )
    width: int | None = Field(
        None,
        ge=SIZE_MULTIPLE,
        le=MAX_SIDE,
        multiple_of=SIZE_MULTIPLE,
        description="Default: the model's size.",
    )
    height: int | None = Field(
        None,
        ge=SIZE_MULTIPLE,
        le=MAX_SIDE,
        multiple_of=SIZE_MULTIPLE,
        description="Default: the model's size.",
    )
    num_inference_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Denoising steps. Default: the model's."
    )
    guidance_scale: float | None = Field(
        None,
        ge=0,
        le=50,
        allow_inf_nan=False,
        description="Classifier-free guidance. Default: the model's.",
    )
    seed: int | None = Field(
        None,
        ge=0,
        le=2**32 - 1,
        description="Seed of the first image; image i uses seed + i, which may not pass "
        "2^32 - 1 either. Random when absent.",
    )
    num_images: int = Field(
        1, ge=1, le=MAX_IMAGES, description="Images to generate for this prompt."
    )


class GeneratedImage(BaseModel):
    png_base64: str = Field(description="The PNG file, base64-encoded.")
    seed: int = Field(description="Seed that reproduces this image with the same parameters.")


class GenerateResponse(BaseModel):
    images: list[GeneratedImage]
    model: str
    batch_size: int = Field(description="Images in the pipeline call this request ran in.")
    timings_ms: dict[str, float]


class Readiness(BaseModel):
    ready: bool
    draining: bool
    models: dict[str, str] = Field(description="Each model's state: loading, ready or failed.")


# -- the OpenAI-compatible routes (app/openai_api.py) ------------------------------------


class OpenAIErrorDetail(BaseModel):
    message: str = Field(description="What went wrong and what to do about it.")
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(description="The request field at fault, where one is.")
    code: str = Field(description="Texel's error code, as on its own routes.")


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


class ImagesGenerationRequest(BaseModel):
    """OpenAI's `POST /v1/images/generations` body, with Texel's parameters as extensions.
    Bounds are those of /generate."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(description="What to draw.")
    model: str | None = Field(None, description="The image model's id; default: the served one.")
    n: int | None = Field(1, description="Images to generate (1..4); null: 1.")
    size: str | None = Field(
        None, description="`WIDTHxHEIGHT` in pixels, e.g. `512x512`; `auto` or absent: the model's."
    )
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description="b64_json (the default). `url` is refused: Texel stores no images."
    )
    user: str | None = Field(None, description="Accepted for compatibility; unused.")
    # `user`'s successor in OpenAI's clients.
    safety_identifier: str | None = Field(None, description="Accepted for compatibility; unused.")
    # `stream=False` in OpenAI's clients: the answer whole, the only one Texel gives here.
    stream: bool | None = Field(
        None, description="false or absent: the answer whole. true is refused (422)."
    )
    # Sent by clients written for DALL-E 3 or gpt-image-1; Texel's effort is `steps`.
    quality: str | None = Field(None, description="Accepted for compatibility; unused.")
    style: str | None = Field(None, description="Accepted for compatibility; unused.")
    output_format: Literal["png"] | None = Field(
        None, description="png, the only format Texel answers (the default)."
    )
    # gpt-image-1's; the values that describe what Texel does anyway are taken.
    background: Literal["auto", "opaque"] | None = Field(
        None, description="auto or opaque: Texel's images are opaque. transparent is refused."
    )
    moderation: Literal["auto", "low"] | None = Field(
        None, description="Accepted for compatibility; Texel moderates nothing."
    )
    negative_prompt: str | None = Field(None, description="Texel extension: as on /generate.")
    steps: int | None = Field(
        None, description="Texel extension: denoising steps (/generate's num_inference_steps)."
    )
    guidance_scale: float | None = Field(None, description="Texel extension: as on /generate.")
    seed: int | None = Field(
        None,
        description="Texel extension: seed of the first image; image i uses seed + i, which "
        "may not pass 2^32 - 1.",
    )


class ImageData(BaseModel):
    b64_json: str = Field(description="The PNG file, base64-encoded.")
    seed: int = Field(description="Texel extension: the seed that reproduces this image.")


class ImagesResponse(BaseModel):
    created: int = Field(description="Unix time of the answer, in seconds.")
    data: list[ImageData]


class ModelCard(BaseModel):
    id: str = Field(description="The name to send as `model`.")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time at which this server started, in seconds.")
    owned_by: str = "texel"
    task: str = Field(description="Texel extension: image_generation or formula_recognition.")
    state: str = Field(description="Texel extension: loading, ready, failed or unavailable.")
    limits: dict[str, Any] = Field(
        description="Texel extension: what the server accepts, and what the loaded model "
        "says of itself (its defaults, for example)."
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
