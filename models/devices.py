"""Which devices and dtypes a model runs on."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batching import OutOfMemory


def resolve_devices(setting: str) -> list[torch.device]:
    """Turn `TEXEL_DEVICE` (auto, cpu, cuda, cuda:N) into the devices to run workers on.

    `auto` and `cuda` mean every visible GPU, one worker each; `auto` falls back
    to the CPU on a machine without CUDA.
    """
    setting = setting.strip().lower()
    if setting == "cpu":
        return [torch.device("cpu")]
    if setting in ("auto", "cuda"):
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if setting == "cuda":
            raise RuntimeError("TEXEL_DEVICE=cuda but no CUDA device is available")
        return [torch.device("cpu")]
    if setting.startswith("cuda:"):
        index = int(setting.split(":", 1)[1])
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise RuntimeError(f"TEXEL_DEVICE={setting} but that CUDA device is not available")
        return [torch.device("cuda", index)]
    raise ValueError(f"unknown device {setting!r}; use auto, cpu, cuda or cuda:N")


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new CUDA stream for work beside the calling thread's current stream, at that
    stream's priority: the engine may have put this model's work on a high-priority
    stream (`engine.sharing`), and its side work must not fall behind other models'."""
    return torch.cuda.Stream(device, priority=torch.cuda.current_stream(device).priority)


@dataclass(frozen=True)
class GraphFamily:
    """CUDA graphs that replay one after another, on one stream: the memory pool they
    share and the stream they are captured on.

    A graph keeps the cuBLAS workspace of the stream it was captured on (torch keys the
    workspaces by handle and stream), so graphs that may replay at the same time on
    different streams must be captured on different streams: sharing one, two replays'
    matrix multiplies would run in one workspace at once, which can give wrong numbers
    or wedge the device. Hence one family, with its own capture stream, per replay
    stream."""

    pool: Any
    stream: torch.cuda.Stream

    @classmethod
    def on(cls, device: torch.device) -> GraphFamily:
        return cls(torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))


def capture_graph(
    run: Callable,
    family: GraphFamily,
    device: torch.device,
    *,
    warm: Callable,
    warmups: int,
) -> torch.cuda.CUDAGraph:
    """`warm()` `warmups` times on a side stream (allocations settle, kernels load), then
    one `run()` captured as a CUDA graph of `family` (its pool, on its capture stream).

    Streams and captures belong to the current device, so `device` is made current: a
    worker for cuda:1 runs on a thread (or in a process) whose current device is cuda:0,
    and its captures would otherwise record nothing and fail.
    """
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                warm()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=family.pool, stream=family.stream, capture_error_mode="thread_local"
        ):
            run()
    return graph


def resolve_dtype(
    setting: str, device: torch.device, half: torch.dtype, cpu_half: torch.dtype | None = None
) -> torch.dtype:
    """`auto` is `half` (fp16/bf16) on a GPU; on the CPU, `cpu_half` where the processor
    multiplies bf16 natively (`cpu_has_native_bf16`), else fp32."""
    if setting == "auto":
        if device.type == "cuda":
            return half
        return cpu_half if cpu_half is not None and cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[setting]


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this processor has bf16 matrix instructions (AVX512-BF16 or AMX-BF16), which
    oneDNN uses for bf16 matrix multiplies; elsewhere bf16 is emulated and no faster."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: keep fp32
        return False
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


@contextlib.contextmanager
def out_of_memory_as_batching_error() -> Iterator[None]:
    """Turn a device's out-of-memory error into the batcher's `OutOfMemory`, which splits."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise OutOfMemory(str(exc)) from exc


def model_name(source: str, name: str | None = None) -> str:
    """The name a model is reported under: explicit, else the hub id or directory name.

    Texel's shipped models live in `models/<task>/default` and are named `texel-<task>`.
    """
    if name:
        return name
    path = Path(source)
    if not path.exists():
        return source
    path = path.resolve()
    return f"texel-{path.parent.name}" if path.name == "default" else path.name
