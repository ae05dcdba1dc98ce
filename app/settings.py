"""Texel's settings, read from `TEXEL_*` environment variables (nested with `__`).

TEXEL_DEVICE=cuda:0 TEXEL_FORMULA__MAX_BATCH_SIZE=64 texel serve

The settings a user chooses are at the top level and in each model's entry; the rest
sit in `advanced` groups (docs/tuning.md says when to touch them). These classes are
the single source of truth: docs/configuration.md is generated from them.

`read_settings` is how the `texel` command reads them: a `TEXEL_` variable that names no
setting, or a value a setting does not allow, is a problem to report, not a traceback.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import pydantic_settings
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

if TYPE_CHECKING:
    import torch

    from models.base import Model

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
ENV_PREFIX = "TEXEL_"
ENV_DELIMITER = "__"
# TEXEL_ variables that are not settings and are let through: the launcher gives its
# processes its pid (TEXEL_LAUNCHER_PID, for the bottleneck probe); the benchmarks
# (TEXEL_COMMIT, TEXEL_BENCH_INSTANT) and the tests (TEXEL_DATA, TEXEL_BACKENDS_CACHE,
# TEXEL_UPDATE_SCREENSHOT) set theirs in the environment of the servers they start.
# The key `texel recognize` and `texel diagnose` send (read by app/cli.py, so that it
# need not be on their command line, where `ps` shows it): the client's, not a setting of
# the server, whose keys are TEXEL_API_KEYS.
CLIENT_API_KEY = "TEXEL_API_KEY"
NOT_SETTINGS = frozenset(
    {
        "TEXEL_LAUNCHER_PID",
        "TEXEL_COMMIT",
        "TEXEL_BENCH_INSTANT",
        "TEXEL_DATA",
        "TEXEL_BACKENDS_CACHE",
        "TEXEL_UPDATE_SCREENSHOT",
    }
)


DAY_S = 86_400.0  # the longest time setting: longer ones overflow the event loop's timers


# A group of settings: numbers are finite (no `inf` or `nan` seconds or bytes), and a
# key of its JSON form (TEXEL_FORMULA='{...}') that names no setting is refused, as an
# unknown variable is. No docstring: configuration.md would give it to every group
# without one of its own.
class Group(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")


class ModelSettings(Group):
    """Settings of one served model and its batcher."""

    # What a local folder of the model's family holds: each entry is a file, or files
    # of which one will do. A folder without them is refused at start, with their names,
    # rather than failing to load with a library's guess at the cause.
    folder_files: ClassVar[tuple[tuple[str, ...], ...]] = ()
    family: ClassVar[str] = "model"

    enabled: bool = Field(True, description="Load and serve this model.")
    model: str = Field(description="A local directory or a Hugging Face hub id.")
    name: str | None = Field(
        None, description="Name reported in responses and metrics; default from the model path."
    )
    max_batch_size: int = Field(8, ge=1, le=1024, description="Largest batch run at once.")
    max_wait_ms: float = Field(
        10.0,
        ge=0,
        le=60_000,
        description="How long the first request of a bucket waits for company before its "
        "batch runs (a continuous decode starts at once and takes company as it runs).",
    )
    max_queue: int = Field(
        256, ge=1, description="Requests waiting for a batch before new ones get 429."
    )

    def factory(self, settings: Settings, devices: list[torch.device]) -> Callable[[], Model]:
        """A picklable call that makes this model (not yet opened or loaded)."""
        raise NotImplementedError

    def batch_size(self, devices: list[torch.device]) -> int:
        """The largest batch on `devices`."""
        return self.max_batch_size


class FormulaAdvanced(Group):
    bucket_width: int | None = Field(
        None,
        ge=8,
        description="Width step of formula buckets in input pixels; default 128 on GPUs, "
        "64 on a CPU.",
    )
    decoder: Literal["auto", "static", "generate"] = Field(
        "auto",
        description="static: Texel's static-cache greedy decoder (CUDA graphs on GPUs); "
        "generate: transformers' generate(); auto: static where the model supports it.",
    )
    continuous: bool = Field(
        True,
        description="With the static decoder, new requests join a running decode and each "
        "answer returns as soon as its own formula ends.",
    )
    batch_invariant: bool = Field(
        False,
        description="On GPUs, every decoding step and every encoding runs one batch shape, "
        "so an answer never depends on what else was batched with it.",
    )
    num_beams: int = Field(1, ge=1, le=16, description="1 is greedy decoding.")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Longest output; default from the model's generation config."
    )


class FormulaSettings(ModelSettings):
    folder_files = (
        ("config.json",),
        # An image processor saved alone, or a processor with one inside (transformers 5).
        ("preprocessor_config.json", "processor_config.json"),
        ("tokenizer.json", "tokenizer_config.json"),
    )
    family = "VisionEncoderDecoderModel"

    model: str = Field(
        str(MODELS_DIR / "formula" / "default"),
        description="VisionEncoderDecoderModel directory or hub id.",
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Largest batch run at once; unset: 128 on GPUs, 16 on a CPU.",
    )
    cache_mb: float = Field(
        64.0,
        ge=0,
        description="Memory of each HTTP process's recognition cache, in MiB: the same image "
        "bytes, recognized before with the same model and decoding settings, are answered "
        "from it without reaching the engine; 0 turns it off.",
    )
    advanced: FormulaAdvanced = Field(default_factory=FormulaAdvanced)

    def factory(self, settings: Settings, devices: list[torch.device]) -> Callable[[], Model]:
        from models.formula.adapter import FormulaRecognizer

        a = self.advanced
        return functools.partial(
            FormulaRecognizer,
            self.model,
            devices,
            name=self.name,
            dtype=settings.dtype,
            bucket_step=a.bucket_width,
            num_beams=a.num_beams,
            max_new_tokens=a.max_new_tokens,
            max_pixels=settings.max_image_pixels,
            decoder=a.decoder,
            continuous=a.continuous,
            batch_invariant=a.batch_invariant,
        )

    def batch_size(self, devices: list[torch.device]) -> int:
        if self.max_batch_size is not None:
            return self.max_batch_size
        # On a GPU a step of a hundred rows takes a small multiple of one row's time,
        # so rows in flight are throughput; on a CPU each row is compute of its own.
        return 128 if any(device.type == "cuda" for device in devices) else 16


class ImageAdvanced(Group):
    continuous: bool = Field(
        True,
        description="With a Stable Diffusion pipeline, new requests join a running "
        "denoising loop at a step boundary and each answer returns as soon as its own "
        "steps end; off, a batch starts and ends together.",
    )
    png_compress_level: int = Field(
        1,
        ge=0,
        le=9,
        description="zlib level of the PNGs returned: 1 encodes several times faster than "
        "PIL's default 6, for somewhat larger files.",
    )


class ImageSettings(ModelSettings):
    folder_files = (("model_index.json",),)
    family = "diffusers pipeline"

    model: str = Field(
        str(MODELS_DIR / "image" / "default"),
        description="diffusers text-to-image pipeline directory or hub id.",
    )
    max_batch_size: int = Field(4, ge=1, le=256, description="Largest batch run at once.")
    max_wait_ms: float = Field(
        20.0,
        ge=0,
        le=60_000,
        description="How long the first request of a bucket waits for company before its "
        "batch runs (a continuous denoising loop starts at once and takes company as it "
        "runs).",
    )
    max_queue: int = Field(
        64, ge=1, description="Requests waiting for a batch before new ones get 429."
    )
    max_steps: int = Field(100, ge=1, description="Largest num_inference_steps accepted.")
    max_side: int = Field(1024, ge=8, description="Largest width or height accepted.")
    compile: Literal["off", "batch", "dynamic"] = Field(
        "off",
        description="torch.compile the UNet during warm-up (minutes at every start): batch "
        "compiles a graph per image size with a symbolic batch size, dynamic one graph "
        "with every size symbolic.",
    )
    advanced: ImageAdvanced = Field(default_factory=ImageAdvanced)

    def factory(self, settings: Settings, devices: list[torch.device]) -> Callable[[], Model]:
        from models.image.adapter import ImageGenerator

        return functools.partial(
            ImageGenerator,
            self.model,
            devices,
            name=self.name,
            dtype=settings.dtype,
            max_steps=self.max_steps,
            max_side=self.max_side,
            compile=self.compile,
            continuous=self.advanced.continuous,
            png_compress_level=self.advanced.png_compress_level,
            deadline_s=settings.request_timeout_s,
        )


class AdvancedSettings(Group):
    gpu_sharing: Literal["priority", "off"] = Field(
        "priority",
        description="How the models of one GPU share it: priority puts each model's work "
        "on a CUDA stream of its own, the formula model's at a higher priority so that its "
        "steps run beside a denoising step rather than behind it, and keeps a few SMs "
        "from the image model for it; off queues every model's work on the one default "
        "stream (no effect on a CPU).",
    )
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="How long an idle kept-alive connection stays open; keep it longer "
        "than the idle timeout of any proxy in front, so the server never closes a "
        "connection just as a request is sent on it.",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="Connections one HTTP process holds at once, idle kept-alive ones "
        "included; a request on one more is answered 503 and its connection closed. Keep "
        "it above the connections the proxies in front keep open to each process.",
    )
    preprocess_threads: int = Field(
        2,
        ge=1,
        description="Threads per HTTP process that decode and encode; more processes "
        "(TEXEL_HTTP_PROCESSES), not more threads, use more cores, since the threads of "
        "one process share its interpreter lock.",
    )
    gc_freeze: bool = Field(
        True,
        description="Once ready, put the objects alive in each process out of the garbage "
        "collector's reach (gc.freeze), so its collections during requests are short.",
    )


class Settings(BaseSettings):
    """`texel serve` refuses to start, with exit status 2 and a line per problem, on a
    `TEXEL_` variable that names no setting, a value a setting does not allow, a model
    folder that is not there or that it cannot read, or no model enabled."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_DELIMITER,
        extra="ignore",
        allow_inf_nan=False,
    )

    device: str = Field("auto", description="auto, cpu, cuda (every GPU) or cuda:N.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="auto is fp16/bf16 on GPUs; on a CPU, bf16 where it has bf16 "
        "instructions (a formula decoded alone steps in int8), else fp32 with the "
        "formula decoder's weights in int8.",
    )
    request_timeout_s: float = Field(
        60.0,
        gt=0,
        le=DAY_S,
        description="Deadline of a request from when its body has been read; past it, 504 "
        "(its head and its body each have as long to arrive; past that, 408).",
    )
    max_upload_bytes: int = Field(
        10 * 1024 * 1024,
        ge=1024,
        le=2**30,  # bodies are held in memory, up to 32 times this
        description="Largest image upload. The request bodies an HTTP process holds at once "
        "add up to at most 32 times it; a body past that is answered 503.",
    )
    max_image_pixels: int = Field(
        16_000_000, ge=1, description="Largest decoded image (width x height)."
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="When set, requests need Authorization: Bearer <key>."
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origins allowed to call the API from a browser."
    )
    log_format: Literal["json", "text"] = Field("text", description="json: one object a line.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="Python logging level, in any case."
    )
    shutdown_grace_s: float = Field(
        0.0, ge=0, le=DAY_S, description="On SIGTERM, report not-ready this long before draining."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, le=DAY_S, description="Longest wait for queued work on exit."
    )
    http_processes: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Identical processes answering HTTP on the port; unset: 1 on a CPU, "
        "min(12, 3/4 of the cores) with GPUs.",
    )
    formula: FormulaSettings = Field(default_factory=FormulaSettings)
    image: ImageSettings = Field(default_factory=ImageSettings)
    advanced: AdvancedSettings = Field(default_factory=AdvancedSettings)

    def models(self) -> dict[str, ModelSettings]:
        """The enabled models' settings, by key (the field's name)."""
        entries = {name: getattr(self, name) for name in type(self).model_fields}
        return {
            key: entry
            for key, entry in entries.items()
            if isinstance(entry, ModelSettings) and entry.enabled
        }

    def alone(self, key: str) -> Settings:
        """These settings with every model but `key` disabled (`texel recognize` in its
        own process serves the formula model alone)."""
        others = {
            name: entry.model_copy(update={"enabled": False})
            for name, entry in self.models().items()
            if name != key
        }
        return self.model_copy(update=others)

    def serving_problems(self) -> list[str]:
        """Why `texel serve` cannot start with these settings, one line each: a device
        that is not there, an enabled model whose `model` is plainly a folder (a hub id
        is `name` or `org/name`) that is not there or a folder without its family's
        files, or no model enabled at all."""
        problems = []
        if self.device not in ("cpu", "auto"):  # the two that are always there
            from app.devices import device_names

            try:
                device_names(self.device)
            except RuntimeError as exc:
                problems.append(str(exc))
        for key, entry in self.models().items():
            path = entry.model
            plainly_a_path = path.startswith(("/", "./", "../", "~")) or path.count("/") > 1
            unreadable = cannot_read(path)
            if unreadable:
                problems.append(f"{env_name(key, 'model')}={path}: cannot read it ({unreadable})")
                continue
            if Path(path).is_dir():
                lacking = [
                    " or ".join(names)
                    for names in entry.folder_files
                    if not any((Path(path) / name).is_file() for name in names)
                ]
                if lacking:
                    problems.append(
                        f"{env_name(key, 'model')}={path}: not a {entry.family} folder, "
                        f"it has no {', no '.join(lacking)}"
                    )
            elif plainly_a_path:
                unexpanded = " (~ is not expanded)" if path.startswith("~") else ""
                problems.append(f"{env_name(key, 'model')}={path}: no such folder{unexpanded}")
        if not self.models():
            switches = [
                f"{env_name(name, 'enabled')}=false"
                for name in type(self).model_fields
                if isinstance(getattr(self, name), ModelSettings)
            ]
            problems.append(f"{', '.join(switches)}: no model is enabled, nothing to serve")
        return problems

    @field_validator("device", mode="before")
    @classmethod
    def _known_device(cls, value):
        if isinstance(value, str):
            value = value.strip().lower()
            if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
                raise ValueError("should be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_case(cls, value):
        return value.upper() if isinstance(value, str) else value

    @field_validator("cors_origins", "api_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        """Accept `a,b` as well as a JSON list."""
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        """No empty key: a template's unset variable in the JSON form (`["k", ""]`) would
        read as a key, and a server believed guarded open to a bare `Bearer`."""
        if any(not key.strip() for key in keys):
            raise ValueError("a key is empty")
        return keys

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        """Each an origin as a browser sends it (`https://app.example:8443`), or `*`: one
        copied with its path or trailing `/` would match no browser, silently."""
        for origin in origins:
            if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/?#\s]+", origin):
                raise ValueError(
                    f"{origin} is not an origin: scheme://host[:port], with no path or trailing /"
                )
        return origins


def cannot_read(path: str) -> str | None:
    """Why this process cannot read the model folder at `path` (`Permission denied`, for
    it, a folder above it, or a file or folder in it, which is then named), or None: it
    can, or nothing is there. Its files would otherwise be looked for with a traceback,
    not found for the wrong reason, or fail the model only once its engine loads them.
    Hidden entries (a clone's `.git`) are no loader's and are not checked."""
    try:
        if not Path(path).is_dir():
            return None
        os.listdir(path)  # its names: the folder's read permission
        os.stat(os.path.join(path, "."))  # its files: the folder's search permission
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    problems: list[OSError] = []
    for folder, subfolders, files in os.walk(path, onerror=problems.append):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            try:
                with open(os.path.join(folder, name), "rb"):
                    pass
            except OSError as exc:
                problems.append(exc)
    if not problems:
        return None
    first = problems[0]
    return f"{os.path.relpath(str(first.filename), path)}: {first.strerror or type(first).__name__}"


class InvalidSettings(Exception):
    """Settings Texel cannot start with: `problems` holds one line per problem, each
    naming its environment variable."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def read_settings(client: bool = False) -> Settings:
    """The settings in this process's environment; `InvalidSettings` lists every
    `TEXEL_` variable that names no setting and every value a setting does not allow.
    `client`: for a command that is also a client of servers (`texel recognize`), whose
    key `CLIENT_API_KEY` is then no misspelling."""
    problems = unknown_variables(os.environ, client)
    try:
        settings = Settings()
    except ValidationError as exc:
        lines = (_problem(error, os.environ) for error in exc.errors())
        problems += [line for line in lines if line is not None]
    except pydantic_settings.SettingsError as exc:  # a nested group's JSON that does not parse
        problems += unparsed_groups(os.environ) or [str(exc)]
    if problems:
        raise InvalidSettings(problems)
    return settings


def env_name(*path: str) -> str:
    """The variable of the setting at `path` (`formula`, `max_batch_size`)."""
    return ENV_PREFIX + ENV_DELIMITER.join(part.upper() for part in path)


def unknown_variables(environ: Mapping[str, str], client: bool = False) -> list[str]:
    """One line for each `TEXEL_` variable in `environ` that Texel does not read, with
    the setting it may be a misspelling of: a setting silently not applied would be
    worse than a refusal (a server started with the client's `CLIENT_API_KEY` meant for
    its keys would take every request without one). `client`: `CLIENT_API_KEY` is read."""
    variables = dict(_variables(Settings))
    leaves = [name.removeprefix(ENV_PREFIX) for name, nested in variables.items() if not nested]
    problems = []
    for name in sorted(environ):
        upper = name.upper()  # names are not case-sensitive
        if not upper.startswith(ENV_PREFIX) or upper in variables or upper in NOT_SETTINGS:
            continue
        if upper == CLIENT_API_KEY:
            if not client:
                problems.append(
                    f"{name}: no such setting; did you mean {env_name('api_keys')}? "
                    f"({CLIENT_API_KEY} is the key texel recognize and texel diagnose send)"
                )
            continue
        problem = f"{name}: no such setting"
        # Compared without the prefix all names share, which would make any name close.
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), leaves, n=1)
        if close:
            problem += f"; did you mean {ENV_PREFIX}{close[0]}?"
        problems.append(problem)
    return problems


def _variables(cls: type[BaseModel], *path: str) -> Iterator[tuple[str, bool]]:
    """Every variable the settings of `cls` read, and whether it is a nested group's
    (which takes a JSON object)."""
    for name, field in cls.model_fields.items():
        nested = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        yield env_name(*path, name), nested
        if nested:
            yield from _variables(field.annotation, *path, name)


def unparsed_groups(environ: Mapping[str, str]) -> list[str]:
    """One line for each variable of a group in `environ` whose value is not JSON."""
    groups = {name for name, nested in _variables(Settings) if nested}
    problems = []
    for name in sorted(environ):
        if name.upper() in groups:
            try:
                json.loads(environ[name])
            except ValueError as exc:
                problems.append(f"{name}={environ[name]}: not valid JSON ({exc})")
    return problems


def _problem(error: ErrorDetails, environ: Mapping[str, str]) -> str | None:
    """A pydantic error as a line naming the variable, the value and what is allowed;
    None for a key that names no setting and has a variable of its own, which
    `unknown_variables` reports."""
    path = [part for part in error["loc"] if isinstance(part, str)]  # not a list's index
    if error["type"] == "extra_forbidden":
        return _unknown_key(path, environ)
    message = error["msg"].removeprefix("Value error, ")
    if message.startswith("Input should"):
        message = message.removeprefix("Input ")
    return f"{env_name(*path)}={error['input']}: {message}"


def _unknown_key(path: list[str], environ: Mapping[str, str]) -> str | None:
    """The line for a key at `path` that names no setting, given in the JSON value of a
    group's variable (`TEXEL_FORMULA='{"max_batch": 3}'`), with the setting of that
    group it may be a misspelling of; None where it came from a variable of its own."""
    names = {name.upper(): name for name in environ}
    if env_name(*path) in names:
        return None
    cut = next((n for n in range(len(path) - 1, 0, -1) if env_name(*path[:n]) in names), 1)
    variable = names.get(env_name(*path[:cut]), env_name(*path[:cut]))
    inside, key = path[cut:-1], path[-1]
    group: type[BaseModel] = Settings
    for part in path[:-1]:
        group = group.model_fields[part].annotation
    problem = f"{variable}: the key {'.'.join([*inside, key])} names no setting"
    close = difflib.get_close_matches(key.lower(), list(group.model_fields), n=1)
    if close:
        problem += f"; did you mean {'.'.join([*inside, close[0]])}?"
    return problem
