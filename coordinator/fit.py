"""Whether a profile describes the deployment the coordinator serves: the pair, the machine and
the weight form, as the services report them in CacheStats, against what the profile records.

A profile measured elsewhere prices steps wrongly (a GPU's Verify barely grows with k, a CPU's
does), so the coordinator says so at start-up and learns from what it serves instead
(coordinator/learned.py). A learned profile is kept per deployment under the cache, named by it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from specbatch.cache import learned_profiles
from specbatch.protocol.profile import Profile


@dataclass(frozen=True)
class Deployment:
    target_model: str
    draft_model: str  # "none": target-only
    hardware: dict = field(default_factory=dict)  # the target's (specbatch.engine.device.describe)
    target_weights: str = ""
    draft_weights: str = ""
    # The draft hosted in the target's process, drafting inside each Verify (--with-draft): a
    # speculative step is then one call, and costs less beside k = 0 than with a draft apart.
    draft_in_target: bool = False

    @classmethod
    def from_stats(cls, target, draft=None, draft_address: str = "", target_address: str = "") -> "Deployment":
        """From the target's and the draft's CacheStats replies (and the addresses they were asked
        at: one address, and a target that says it hosts a draft, is a draft in the target's process)."""
        hosted = (draft is not None and bool(target.hosted_draft) and bool(draft_address)
                  and draft_address == target_address)
        return cls(target.model, draft.model if draft is not None else "none", _json(target.hardware),
                   target.weights, draft.weights if draft is not None else "", hosted)

    def about(self) -> dict:
        """What a profile learned here records: ``Profile``'s hardware, target and draft."""
        return {"hardware": dict(self.hardware),
                "target": {"model": self.target_model, "weights": self.target_weights},
                "draft": {"model": self.draft_model, "weights": self.draft_weights, "in_target": self.draft_in_target}}

    def describe(self) -> str:
        where = self.hardware.get("name") or self.hardware.get("device") or "unknown hardware"
        return f"{self.target_model} ({self.target_weights}) with {self.draft_model} ({self.draft_weights}) on {where}"

    def learned_path(self) -> Path:
        """Where what the coordinator learns for this deployment is kept between starts."""
        key = json.dumps(self.about(), sort_keys=True)
        name = re.sub(r"[^a-z0-9]+", "-", f"{self.target_model}-{self.draft_model}".lower()).strip("-")[:60]
        return learned_profiles() / f"learned-{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def _json(text: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _name(hardware: dict) -> str | None:
    """The device's model as a profile records it: ``name`` (what the services report), else
    ``gpu`` on a GPU and ``cpu`` on a CPU (``specbatch profile``'s reading)."""
    if hardware.get("name"):
        return hardware["name"]
    return hardware.get("gpu") if str(hardware.get("device", "")).startswith("cuda") else hardware.get("cpu")


def mismatches(profile: Profile, deployment: Deployment, besides: tuple[str, ...] = ()) -> list[str]:
    """How ``profile`` differs from ``deployment``, in words; only what both sides record is
    compared (an older profile that names no weight form is not held against it), and nothing
    named in ``besides``."""
    found = []

    def compare(what: str, recorded, served) -> None:
        if what in besides:
            return
        if recorded not in (None, "") and served not in (None, "") and recorded != served:
            found.append(f"{what}: the profile's {recorded!r}, served {served!r}")

    compare("target", profile.target.get("model"), deployment.target_model)
    compare("draft", profile.draft.get("model"), deployment.draft_model)
    compare("target weights", profile.target.get("weights"), deployment.target_weights)
    compare("draft weights", profile.draft.get("weights"), deployment.draft_weights)
    if deployment.draft_model != "none":
        compare("draft in the target's process", profile.draft.get("in_target"), deployment.draft_in_target)
    device = lambda hardware: str(hardware.get("device", "")).split(":")[0] or None  # noqa: E731
    compare("device", device(profile.hardware), device(deployment.hardware))
    compare("hardware", _name(profile.hardware), _name(deployment.hardware))
    for key in ("cpu_capability", "native_bf16"):
        compare(key, profile.hardware.get(key), deployment.hardware.get(key))
    return found
