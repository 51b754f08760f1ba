"""Progress of long jobs: a byte progress bar with rate and ETA on a terminal (tqdm), silent otherwise."""
from __future__ import annotations

import sys
import time


class Progress:
    """Counts bytes; draws a bar with rate and ETA when enabled (default: when stderr is a terminal)."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None):
        self.total, self.desc, self.done, self.t0 = total, desc, 0, time.time()
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.bar = None
        if self.enabled:
            from tqdm import tqdm
            # decimal units: tqdm labels its prefixes kB/MB/GB whatever the divisor, so 1024 would print MiB as MB
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> float:
        """Stop; returns the average rate in bytes/s."""
        dt = max(time.time() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.close()
        return self.done / dt
