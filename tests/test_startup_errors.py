"""`texel serve` (and `texel recognize` in-process) refuse settings they cannot start
with before anything loads: exit status 2, one line per problem naming the variable the
operator set, and no traceback. Each test runs the real command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, formula_png, free_port


def texel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The `texel` command with `env` as its only TEXEL_ variables (on the CPU unless
    `env` says otherwise). A command that starts serving instead of refusing runs into
    the timeout, which kills it and fails the test."""
    inherited = {k: v for k, v in os.environ.items() if not k.upper().startswith("TEXEL_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env={**inherited, "TEXEL_DEVICE": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def texel_serve(*args: str, **env: str) -> subprocess.CompletedProcess:
    return texel("serve", "--host", "127.0.0.1", *(args or ("--port", str(free_port()))), env=env)


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"TEXEL_REQUEST_TIMEOUT_S": "abc"},
            "TEXEL_REQUEST_TIMEOUT_S=abc: should be a valid number, unable to parse string as "
            "a number",
        ),
        (
            {"TEXEL_FORMULA__MAX_BATCH_SIZE": "0"},
            "TEXEL_FORMULA__MAX_BATCH_SIZE=0: should be greater than or equal to 1",
        ),
        (
            {"TEXEL_LOG_LEVEL": "LOUD"},
            "TEXEL_LOG_LEVEL=LOUD: should be 'DEBUG', 'INFO', 'WARNING', 'ERROR' or 'CRITICAL'",
        ),
        ({"TEXEL_BOGUS": "1"}, "TEXEL_BOGUS: no such setting"),
        (  # a template's unset variable: the server would take a bare `Bearer`
            {"TEXEL_API_KEYS": '["sk-1", ""]'},
            'TEXEL_API_KEYS=["sk-1", ""]: a key is empty',
        ),
        (  # copied from the address bar: it would match no browser's Origin
            {"TEXEL_CORS_ORIGINS": "https://app.example/"},
            "TEXEL_CORS_ORIGINS=https://app.example/: https://app.example/ is not an origin: "
            "scheme://host[:port], with no path or trailing /",
        ),
        (
            {"TEXEL_FORMULA__MAX_BATCHSIZE": "2"},
            "TEXEL_FORMULA__MAX_BATCHSIZE: no such setting; "
            "did you mean TEXEL_FORMULA__MAX_BATCH_SIZE?",
        ),
        (
            {"TEXEL_FORMULA__MODEL": "/nonexistent/model"},
            "TEXEL_FORMULA__MODEL=/nonexistent/model: no such folder",
        ),
        (  # the models mixed up: a folder, but not of the family the setting serves
            {
                "TEXEL_FORMULA__MODEL": "models/image/default",
                "TEXEL_IMAGE__MODEL": "models/formula/default",
            },
            "TEXEL_FORMULA__MODEL=models/image/default: not a VisionEncoderDecoderModel "
            "folder, it has no config.json, no preprocessor_config.json, no tokenizer.json or "
            "tokenizer_config.json\n"
            "TEXEL_IMAGE__MODEL=models/formula/default: not a diffusers pipeline folder, it "
            "has no model_index.json",
        ),
        (
            {"TEXEL_FORMULA__ENABLED": "false", "TEXEL_IMAGE__ENABLED": "false"},
            "TEXEL_FORMULA__ENABLED=false, TEXEL_IMAGE__ENABLED=false: no model is enabled, "
            "nothing to serve",
        ),
    ],
    ids=[
        "not-a-number",
        "out-of-range",
        "log-level",
        "unknown",
        "empty-key",
        "origin",
        "misspelt",
        "model",
        "not-a-model",
        "none",
    ],
)
def test_serve_refuses_a_bad_setting_with_one_line_and_status_2(env, line):
    result = texel_serve(**env)
    assert (result.returncode, result.stderr.splitlines(), result.stdout) == (
        2,
        line.splitlines(),
        "",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_serve_refuses_a_cuda_device_this_machine_lacks_without_a_traceback():
    result = texel_serve(TEXEL_DEVICE="cuda")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["TEXEL_DEVICE=cuda but no CUDA device is available"]


def test_serve_refuses_an_inherited_prometheus_multiproc_dir_in_one_line(tmp_path):
    """A base image's or a gunicorn habit: it gave a 30-line traceback for a folder not
    there, and metric files left behind in one that is."""
    for folder in (tmp_path / "missing", tmp_path):
        result = subprocess.run(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(free_port())],
            cwd=ROOT,
            env={**os.environ, "TEXEL_DEVICE": "cpu", "PROMETHEUS_MULTIPROC_DIR": str(folder)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [
            "PROMETHEUS_MULTIPROC_DIR is set: texel serve sets it for its own processes, "
            "in a folder of its own; unset it"
        ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("port", ["99999", "-1", "eighty"])
def test_serve_refuses_a_port_outside_0_to_65535_as_a_usage_error(port):
    result = texel_serve("--port", port)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: texel serve")
    assert f"argument --port: '{port}' is not a port (0 to 65535)" in result.stderr


def test_recognize_in_process_refuses_a_misspelt_setting(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(formula_png())
    result = texel("recognize", str(image), env={"TEXEL_FORMULA__MAX_BATCHSIZE": "2"})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "TEXEL_FORMULA__MAX_BATCHSIZE: no such setting; did you mean TEXEL_FORMULA__MAX_BATCH_SIZE?"
    ]
