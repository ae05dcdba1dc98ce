"""`texel serve` (and `texel recognize` in-process) refuse settings they cannot start
with before anything loads: exit status 2, one line per problem naming the variable the
operator set, and no traceback; so do the `texel` commands their arguments. A server
stopped with Ctrl-C ends without a traceback, and `make run` starts one without
installing anything. Each test runs the real command in a subprocess."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import ROOT, formula_png, free_port, wait_for


def texel(
    *args: str, env: dict[str, str], timeout: float = 60, preexec_fn=None
) -> subprocess.CompletedProcess:
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
        timeout=timeout,
        preexec_fn=preexec_fn,
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
            "folder, it has no config.json, no preprocessor_config.json or "
            "processor_config.json, no tokenizer.json or tokenizer_config.json\n"
            "TEXEL_IMAGE__MODEL=models/formula/default: not a diffusers pipeline folder, it "
            "has no model_index.json",
        ),
        (
            {"TEXEL_FORMULA__ENABLED": "false", "TEXEL_IMAGE__ENABLED": "false"},
            "TEXEL_FORMULA__ENABLED=false, TEXEL_IMAGE__ENABLED=false: no model is enabled, "
            "nothing to serve",
        ),
        (  # past it, reading an upload overflows: every multipart /recognize was a 500
            {"TEXEL_MAX_UPLOAD_BYTES": str(2**63 - 1)},
            f"TEXEL_MAX_UPLOAD_BYTES={2**63 - 1}: should be less than or equal to {2**30}",
        ),
        (  # a group's JSON form: a key it does not know was silently not applied
            {"TEXEL_FORMULA": '{"max_batch": 3}'},
            "TEXEL_FORMULA: the key max_batch names no setting; did you mean max_batch_size?",
        ),
        (
            {"TEXEL_FORMULA": '{"advanced": {"num_beam": 2}}'},
            "TEXEL_FORMULA: the key advanced.num_beam names no setting; "
            "did you mean advanced.num_beams?",
        ),
        ({"TEXEL_ADVANCED": '{"foo": 1}'}, "TEXEL_ADVANCED: the key foo names no setting"),
        (
            {"TEXEL_FORMULA__ADVANCED": '{"num_beams":'},
            'TEXEL_FORMULA__ADVANCED={"num_beams":: not valid JSON '
            "(Expecting value: line 1 column 14 (char 13))",
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
        "upload-past-1-gib",
        "group-key",
        "group-nested-key",
        "advanced-key",
        "group-json",
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


def without_dac_override() -> None:
    """In a child before it runs the command: as root, give up the capabilities that
    read past a file's mode (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so that a folder of
    mode 000 is as unreadable to the command as to any other user."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, taking effect at exec
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("locked_part", [".", "tokenizer.json"])
def test_serve_refuses_a_model_folder_it_cannot_read_in_one_line(tmp_path, locked_part):
    """The folder itself, or one file in it (which failed the model only as its engine
    loaded it, with a traceback)."""
    folder = tmp_path / "formula"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    locked = folder / locked_part
    locked.chmod(0)
    try:
        probe = subprocess.run(
            [sys.executable, "-c", f"open({str(folder / 'tokenizer.json')!r})"],
            preexec_fn=without_dac_override,
            capture_output=True,
        )
    except subprocess.SubprocessError as exc:
        pytest.skip(f"running as root, and the capabilities that ignore modes stay: {exc}")
    if probe.returncode == 0:
        pytest.skip("a path of mode 000 is readable here (root with CAP_DAC_OVERRIDE)")
    try:
        result = texel(
            "serve",
            "--port",
            str(free_port()),
            env={"TEXEL_FORMULA__MODEL": str(folder)},
            preexec_fn=without_dac_override,
        )
    finally:
        locked.chmod(0o755)
    why = "Permission denied" if locked_part == "." else "tokenizer.json: Permission denied"
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [f"TEXEL_FORMULA__MODEL={folder}: cannot read it ({why})"],
    )


