"""Texel's telemetry: tracing set-up, metric definitions and logging.

The rest of the code uses these helpers, never the SDKs directly.
"""

from telemetry import metrics
from telemetry.logs import setup_logging
from telemetry.tracing import (
    BatchTelemetry,
    RequestTrace,
    add_span_processor,
    current_trace_id,
    setup_tracing,
    shutdown_tracing,
)

__all__ = [
    "BatchTelemetry",
    "RequestTrace",
    "add_span_processor",
    "current_trace_id",
    "metrics",
    "setup_logging",
    "setup_tracing",
    "shutdown_tracing",
]
