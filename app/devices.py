"""Which devices `texel serve` serves on, known without importing torch in the launcher."""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os

# Where a GPU driver shows itself (NVIDIA's; ROCm's, whose torch names its GPUs cuda too).
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")


@functools.cache
def device_names(setting: str) -> tuple[str, ...]:
    """`TEXEL_DEVICE` resolved to the names of the devices to serve on
    (`models.devices.resolve_devices`, whose errors it raises). Without a GPU driver on
    the machine, `auto` is the CPU, known without torch; otherwise torch says, in a
    process of its own that ends once it has, so the launcher never holds torch. (Not
    the fork server's: it would start before the launcher's environment is set, and its
    children would inherit the environment it started with.)"""
    setting = setting.strip().lower()
    if setting == "cpu" or (setting == "auto" and not any(map(os.path.exists, GPU_DRIVER_PATHS))):
        return ("cpu",)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return tuple(pool.submit(_resolved_names, setting).result())


def _resolved_names(setting: str) -> list[str]:
    from models.devices import resolve_devices

    return [str(device) for device in resolve_devices(setting)]
