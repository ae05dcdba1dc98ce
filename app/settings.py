"""Texel's settings, read from `TEXEL_*` environment variables (nested with `__`).

TEXEL_DEVICE=cuda:0 TEXEL_FORMULA__MAX_BATCH_SIZE=64 texel serve
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


class ModelSettings(BaseModel):
    """Settings of one served model and its batcher."""

    enabled: bool = Field(True, description="Load and serve this model.")
    model: str = Field(description="A local directory or a Hugging Face hub id.")
    name: str | None = Field(
        None, description="Name reported in responses and metrics; default from the model path."
    )
    max_batch_size: int = Field(8, ge=1, le=1024, description="Largest batch run at once.")
    max_wait_ms: float = Field(
        10.0,
        ge=0,
        description="How long the first request of a bucket waits for company before its "
        "batch runs. A continuous stream (formulas, static decoder) starts at once instead: "
        "later requests join it at its next check.",
    )
    max_queue: int = Field(
        256, ge=1, description="Requests waiting for a batch before new ones get 429."
    )


class FormulaSettings(ModelSettings):
    model: str = Field(
        str(MODELS_DIR / "formula" / "default"),
        description="VisionEncoderDecoderModel directory or hub id.",
    )
    max_batch_size: int = Field(16, ge=1, le=1024)
    bucket_width: int | None = Field(
        None,
        ge=8,
        description="Width granularity of formula buckets, in input pixels; default 128 "
        "on GPUs (each width group joining a running decode costs an encoder call), 64 on "
        "a CPU (padding costs compute).",
    )
    num_beams: int = Field(1, ge=1, le=16, description="1 is greedy decoding.")
    decoder: Literal["auto", "static", "generate"] = Field(
        "auto",
        description="static: Texel's static-cache greedy decoder (CUDA graphs on GPUs); "
        "generate: transformers' generate(); auto: static where the model supports it.",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Longest output; default from the model's generation config."
    )
    continuous: bool = Field(
        True,
        description="Continuous batching with the static decoder: new requests join a "
        "running decode at its next check (every 8 steps) and each answer returns as "
        "soon as its own formula ends, instead of batches that start and end together.",
    )


class ImageSettings(ModelSettings):
    model: str = Field(
        str(MODELS_DIR / "image" / "default"),
        description="diffusers text-to-image pipeline directory or hub id.",
    )
    max_batch_size: int = Field(4, ge=1, le=256)
    max_wait_ms: float = Field(20.0, ge=0)
    max_queue: int = Field(64, ge=1)
    max_steps: int = Field(100, ge=1, description="Largest num_inference_steps accepted.")
    max_side: int = Field(1024, ge=8, description="Largest width or height accepted.")
    compile: Literal["off", "batch", "dynamic"] = Field(
        "off",
        description="torch.compile the UNet, every graph compiled during warm-up before "
        "readiness. batch: graphs for the image size with a symbolic batch size (three "
        "compilations); dynamic: one graph with every size symbolic. See the README for "
        "what each gains.",
    )
    png_compress_level: int = Field(
        1,
        ge=0,
        le=9,
        description="zlib level of the PNGs returned: 1 encodes several times faster than "
        "PIL's default 6, for somewhat larger files.",
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TEXEL_", env_nested_delimiter="__", extra="ignore"
    )

    device: str = Field("auto", description="auto, cpu, cuda (every GPU) or cuda:N.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto is fp16/bf16 on GPUs and fp32 on the CPU."
    )
    request_timeout_s: float = Field(
        60.0, gt=0, description="Deadline of a request from arrival; past it, 504."
    )
    max_upload_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="Largest image upload.")
    max_image_pixels: int = Field(
        16_000_000, ge=1, description="Largest decoded image (width x height)."
    )
    log_format: Literal["json", "text"] = Field("text", description="json: one object a line.")
    log_level: str = Field("INFO")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origins allowed to call the API from a browser."
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="When set, requests need Authorization: Bearer <key>."
    )
    shutdown_grace_s: float = Field(
        0.0, ge=0, description="On SIGTERM, report not-ready this long before draining."
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="Longest wait for queued work on exit.")
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="How long an idle kept-alive connection stays open. Longer than the "
        "idle timeout of any proxy or load balancer in front (60 s for most), so that the "
        "server never closes a connection just as a request is sent on it.",
    )
    preprocess_threads: int = Field(
        0, ge=0, description="Threads decoding images; 0 means one per CPU core."
    )
    preprocess_processes: int | None = Field(
        None,
        ge=0,
        description="Worker processes decoding formula images, away from the serving "
        "process's interpreter lock; 0 decodes on the threads above. Unset: when formulas "
        "run on a GPU with a single HTTP process (below), min(4, cores / 4) beside worker "
        "processes, min(8, cores / 2) without them; else 0.",
    )
    worker_processes: bool | None = Field(
        None,
        description="Run each model's batches on each device in a worker process of its "
        "own (its own interpreter lock), not on a thread of the serving process. Unset: "
        "true when a model runs on a GPU, else false.",
    )
    http_processes: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Processes answering HTTP on the port, each with its own interpreter "
        "lock: `texel serve` starts the others, which parse, decode and encode there and "
        "hand the decoded inputs to this process's batchers. Unset: min(4, cores / 4) when "
        "a model runs on a GPU, else 1.",
    )
    switch_interval_ms: float | None = Field(
        None,
        gt=0,
        description="Python's thread switch interval in the serving process. Unset: 0.5 "
        "when a model runs on a GPU (its worker reacquires the interpreter lock after "
        "every GPU synchronization), else Python's default (5).",
    )
    gc_freeze: bool = Field(
        True,
        description="Once ready, put the objects alive in each HTTP process out of the "
        "garbage collector's reach (gc.freeze), so its collections during requests are short.",
    )
    formula: FormulaSettings = Field(default_factory=FormulaSettings)
    image: ImageSettings = Field(default_factory=ImageSettings)

    @field_validator("cors_origins", "api_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        """Accept `a,b` as well as a JSON list."""
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                import json

                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value
