"""Helpers the tests share: pictures of formulas, polling, and the server harness.

The shared fixtures (tiny models, real Texel servers) are in `tests.fixtures`, which the
conftest.py at the repository root loads for the tests and the benchmarks' tests alike."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

from tests.server import ROOT, ServerProcess, free_port

__all__ = ["ROOT", "ServerProcess", "free_port", "formula_png", "wait_for"]
SHARED_DATA = Path(os.environ.get("TEXEL_DATA", ROOT.parent / "shared" / "data"))
# What OpenAI's JavaScript client (openai 6.x, `dangerouslyAllowBrowser`) adds to each
# request in a browser: headers a preflight must allow.
OPENAI_JS_HEADERS = {
    "X-Stainless-Lang": "js",
    "X-Stainless-Package-Version": "6.49.0",
    "X-Stainless-OS": "Unknown",
    "X-Stainless-Arch": "unknown",
    "X-Stainless-Runtime": "browser:chrome",
    "X-Stainless-Runtime-Version": "140.0.0",
    "X-Stainless-Retry-Count": "0",
    "X-Stainless-Timeout": "600",
}


def formula_png(text: str = "x^2 + 1", size=(220, 48), fmt: str = "PNG") -> bytes:
    """A small picture with dark text on white, in the given format (MPO: a phone's JPEG
    of two pictures, the second a copy)."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((12, 16), text, fill="black")
    buffer = io.BytesIO()
    image.save(
        buffer, format=fmt, **({"save_all": True, "append_images": [image]} if fmt == "MPO" else {})
    )
    return buffer.getvalue()


def wait_for(condition, timeout: float = 30.0) -> None:
    """Poll `condition` until true; a server that refuses or resets a connection meanwhile
    (starting, or a process of it dying) counts as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError("condition not met in time")
