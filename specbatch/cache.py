"""Where specbatch keeps what it makes once and reuses: converted models, assembled drafts, built
kernels, learned profiles. ``$SPECBATCH_CACHE``, else ~/.cache/specbatch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECBATCH_CACHE", Path.home() / ".cache" / "specbatch"))


def learned_profiles() -> Path:
    """Where a coordinator keeps the profiles it learns (coordinator/learned.py), one per
    deployment: ``$SPECBATCH_PROFILES``, else ``profiles`` in the cache (in Kubernetes, a volume
    that outlives the pod keeps them across restarts)."""
    return Path(os.environ.get("SPECBATCH_PROFILES", cache_root() / "profiles"))
