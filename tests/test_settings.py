"""Settings come from TEXEL_* variables with `__` for nesting; the launcher plans its
processes and models from them."""

from __future__ import annotations

import os
import re

import pytest
import torch
from pydantic import ValidationError

from app import launcher
from app.launcher import ProcessPlan, model_plans
from app.settings import MODELS_DIR, InvalidSettings, Settings, read_settings, unknown_variables
from engine import ModelPlan
from models.devices import resolve_devices
from tests.conftest import ROOT

CPU = torch.device("cpu")
GPUS = [torch.device("cuda", 0), torch.device("cuda", 1)]


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


def test_invalid_values_are_refused(monkeypatch):
    monkeypatch.setenv("TEXEL_FORMULA__MAX_BATCH_SIZE", "0")
    with pytest.raises(ValidationError):
        Settings()


@pytest.fixture
def environment(monkeypatch):
    """No TEXEL_ variable but those a test sets, and the CPU."""
    for name in [n for n in os.environ if n.upper().startswith("TEXEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TEXEL_DEVICE", "cpu")
    return monkeypatch


def problems(environment, **env: str) -> list[str]:
    for name, value in env.items():
        environment.setenv(name, value)
    try:
        return read_settings().serving_problems()
    except InvalidSettings as exc:
        return exc.problems


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("TEXEL_REQUEST_TIMEOUT_S", "abc", "should be a valid number"),
        ("TEXEL_REQUEST_TIMEOUT_S", "-1", "should be greater than 0"),
        ("TEXEL_HTTP_PROCESSES", "0", "should be greater than or equal to 1"),
        ("TEXEL_FORMULA__MAX_BATCH_SIZE", "0", "should be greater than or equal to 1"),
        ("TEXEL_DTYPE", "float64", "should be 'auto', 'float32', 'float16' or 'bfloat16'"),
        ("TEXEL_LOG_LEVEL", "LOUD", "should be 'DEBUG', 'INFO', 'WARNING', 'ERROR' or"),
        ("TEXEL_DEVICE", "gpu", "should be auto, cpu, cuda or cuda:N"),
        # Past a day, times overflow the event loop's timers: a drain that crashed.
        ("TEXEL_DRAIN_TIMEOUT_S", "inf", "should be a finite number"),
        ("TEXEL_SHUTDOWN_GRACE_S", "1e9", "should be less than or equal to 86400"),
        ("TEXEL_REQUEST_TIMEOUT_S", "Infinity", "should be a finite number"),
        ("TEXEL_FORMULA__MAX_WAIT_MS", "inf", "should be a finite number"),
        ("TEXEL_FORMULA__CACHE_MB", "nan", "should be a finite number"),
    ],
)
def test_an_invalid_value_is_one_line_naming_the_variable_the_value_and_what_is_allowed(
    environment, name, value, allowed
):
    (line,) = problems(environment, **{name: value})
    assert line.startswith(f"{name}={value}: {allowed}")


def test_every_problem_with_the_variables_is_reported_at_once(environment):
    lines = problems(environment, TEXEL_BOGUS="1", TEXEL_DTYPE="x", TEXEL_HTTP_PROCESSES="0")
    assert [line.split(":")[0] for line in lines] == [
        "TEXEL_BOGUS",
        "TEXEL_DTYPE=x",
        "TEXEL_HTTP_PROCESSES=0",
    ]


def test_the_log_level_and_the_device_are_read_in_any_case(environment):
    environment.setenv("TEXEL_LOG_LEVEL", "debug")
    environment.setenv("TEXEL_DEVICE", " CUDA:1 ")
    settings = Settings()
    assert (settings.log_level, settings.device) == ("DEBUG", "cuda:1")


def test_an_unknown_variable_is_refused_with_the_setting_it_may_misspell():
    assert unknown_variables(
        {"TEXEL_BOGUS": "1", "TEXEL_FORMULA__MAX_BATCHSIZE": "2", "TEXEL_WORKER_PROCESSES": "4"}
    ) == [
        "TEXEL_BOGUS: no such setting",
        "TEXEL_FORMULA__MAX_BATCHSIZE: no such setting; "
        "did you mean TEXEL_FORMULA__MAX_BATCH_SIZE?",
        "TEXEL_WORKER_PROCESSES: no such setting; did you mean TEXEL_HTTP_PROCESSES?",
    ]


def test_the_client_key_is_refused_by_a_server_and_read_by_a_client():
    """TEXEL_API_KEY is what `texel recognize` and `texel diagnose` send: a server started
    with it (meant for TEXEL_API_KEYS) would take every request without a key."""
    assert unknown_variables({"TEXEL_API_KEY": "k"}) == [
        "TEXEL_API_KEY: no such setting; did you mean TEXEL_API_KEYS? "
        "(TEXEL_API_KEY is the key texel recognize and texel diagnose send)"
    ]
    assert unknown_variables({"TEXEL_API_KEY": "k"}, client=True) == []


