"""Texel's model-agnostic dynamic batcher.

It knows nothing of HTTP or of any model: callers submit payloads with a bucket
key, workers run lists of payloads on a thread each. See `Batcher` for the request path and
`BucketQueue` for the policy.
"""

from batching.batcher import (
    Batcher,
    BatchObserver,
    BatchResult,
    BatchRunner,
    ComputeThread,
    Worker,
)
from batching.errors import (
    CUT_OFF,
    BatchFailed,
    BatchingError,
    Cancelled,
    DeadlineExceeded,
    Draining,
    OutOfMemory,
    QueueFull,
    cut_off,
)
from batching.queue import BatchPlan, BatchPolicy, BucketQueue, DrainRate, Pending

__all__ = [
    "BatchFailed",
    "BatchObserver",
    "BatchPlan",
    "BatchPolicy",
    "BatchResult",
    "BatchRunner",
    "Batcher",
    "BatchingError",
    "BucketQueue",
    "CUT_OFF",
    "Cancelled",
    "ComputeThread",
    "DeadlineExceeded",
    "DrainRate",
    "Draining",
    "OutOfMemory",
    "Pending",
    "QueueFull",
    "Worker",
    "cut_off",
]
