"""Real observability backends for the tests: fetched by the scripts beside this file.

`prometheus.sh` unpacks Debian's prometheus package; `chromium.sh` Debian's chromium
(and the libraries it needs that the system lacks) for the page tests; `phoenix.sh`
installs Arize Phoenix into its own venv. All cache under `~/.cache/texel/backends`,
shared by every checkout (or `$TEXEL_BACKENDS_CACHE`), and are called from fixtures,
so `make test` alone works on a fresh machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
CANNOT_HERE = 3  # the scripts' exit status for "no apt / no room / no python here"


# For the tests that draw formulas with a real LaTeX (Debian's TeX Live packages).
needs_latex = pytest.mark.skipif(
    shutil.which("latex") is None or shutil.which("dvipng") is None,
    reason="latex and dvipng are not installed (apt-get install texlive-latex-base dvipng)",
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def unavailable(message: str) -> None:
    """Skip on a user's machine; under CI a missing backend is a failure, never a skip."""
    if in_ci():
        pytest.fail(f"{message} (CI=true: backend tests must run)", pytrace=False)
    pytest.skip(message)


def ensure_backend(script: str, timeout_s: float = 1200) -> Path:
    """Run `tests/backends/<script>` (idempotent) and return the path it prints."""
    if shutil.which("bash") is None:
        unavailable(f"{script} needs bash")
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(HERE / script)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    took = time.monotonic() - started
    if result.returncode == 0:
        if took > 5:
            print(f"{script}: backend installed in {took:.0f} s")
        return Path(result.stdout.strip().splitlines()[-1])
    message = f"{script} exited {result.returncode}: {result.stderr.strip()[-1500:]}"
    if result.returncode == CANNOT_HERE:
        unavailable(message)
    pytest.fail(message, pytrace=False)


class BackgroundProcess:
    """A backend server in a subprocess, with its output in a log file.

    `env` is its whole environment (default: this process's).
    """

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            args,
            env=os.environ.copy() if env is None else env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_http(self, url: str, timeout: float = 120) -> None:
        """Wait until `url` answers 200, or fail with the log's tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{url}: the backend exited early:\n{self.log()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{url} not OK after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self, timeout: float = 20) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
