"""Imported once by the launcher's fork server (`app.launcher.CONTEXT`) before it forks
the engine and HTTP processes: the libraries they all import, so that no child pays for
them again and their pages are shared. Nothing here may start a thread or touch a
device, and the project's own modules stay out (their metrics would be made here)."""

import contextlib
import ctypes
import importlib
import signal

# Ctrl-C in a terminal reaches every process of the group: the fork server, still
# importing, would die of it, and the launcher with it as it waits for a child's start.
# Its children keep this (the engine ignores SIGINT anyway; an HTTP process's uvicorn sets
# its own handler), and the launcher alone decides when they stop.
signal.signal(signal.SIGINT, signal.SIG_IGN)

# Modules, or a module's attribute where the library loads it lazily on first use.
LIBRARIES = (
    "torch",
    "numpy",
    "PIL.Image",
    "transformers:AutoTokenizer",
    "transformers:VisionEncoderDecoderModel",
    "diffusers:DiffusionPipeline",
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "opentelemetry.sdk.trace",
)

for name in LIBRARIES:
    module, _, attribute = name.partition(":")
    with contextlib.suppress(ImportError):  # a child that needs it says so itself
        loaded = importlib.import_module(module)
        if attribute:
            getattr(loaded, attribute)

# Its name in ps and top (Linux), as `engine.process.name_process` names the children;
# that module is the project's own, so not imported here.
with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL(None).prctl(15, b"texel-fork", 0, 0, 0)  # PR_SET_NAME
