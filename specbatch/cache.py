"""Where specbatch keeps what it makes once and reuses: converted models, assembled drafts, built
kernels. ``$SPECBATCH_CACHE``, else ~/.cache/specbatch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECBATCH_CACHE", Path.home() / ".cache" / "specbatch"))