def test_every_variable_the_reference_lists_is_known_in_any_case():
    reference = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `(TEXEL_\w+)`", reference, flags=re.MULTILINE)
    assert len(listed) > 30
    assert unknown_variables({name: "" for name in listed}) == []
    assert unknown_variables({name.lower(): "" for name in listed}) == []


def test_the_variables_texels_own_tools_set_for_its_servers_are_let_through():
    # The launcher's pid for its processes; the benchmarks' and the tests' own.
    own = ["TEXEL_LAUNCHER_PID", "TEXEL_COMMIT", "TEXEL_BENCH_INSTANT", "TEXEL_DATA"]
    own += ["TEXEL_BACKENDS_CACHE", "TEXEL_UPDATE_SCREENSHOT"]
    assert unknown_variables({name: "1" for name in own}) == []


@pytest.mark.parametrize(
    "path", ["/nonexistent/model", "./missing", "../missing", "models/formula/missing"]
)
def test_an_enabled_model_in_a_folder_that_is_not_there_is_refused(environment, path):
    assert problems(environment, TEXEL_FORMULA__MODEL=path) == [
        f"TEXEL_FORMULA__MODEL={path}: no such folder"
    ]


def test_a_model_path_with_a_tilde_is_refused_since_it_is_not_expanded(environment):
    assert problems(environment, TEXEL_IMAGE__MODEL="~/models/image") == [
        "TEXEL_IMAGE__MODEL=~/models/image: no such folder (~ is not expanded)"
    ]


@pytest.mark.parametrize("model", ["org/name", "name"])
def test_a_hub_id_is_accepted_without_looking_it_up(environment, model):
    assert problems(environment, TEXEL_FORMULA__MODEL=model, TEXEL_IMAGE__MODEL=model) == []


def test_a_model_folder_is_accepted_and_a_folder_without_its_files_refused(environment, tmp_path):
    shipped = str(MODELS_DIR / "formula" / "default")
    assert problems(environment, TEXEL_FORMULA__MODEL=shipped) == []
    assert problems(environment, TEXEL_FORMULA__MODEL=str(tmp_path)) == [
        f"TEXEL_FORMULA__MODEL={tmp_path}: not a VisionEncoderDecoderModel folder, it has no "
        "config.json, no preprocessor_config.json or processor_config.json, no tokenizer.json "
        "or tokenizer_config.json"
    ]


def test_a_disabled_model_is_not_looked_for(environment):
    assert problems(environment, TEXEL_IMAGE__MODEL="/nonexistent", TEXEL_IMAGE__ENABLED="0") == []


