"""Device selection, out-of-memory handling and allocator gauges, on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch

from batching import OutOfMemory
from models.devices import (
    cpu_has_native_bf16,
    model_name,
    out_of_memory_as_batching_error,
    resolve_devices,
    resolve_dtype,
)


def test_auto_falls_back_to_the_cpu_without_cuda():
    assert resolve_devices("auto") == [torch.device("cpu")]
    assert resolve_devices("cpu") == [torch.device("cpu")]


def test_asking_for_a_missing_gpu_is_a_clear_error():
    for setting in ("cuda", "cuda:3"):
        with pytest.raises(RuntimeError, match="not available|no CUDA"):
            resolve_devices(setting)
    with pytest.raises(ValueError, match="unknown device"):
        resolve_devices("tpu")


def test_a_device_out_of_memory_error_becomes_the_batchers_splitting_signal():
    with pytest.raises(OutOfMemory), out_of_memory_as_batching_error():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(ValueError), out_of_memory_as_batching_error():
        raise ValueError("an ordinary bug stays itself")


def test_shipped_models_are_named_after_their_task(tmp_path):
    (tmp_path / "formula" / "default").mkdir(parents=True)
    assert model_name(str(tmp_path / "formula" / "default")) == "texel-formula"
    assert model_name("org/some-model") == "org/some-model"
    assert model_name("org/some-model", "custom") == "custom"


def test_auto_dtype_is_bf16_on_a_cpu_only_where_asked_and_native():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("auto", gpu, torch.float16) == torch.float16
    assert resolve_dtype("auto", cpu, torch.float16) == torch.float32
    native = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", cpu, torch.bfloat16, torch.bfloat16) == native
    assert resolve_dtype("float32", cpu, torch.bfloat16, torch.bfloat16) == torch.float32
    assert resolve_dtype("bfloat16", cpu, torch.float16) == torch.bfloat16


def test_an_engine_publishes_its_gpu_allocator_memory(monkeypatch):
    """The torch allocator of a GPU is the engine process's: it sets the device's gauges,
    which every HTTP process's /metrics shows (no GPU here: the allocator is a stand-in)."""
    from telemetry import metrics
    from telemetry.metrics import record_allocator

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 4096)
    record_allocator(torch.device("cuda", 1))
    record_allocator(torch.device("cpu"))
    sample = metrics.REGISTRY.get_sample_value
    assert sample("texel_torch_allocated_bytes", {"device": "cuda:1"}) == 1000
    assert sample("texel_torch_reserved_bytes", {"device": "cuda:1"}) == 4096
    assert sample("texel_torch_allocated_bytes", {"device": "cpu"}) is None
