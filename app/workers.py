"""Set-up of Texel's worker processes (kept free of heavy imports: each worker imports it)."""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Process-pool initializer: end this worker once the serving process is gone.

    A pool's workers notice an orderly shutdown, but not a parent killed outright
    (SIGKILL, OOM killer); they would live on, orphaned.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="texel-parent-watch", daemon=True).start()
