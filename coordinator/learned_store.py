"""Where what a ``learn`` policy learned is kept (coordinator/learned.py): a profile file per
deployment under ``$SPECBATCH_PROFILES`` (``coordinator.fit.Deployment.learned_path``), written
while it serves and at stop, read by the next coordinator of the same deployment."""

from __future__ import annotations

import datetime
import logging
import os
import threading
from pathlib import Path

from specbatch.protocol.profile import Profile, ProfileError, load_profile

from .learned import Learning

log = logging.getLogger(__name__)


class Keeper:
    """Keeps what ``Learning`` policies learned in profile files under the cache, one per
    deployment (``coordinator.fit.Deployment.learned_path``): written every ``every`` seconds and
    at ``stop``, loaded by the next coordinator of the same deployment. ``profile`` is the first
    policy's latest snapshot, as ``Info`` serves it."""

    def __init__(self, every: float = 30.0):
        self.every = every
        self.kept: list[tuple[Learning, Path, dict]] = []  # (policy, file, what it describes)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="learned-profile", daemon=True)

    def add(self, policy: Learning, path, about: dict) -> Learning:
        self.kept.append((policy, Path(path), about))
        return policy

    @property
    def path(self) -> Path | None:
        return self.kept[0][1] if self.kept else None

    @staticmethod
    def _snapshot(policy: Learning, about: dict) -> Profile | None:
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return policy.snapshot(created=created, **about)

    @property
    def profile(self) -> Profile | None:
        return self._snapshot(self.kept[0][0], self.kept[0][2]) if self.kept else None

    def save(self) -> None:
        for policy, path, about in list(self.kept):
            profile = self._snapshot(policy, about)
            if profile is None:
                continue
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # (its own name: coordinators of one deployment on one host keep the same file)
                partial = path.with_suffix(f".{os.getpid()}-{id(self)}.partial")
                profile.save(partial)
                os.replace(partial, path)  # a reader never sees half a file
            except OSError as error:
                log.warning("cannot keep the learned profile in %s: %s", path, error)

    def _run(self) -> None:
        while not self.stopped.wait(self.every):
            self.save()

    def start(self) -> "Keeper":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.save()


def load_learned(path) -> Profile | None:
    """A profile learned before at ``path``, or None where there is none or it cannot be read."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return load_profile(path)
    except ProfileError as error:
        log.warning("ignoring the learned profile: %s", error)
        return None