def test_no_model_enabled_is_refused_as_nothing_to_serve(environment):
    assert problems(environment, TEXEL_FORMULA__ENABLED="false", TEXEL_IMAGE__ENABLED="false") == [
        "TEXEL_FORMULA__ENABLED=false, TEXEL_IMAGE__ENABLED=false: no model is enabled, "
        "nothing to serve"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_this_machine_lacks_is_refused(environment):
    assert problems(environment, TEXEL_DEVICE="cuda:0") == [
        "TEXEL_DEVICE=cuda:0 but that CUDA device is not available"
    ]


def test_devices_are_learned_from_torch_in_a_process_of_its_own_where_a_gpu_may_be(
    monkeypatch, tmp_path
):
    from app import devices

    monkeypatch.setattr(devices, "GPU_DRIVER_PATHS", (str(tmp_path / "none"),))
    devices.device_names.cache_clear()
    monkeypatch.setattr(devices, "_resolved_names", None)  # never called: no driver
    assert devices.device_names("auto") == devices.device_names("cpu") == ("cpu",)
    monkeypatch.undo()
    # A driver there: torch, in a child, says what `auto` is (this machine's answer).
    monkeypatch.setattr(devices, "GPU_DRIVER_PATHS", (str(tmp_path),))
    devices.device_names.cache_clear()
    expected = tuple(str(d) for d in resolve_devices("auto"))
    assert devices.device_names("auto") == expected
    devices.device_names.cache_clear()


def test_one_cpu_http_process_serves_with_the_engine_inside():
    plan = ProcessPlan.of(Settings(device="cpu"), cores=16)
    assert plan == ProcessPlan(["cpu"], 1)
    assert plan.single_process


def test_a_second_http_process_on_a_cpu_puts_the_engine_in_a_process_of_its_own():
    plan = ProcessPlan.of(Settings(device="cpu", http_processes=2), cores=16)
    assert plan == ProcessPlan(["cpu"], 2)
    assert not plan.single_process


@pytest.mark.parametrize(("cores", "http"), [(1, 1), (2, 1), (6, 4), (8, 6), (16, 12), (64, 12)])
def test_with_gpus_there_are_min_12_three_quarters_of_the_cores_http_processes(
    monkeypatch, cores, http
):
    # No GPU on CI: the devices "cuda" resolves to are given.
    monkeypatch.setattr(launcher, "device_names", lambda setting: ("cuda:0", "cuda:1"))
    plan = ProcessPlan.of(Settings(device="cuda"), cores=cores)
    assert plan == ProcessPlan(["cuda:0", "cuda:1"], http)
    assert not plan.single_process


def test_a_set_number_of_http_processes_wins_on_gpus(monkeypatch):
    monkeypatch.setattr(launcher, "device_names", lambda setting: ("cuda:0", "cuda:1"))
    assert ProcessPlan.of(Settings(device="cuda", http_processes=3), cores=64).http_processes == 3
    assert ProcessPlan.of(Settings(device="cuda", http_processes=1), cores=64).http_processes == 1


def test_every_enabled_model_gets_a_plan_with_its_batching_settings(monkeypatch):
    monkeypatch.setenv("TEXEL_FORMULA__MAX_BATCH_SIZE", "32")
    monkeypatch.setenv("TEXEL_FORMULA__MAX_WAIT_MS", "5")
    plans = {plan.key: plan for plan in model_plans(Settings(), [CPU])}
    assert set(plans) == {"formula", "image"}
    formula = plans["formula"]
    assert (formula.max_batch_size, formula.max_wait_s, formula.max_queue) == (32, 0.005, 256)
    monkeypatch.setenv("TEXEL_IMAGE__ENABLED", "false")
    assert [plan.key for plan in model_plans(Settings(), [CPU])] == ["formula"]


def formula_plan(devices) -> ModelPlan:
    (plan,) = [plan for plan in model_plans(Settings(), devices) if plan.key == "formula"]
    return plan


def test_the_formula_batch_size_defaults_by_device(monkeypatch):
    assert formula_plan(GPUS).max_batch_size == 128
    assert formula_plan([CPU]).max_batch_size == 16
    monkeypatch.setenv("TEXEL_FORMULA__MAX_BATCH_SIZE", "48")
    assert formula_plan(GPUS).max_batch_size == formula_plan([CPU]).max_batch_size == 48


def formula_bucket_step(devices) -> int:
    # built, not opened: nothing is read or put on a device
    return formula_plan(devices).build().bucket_step


def test_formula_buckets_are_wider_on_gpus():
    assert formula_bucket_step([torch.device("cuda", 0)]) == 128
    assert formula_bucket_step([CPU]) == 64


def test_a_formula_bucket_width_setting_wins_on_any_device(monkeypatch):
    monkeypatch.setenv("TEXEL_FORMULA__ADVANCED__BUCKET_WIDTH", "96")
    assert formula_bucket_step([torch.device("cuda", 0)]) == 96
    assert formula_bucket_step([CPU]) == 96


def test_advanced_settings_are_read_from_their_nested_variables(monkeypatch):
    monkeypatch.setenv("TEXEL_ADVANCED__KEEP_ALIVE_S", "5")
    monkeypatch.setenv("TEXEL_ADVANCED__PREPROCESS_THREADS", "3")
    monkeypatch.setenv("TEXEL_ADVANCED__GC_FREEZE", "false")
    monkeypatch.setenv("TEXEL_FORMULA__ADVANCED__DECODER", "generate")
    monkeypatch.setenv("TEXEL_FORMULA__ADVANCED__CONTINUOUS", "false")
    monkeypatch.setenv("TEXEL_FORMULA__ADVANCED__NUM_BEAMS", "4")
    monkeypatch.setenv("TEXEL_FORMULA__ADVANCED__MAX_NEW_TOKENS", "64")
    monkeypatch.setenv("TEXEL_IMAGE__ADVANCED__PNG_COMPRESS_LEVEL", "6")
    settings = Settings()
    assert settings.advanced.keep_alive_s == 5
    assert settings.advanced.preprocess_threads == 3
    assert settings.advanced.gc_freeze is False
    models = {plan.key: plan.build() for plan in model_plans(settings, [CPU])}
    formula, image = models["formula"], models["image"]
    assert (formula.decoder_setting, formula.continuous) == ("generate", False)
    assert (formula.num_beams, formula.max_new_tokens) == (4, 64)
    assert image.png_compress_level == 6


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
