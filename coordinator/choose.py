"""Which k policy the coordinator serves with (docs/speculation.md): the one asked for, over its
profile where that profile describes this deployment (for ``goodput:live``, which prices steps as
served, also one measured on another model of the same device and vector unit); where it
describes another (another pair, another machine, another weight form), or none is given,
``learn``, which measures its own
(coordinator/learned.py) and starts from what it learned here before, else from the profile
given where that one fits."""

from __future__ import annotations

import logging

import grpc

from specbatch.config.options import K_POLICIES

from .fit import Deployment, mismatches
from .learned import Learning
from .learned_store import Keeper, load_learned
from .policy import FixedK, Goodput, PerReplica, ProfileK
from .profile_file import ProfileFile

log = logging.getLogger(__name__)


def parse_policy(text: str, max_k: int, profile_file: ProfileFile | None = None, max_leaves: int = 0,
                 max_batch_size: int = 32, seed=None):
    """The policy ``text`` names (``K_POLICIES``). ``seed``: for ``learn``, a profile it learned
    before for this deployment."""
    kind, _, arg = text.partition(":")
    if kind == "fixed":
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"fixed policy needs an integer k, as in fixed:3 (got {text!r})") from None
        if not 0 <= k <= max_k:
            raise ValueError(f"k must be in [0, {max_k}] (got {k})")
        return FixedK(k)
    if text == "learn":
        return Learning(max_k, max_batch_size, max_leaves, seed=seed)
    if (kind == "profile" and not arg) or (kind == "goodput" and arg in ("", "live")):
        if profile_file is None:
            raise ValueError(f"the {kind} policy needs a profile: pass --profile PATH (made by `specbatch profile`), "
                             "or use learn")
        if kind == "profile":
            return ProfileK(profile_file)
        return Goodput(profile_file, max_k, max_leaves=max_leaves, live_times=arg == "live")
    raise ValueError(f"unknown k policy {text!r}; known: {K_POLICIES}")


def fit_policy(policy, profile_file: ProfileFile | None, deployment: Deployment, max_k: int, max_leaves: int,
               max_batch_size: int):
    """``policy`` where its profile fits ``deployment`` (``goodput:live``: or differs in the hardware's
    model alone); else (said in the log) ``learn``, seeded
    with what was learned for this deployment before, if anything. ``learn`` asked for is seeded
    so too, else with its profile where that fits (what it serves then corrects the profile's
    prices: a profile measured without the services' own overheads prices steps too cheap)."""
    if isinstance(policy, Learning):
        seed = load_learned(deployment.learned_path())
        if seed is not None and mismatches(seed, deployment):
            seed = None  # (a file of the same name from another deployment: never trusted)
        if seed is not None:
            log.info("learn: starting from what was learned before for %s (%s)", deployment.describe(),
                     deployment.learned_path())
        elif profile_file is not None and not mismatches(profile_file.profile, deployment):
            seed = profile_file.profile
            log.info("learn: starting from the profile %s", profile_file.path)
        return Learning(max_k, max_batch_size, max_leaves, seed=seed) if seed is not None else policy
    if profile_file is None or isinstance(policy, FixedK):
        return policy
    problems = mismatches(profile_file.profile, deployment)
    if not problems:
        return policy
    if getattr(policy, "live_times", False) and not mismatches(profile_file.profile, deployment, besides=("hardware",)):
        # Another model of the same device and vector unit: the pair's acceptance and the shape of
        # its step times hold, and goodput:live corrects their level as steps are served (a better
        # start than learn's k = 0: docs/decisions/goodput-live.md).
        log.info("goodput:live over the profile %s, measured on other hardware than %s (%s): its step times are "
                 "corrected as served", profile_file.path, deployment.describe(), "; ".join(problems))
        return policy
    log.warning("the profile %s was measured for another deployment than %s (%s): learning step times and "
                "acceptance from what is served instead (k policy learn)", profile_file.path, deployment.describe(),
                "; ".join(problems))
    return fit_policy(Learning(max_k, max_batch_size, max_leaves), None, deployment, max_k, max_leaves, max_batch_size)


def learning_per_replica(policy: Learning, first_replica, deployment: Deployment, draft_stats, keeper: Keeper,
                         max_k: int, max_leaves: int, max_batch_size: int,
                         profile_file: ProfileFile | None = None) -> PerReplica:
    """``learn`` for a fleet: each target replica learns its own step times (and is seeded with
    what was learned before for its deployment, else with ``profile_file`` where it fits that
    replica), ``policy`` being the first replica's. Every one is kept by ``keeper``."""
    keeper.add(policy, deployment.learned_path(), deployment.about())

    def make(replica):
        own = deployment
        if replica is not None:
            try:  # (once a replica: its CacheStats says what it runs on)
                own = Deployment.from_stats(replica.client.cache_stats(), draft_stats)
            except grpc.RpcError as error:
                log.warning("learn: no CacheStats from %s (%s); priced as %s", replica.address, error.code().name,
                            deployment.describe())
        learning = fit_policy(Learning(max_k, max_batch_size, max_leaves), profile_file, own, max_k, max_leaves,
                              max_batch_size)
        return keeper.add(learning, own.learned_path(), own.about())

    per_replica = PerReplica(make)
    per_replica.policies[first_replica] = policy
    return per_replica
