"""Machine gauges read at scrape time: GPUs through NVML, the torch allocator, process CPU.

On a machine without an NVIDIA GPU the GPU series are absent, not zero, so a
dashboard never mistakes "no GPU" for "idle GPU".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    device: str
    utilization: float  # 0..1, the share of the last sample period a kernel ran
    memory_used: int
    memory_total: int
    power_watts: float | None
    temperature_c: float | None


class Nvml:
    """NVML, initialized once; `available` is False on machines without the driver."""

    def __init__(self) -> None:
        self.available = False
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.available = self.count > 0
        except Exception:  # no driver, no library, or no permission: no GPU series
            self.count = 0

    def read(self) -> list[GpuReading]:
        if not self.available:
            return []
        nvml = self._nvml
        readings = []
        for index in range(self.count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                log.debug("NVML read of GPU %d failed: %s", index, exc)
                continue
            readings.append(
                GpuReading(
                    device=f"cuda:{index}",
                    utilization=util.gpu / 100.0,
                    memory_used=int(memory.used),
                    memory_total=int(memory.total),
                    power_watts=_optional(lambda h=handle: nvml.nvmlDeviceGetPowerUsage(h) / 1000),
                    temperature_c=_optional(
                        lambda h=handle: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
                    ),
                )
            )
        return readings


def _optional(read):
    try:
        return float(read())
    except Exception:
        return None


class CpuMeter:
    """CPU utilization of the server between two readings, as a share of the usable cores.

    The server is every process of it: with a launcher (`TEXEL_LAUNCHER_PID`), the
    launcher and its engine and HTTP processes, so that the scrape an HTTP process
    happens to answer counts the engines' work too; in one process, that process.
    """

    def __init__(self, launcher_pid: int | None = None) -> None:
        if launcher_pid is None and os.environ.get("TEXEL_LAUNCHER_PID"):
            launcher_pid = int(os.environ["TEXEL_LAUNCHER_PID"])
        self._launcher = _process(launcher_pid) if launcher_pid is not None else None
        self._own = psutil.Process()
        self._cores = usable_cores()
        self._lock = threading.Lock()
        self._last = (time.monotonic(), time.time(), self._cpu_seconds())

    def _cpu_seconds(self) -> dict[int, tuple[float, float]]:
        """(CPU seconds, start time) of each live process of the server, by process id."""
        processes = [self._own]
        if self._launcher is not None:
            # Gone, the launcher leaves this process to count.
            with contextlib.suppress(psutil.Error):
                processes = [self._launcher, *self._launcher.children(recursive=True)]
        seconds = {}
        for process in processes:
            try:
                times = process.cpu_times()
                seconds[process.pid] = (times.user + times.system, process.create_time())
            except psutil.Error:  # it exited meanwhile
                continue
        return seconds

    def utilization(self) -> float:
        with self._lock:
            now, wall, cpu = time.monotonic(), time.time(), self._cpu_seconds()
            last_t, last_wall, last_cpu = self._last
            self._last = (now, wall, cpu)
        used = 0.0
        for pid, (seconds, started) in cpu.items():
            before = last_cpu.get(pid)
            if before is not None and before[1] == started:
                used += seconds - before[0]
            elif started >= last_wall:  # started since the last reading: all of it counts
                used += seconds
        elapsed = max(now - last_t, 1e-6)
        return min(1.0, max(0.0, used / (elapsed * self._cores)))


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: its CPU affinity, capped by the CPU quota of its
    cgroup (a container's CPU limit). `os.cpu_count()` counts the whole machine, so a
    pod limited to 4 cores on a 64-core node would size its pools for 64."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    for quota_file, period_file in (
        ("cpu.max", None),  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
        ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us"),  # cgroup v1: -1 is no limit
    ):
        try:
            fields = (cgroup / quota_file).read_text().split()
            if period_file is not None:
                fields.append((cgroup / period_file).read_text().strip())
            quota, period = fields[0], fields[1]
            if quota not in ("max", "-1"):
                cores = min(cores, math.ceil(int(quota) / int(period)))
            break
        except (OSError, ValueError, IndexError):
            continue
    return max(1, cores)


class ResourceCollector(Collector):
    """Prometheus collector for GPU, torch-allocator and process-CPU gauges."""

    def __init__(self, nvml: Nvml | None = None) -> None:
        self.nvml = nvml or Nvml()
        self.cpu = CpuMeter()

    def collect(self):
        cpu = GaugeMetricFamily(
            "texel_process_cpu_utilization_ratio",
            "CPU time of every process of the server (launcher, engines, HTTP processes) since "
            "the previous scrape, over wall time times usable cores (0..1).",
        )
        cpu.add_metric([], self.cpu.utilization())
        yield cpu
        yield from self._nvml()

    def _nvml(self):
        readings = self.nvml.read()
        if not readings:
            return
        families = {
            "utilization": GaugeMetricFamily(
                "texel_gpu_utilization_ratio",
                "Share of time a kernel ran (NVML).",
                labels=["device"],
            ),
            "memory_used": GaugeMetricFamily(
                "texel_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["device"]
            ),
            "memory_total": GaugeMetricFamily(
                "texel_gpu_memory_total_bytes", "GPU memory in all (NVML).", labels=["device"]
            ),
            "power_watts": GaugeMetricFamily(
                "texel_gpu_power_watts", "GPU power draw (NVML).", labels=["device"]
            ),
            "temperature_c": GaugeMetricFamily(
                "texel_gpu_temperature_celsius", "GPU temperature (NVML).", labels=["device"]
            ),
        }
        for reading in readings:
            for field, family in families.items():
                value = getattr(reading, field)
                if value is not None:
                    family.add_metric([reading.device], value)
        yield from families.values()
