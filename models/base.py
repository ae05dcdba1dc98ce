"""The model contract: what Texel asks of a model family, written once.

A `Model` is used on two sides of the engine protocol, like LitServe's `LitAPI`:

- In an engine, which owns a device: `open`, `load(device)`, `warmup`, then for every
  queued request `bucket` and `cost`, and for every batch `runner(device)`, which runs a
  list of payloads (or, for continuous batching, a stream). `describe` says what the
  HTTP side needs to know of the loaded model (its defaults, for example).
- In an HTTP process, which holds no weights: `open`, `attach(description)`, then per
  request the `request_stages` (an upload or a JSON body to a payload) and, once the
  engine answers, the `response_stages` (the engine's output to the route's result).
  Each stage runs on a thread pool and is traced and timed under its name; response
  stages that take microseconds (`quick_response`) run on the event loop instead, so an
  answer does not queue behind other requests' milliseconds of preprocessing, and so do
  the request stages of a request the model calls cheap (`quick_request`: a small
  picture), whose hand-off to the pool and back would cost more than the work.

Payloads and outputs cross the engine protocol: they are dataclasses or msgspec structs
of plain values and numpy arrays, with `payload_type` and `output_type` naming them.
A new model family is one subclass here and one entry in the settings.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

ShouldStop = Callable[[], bool]
Stage = tuple[str, Callable[[Any], Any]]


def load_failure(exc: BaseException, source: str | None = None) -> str:
    """Why a model from `source` could not be opened or loaded, in one line. A hub id not
    in the local cache while `HF_HUB_OFFLINE` is set is said in Texel's terms: the hub
    library's own message advises an argument (`local_files_only`) a Texel user does not
    pass, and a stack trace it does not show."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if isinstance(exc, OSError) and offline and source and not Path(source).exists():
        return (
            f"{source} is neither a local folder nor in this machine's Hugging Face cache, "
            f"and HF_HUB_OFFLINE is set: download it where there is network (hf download "
            f"{source}) into this cache, or give a local folder"
        )
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def log_load_failure(
    log: logging.Logger, exc: BaseException, message: str, *args: Any, source: str | None = None
) -> str:
    """Log why a model could not be opened or loaded, and return it in one line
    (`load_failure`), for the model's state. Files that are missing or cannot be fetched
    (`from_pretrained` raises OSError for a folder without them and for a hub id out of
    reach) are the user's to fix and their message says what: that line. Anything else
    may be Texel's bug: with its traceback."""
    reason = load_failure(exc, source)
    if isinstance(exc, OSError):
        log.error(message + ": %s", *args, reason)
    else:
        log.exception(message, *args)
    return reason


class BatchRun(Protocol):
    """Runs one batch of payloads on the device; one output (or exception) per payload.

    Long computations poll `should_stop()` and end early when it is true: every request
    of the batch has gone away.
    """

    def __call__(self, payloads: list[Any], should_stop: ShouldStop) -> list[Any]: ...


@dataclass(frozen=True)
class DeviceRunner:
    """What runs a model's work on one device: batches, and with `stream` continuous
    batching, where requests join and leave a running computation (`batching.stream`)."""

    run: BatchRun
    stream: Callable[[Any], None] | None = None

    def __call__(self, payloads: list[Any], should_stop: ShouldStop) -> list[Any]:
        return self.run(payloads, should_stop)


class Model(ABC):
    """One served model family. Subclasses set `key` (its settings entry and route's
    model), `payload_type` and `output_type`."""

    key: ClassVar[str]
    operation: ClassVar[str] = "generate_content"  # gen_ai.operation.name of its spans
    payload_type: ClassVar[type]
    output_type: ClassVar[type]
    # Requests that are short and waited for (formulas): on a GPU shared with other
    # models its work goes first (`engine.sharing`).
    latency_sensitive: ClassVar[bool] = False
    # Response stages that take microseconds (detokenizing): they run on the event loop,
    # not queued in the thread pool behind other requests' preprocessing.
    quick_response: ClassVar[bool] = False

    def __init__(self, source: str, name: str) -> None:
        self.source = source
        self.name = name  # reported in responses, spans and metrics

    # -- both sides ------------------------------------------------------------

    @abstractmethod
    def open(self) -> None:
        """Load what requests need around the model (tokenizer, image spec), no weights."""

    # -- in the engine ---------------------------------------------------------

    @abstractmethod
    def load(self, device: torch.device) -> None:
        """Put the weights on `device` (after `open`)."""

    @abstractmethod
    def warmup(self, device: torch.device, max_batch_size: int) -> None:
        """Run every shape a request can need once, so no request pays for a first run."""

    def describe(self) -> dict[str, Any]:
        """Facts about the loaded model that the HTTP side needs (`attach`); plain values."""
        return {}

    @abstractmethod
    def bucket(self, payload: Any) -> Hashable:
        """Requests of one bucket can run in one batch."""

    def cost(self, payload: Any) -> float:
        """Predicted work of one request, relative to the others of this model."""
        return 1.0

    @property
    def merge_buckets(self) -> bool:
        """Whether a batch may be topped up from other buckets."""
        return False

    def padding_efficiency(self, payloads: list[Any]) -> float | None:
        """Real over padded input elements of a batch, where padding applies."""
        return None

    @abstractmethod
    def runner(self, device: torch.device) -> DeviceRunner:
        """What the engine's compute thread for `device` calls (after `warmup`)."""

    # -- in an HTTP process ----------------------------------------------------

    def attach(self, description: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Take what the engine's `describe` said of the loaded model."""

    def quick_request(self, request: Any) -> bool:
        """Whether this request's stages take so little (about a millisecond) that they
        run on the event loop instead of the thread pool; by default never."""
        return False

    @abstractmethod
    def request_stages(self) -> list[Stage]:
        """(stage name, function) pairs that turn a request into a payload, in order."""

    @abstractmethod
    def response_stages(self) -> list[Stage]:
        """(stage name, function) pairs that turn an output into the route's result."""

    def span_attributes(self, stage: str, value: Any) -> dict[str, Any]:
        """Attributes of a stage's span, from the value it produced."""
        return {}