def test_ctrl_c_drains_a_one_process_server_which_exits_130_without_a_traceback(tiny_env):
    """`make run`'s server: uvicorn raises the SIGINT it caught again once it has
    stopped, which ended the drained server with a KeyboardInterrupt traceback."""
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if not k.upper().startswith("TEXEL_")}
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env={**inherited, **tiny_env, "TEXEL_LOG_FORMAT": "text"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As in a terminal, even where this runner was started with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(
            lambda: (
                server.poll() is not None
                or httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            ),
            timeout=180,
        )
        server.send_signal(signal.SIGINT)
        log, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 130, log
    assert "received SIGINT: draining" in log
    assert "Traceback" not in log
    assert "KeyboardInterrupt" not in log


def test_recognize_in_process_refuses_a_cuda_device_this_machine_lacks(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    image = tmp_path / "a.png"
    image.write_bytes(formula_png())
    result = texel("recognize", str(image), env={"TEXEL_DEVICE": "cuda"})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == ["TEXEL_DEVICE=cuda but no CUDA device is available"]


def test_recognize_in_process_refuses_a_formula_model_folder_that_is_not_there(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(formula_png())
    result = texel("recognize", str(image), env={"TEXEL_FORMULA__MODEL": "/nonexistent/model"})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == ["TEXEL_FORMULA__MODEL=/nonexistent/model: no such folder"]


def test_recognize_in_process_refuses_an_empty_model_folder_in_one_line(tmp_path):
    image, empty = tmp_path / "a.png", tmp_path / "model"
    image.write_bytes(formula_png())
    empty.mkdir()
    result = texel("recognize", str(image), env={"TEXEL_FORMULA__MODEL": str(empty)})
    assert (result.returncode, result.stdout) == (2, "")
    [line] = result.stderr.splitlines()
    assert line.startswith(f"TEXEL_FORMULA__MODEL={empty}: not a VisionEncoderDecoderModel folder")


def test_recognize_in_process_does_not_check_the_image_model_it_does_not_load(tiny_env, tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(formula_png())
    env = {**tiny_env, "TEXEL_IMAGE__MODEL": "/nonexistent/model"}
    result = texel("recognize", str(image), env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "latex" in json.loads(result.stdout)


@pytest.mark.parametrize("window", ["nan", "inf", "1e300", "0.1", "121", "ten"])
def test_diagnose_refuses_a_window_the_server_would_not_take_as_a_usage_error(window):
    result = texel(
        "diagnose", "--url", f"http://127.0.0.1:{free_port()}", "--window", window, env={}
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: texel diagnose")
    assert f"argument --window: {window!r} is not a window in seconds (0.5 to 120)" in result.stderr


def make_dry_run(folder: Path, target: str) -> list[str]:
    """The commands `make TARGET` would run in `folder`, which holds the Makefile."""
    result = subprocess.run(
        ["make", "-n", target], cwd=folder, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_installs_a_fresh_clone_and_never_reinstalls_a_stale_one(tmp_path):
    """Serving needs no network: after a change to pyproject.toml or the constraints,
    `make install` and `make test` install again, `make run` serves what is there."""
    shutil.copy(ROOT / "Makefile", tmp_path)
    (tmp_path / "deploy").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "deploy" / "constraints.txt").write_text("")

    def installs(target: str) -> bool:
        return any("pip install" in line for line in make_dry_run(tmp_path, target))

    assert installs("run")  # a fresh clone: no .venv yet
    stamp = tmp_path / ".venv" / ".texel-installed"
    stamp.parent.mkdir()
    stamp.touch()
    os.utime(stamp, (1, 1))  # older than pyproject.toml
    assert not installs("run")
    assert any("texel serve" in line for line in make_dry_run(tmp_path, "run"))
    assert installs("install")
    assert installs("test")
