"""The profile in force (``--profile PATH``): read at start, re-read whenever the file changes.

In Kubernetes the profile is a ConfigMap mounted as a directory. The kubelet never rewrites the
file in place: it writes the new version to a fresh timestamped directory and swaps the
``..data`` symlink that ``profile.json`` points through. So a change is noticed by polling
``os.stat`` of the path (which follows the links) for a new inode, size, mtime or ctime; that
catches the swap as well as plain in-place edits. A profile that cannot be used is refused at
start (ProfileError, the coordinator exits with the message); at a reload the old one stays in
force and a warning says why.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from specbatch.protocol.profile import Profile, ProfileError, load_profile

log = logging.getLogger(__name__)


class ProfileFile:
    def __init__(self, path: str | Path, poll_seconds: float = 2.0):
        self.path = Path(path)
        self.poll_seconds = poll_seconds
        self.signature = self._signature()
        self.profile: Profile = load_profile(self.path)  # refused at start: the caller exits
        self.reloads = 0
        self.last_error: str | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def _signature(self) -> tuple:
        try:
            st = os.stat(self.path)
        except OSError as error:
            raise ProfileError(f"profile {self.path}: cannot read it: {error.strerror or error}") from None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def check(self) -> bool:
        """Reload if the file changed; True when a new profile is now in force."""
        try:
            signature = self._signature()
        except ProfileError as error:
            self._refuse(str(error))
            return False
        if signature == self.signature:
            return False
        # Remembered before reading: a bad version is reported once, not at every poll.
        self.signature = signature
        try:
            profile = load_profile(self.path)
        except ProfileError as error:
            self._refuse(str(error))
            return False
        self.profile, self.last_error = profile, None
        self.reloads += 1
        log.info("profile %s reloaded (created %s, batch sizes %s, best k %s)", self.path, profile.created,
                 list(profile.batch_sizes), profile.best_k)
        return True

    def _refuse(self, message: str) -> None:
        if message != self.last_error:
            log.warning("%s; the profile loaded before stays in force (created %s)", message, self.profile.created)
        self.last_error = message

    def _poll(self) -> None:
        while not self._stopping.wait(self.poll_seconds):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad read
                log.exception("checking the profile failed")

    def start(self) -> "ProfileFile":
        self._thread = threading.Thread(target=self._poll, name="profile-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
