"""Settings come from TEXEL_* variables with `__` for nesting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.settings import Settings


def test_nested_model_settings_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("TEXEL_DEVICE", "cuda:1")
    monkeypatch.setenv("TEXEL_FORMULA__MODEL", "org/formula-model")
    monkeypatch.setenv("TEXEL_FORMULA__MAX_BATCH_SIZE", "64")
    monkeypatch.setenv("TEXEL_IMAGE__MAX_WAIT_MS", "5")
    monkeypatch.setenv("TEXEL_IMAGE__MAX_QUEUE", "7")
    settings = Settings()
    assert settings.device == "cuda:1"
    assert settings.formula.model == "org/formula-model"
    assert settings.formula.max_batch_size == 64
    assert settings.image.max_wait_ms == 5
    assert settings.image.max_queue == 7


def test_lists_accept_commas_or_json(monkeypatch):
    monkeypatch.setenv("TEXEL_API_KEYS", "a, b")
    monkeypatch.setenv("TEXEL_CORS_ORIGINS", '["https://x.example"]')
    settings = Settings()
    assert settings.api_keys == ["a", "b"]
    assert settings.cors_origins == ["https://x.example"]


def test_defaults_point_at_the_shipped_models():
    settings = Settings()
    assert settings.formula.model.endswith("models/formula/default")
    assert settings.image.model.endswith("models/image/default")
    assert settings.api_keys == [] and settings.log_format == "text"


def test_formula_buckets_are_wider_on_gpus_unless_set(monkeypatch):
    import torch

    from app.serving import build_models
    from models.formula.adapter import FormulaRecognizer

    cpu, gpu = [torch.device("cpu")], [torch.device("cuda:0")]
    assert FormulaRecognizer("m", cpu).bucket_step == 64
    assert FormulaRecognizer("m", gpu).bucket_step == 128
    assert FormulaRecognizer("m", gpu, bucket_step=64).bucket_step == 64
    monkeypatch.setenv("TEXEL_IMAGE__ENABLED", "false")
    assert Settings().formula.bucket_width is None
    served = build_models(Settings(), gpu, worker_processes=False)
    assert served["formula"].adapter.bucket_step == 128, "unset: the device's default"
    monkeypatch.setenv("TEXEL_FORMULA__BUCKET_WIDTH", "96")
    served = build_models(Settings(), gpu, worker_processes=False)
    assert served["formula"].adapter.bucket_step == 96, "a setting wins on any device"


def test_invalid_values_are_refused(monkeypatch):
    monkeypatch.setenv("TEXEL_FORMULA__MAX_BATCH_SIZE", "0")
    with pytest.raises(ValidationError):
        Settings()


def test_process_plan_follows_the_devices_unless_set() -> None:
    import torch

    from app.serving import ProcessPlan, process_plan

    cpu, gpu = [torch.device("cpu")], [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert process_plan(Settings(), cpu, cores=2) == ProcessPlan(0, None, False, 1)
    # On a GPU: HTTP processes decode their own images, so no preprocessing processes...
    assert process_plan(Settings(), gpu, cores=16) == ProcessPlan(0, 0.5, True, 4)
    # ...unless there are too few cores for more than one HTTP process.
    assert process_plan(Settings(), gpu, cores=6) == ProcessPlan(1, 0.5, True, 1)
    one_http = Settings(http_processes=1)
    assert process_plan(one_http, gpu, cores=16) == ProcessPlan(4, 0.5, True, 1)
    threads = Settings(worker_processes=False, http_processes=1)
    assert process_plan(threads, gpu, cores=16) == ProcessPlan(8, 0.5, False, 1)
    assert process_plan(threads, gpu, cores=6) == ProcessPlan(3, 0.5, False, 1)
    set_explicitly = Settings(preprocess_processes=2, switch_interval_ms=5, http_processes=3)
    assert process_plan(set_explicitly, gpu, cores=16) == ProcessPlan(2, 5, True, 3)
    assert process_plan(Settings(preprocess_processes=2), cpu, cores=2) == ProcessPlan(
        2, None, False, 1
    )
    assert process_plan(Settings(worker_processes=True), cpu, cores=2).worker_processes
    assert process_plan(Settings(http_processes=2), cpu, cores=2).http_processes == 2
    images_only = Settings(formula={"enabled": False})
    assert process_plan(images_only, gpu, cores=16) == ProcessPlan(0, 0.5, True, 4)


def test_usable_cores_follow_the_container_cpu_limit(tmp_path) -> None:
    import os

    from telemetry.resources import usable_cores

    machine = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path) == machine  # no cgroup files: the affinity mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == machine
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core: still one
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(tmp_path) == machine
