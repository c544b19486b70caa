"""The node plugin's state files, and its recovery of the published targets after a restart.

One JSON file per published target under ``KUBELET_DIR/plugins/csi.objfs.dev/state/``, named
by 16 hex of sha256(target), mode 0600, replaced whole: the volume id, target, pod uid,
source, options, the volume attributes that give the volume again (``context``: with the
pod's namespace, service account and ``node-cache``), the pod's objfs-fd directory and the
offer socket's name. No credential:
the volume attributes carry none.

After a restart, :func:`recover` finds the published targets from the state files and the
kernel's mount table and binds their sockets anew (the publications start UNKNOWN: a sidecar
that still serves carries on; a mount whose fd died with the old process is replaced when a
sidecar connects); the state and socket files of targets no longer mounted are removed. A
fuse.objfs mount under the kubelet directory without a state file is only reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

from objfs.csi.fusemount import FSTYPE, mounted, mounts_below
from objfs.csi.offers import Offers
from objfs.csi.publication import CsiError, Publication, State
from objfs.csi.volume import POD_UID_KEY, VolumeContextError, parse_volume_context

log = logging.getLogger("objfs.csi")


def record(pub: Publication) -> dict[str, Any]:
    """What the state file of ``pub`` holds."""
    return {
        "volume_id": pub.volume_id,
        "target_path": pub.target,
        "pod_uid": pub.spec.pod_uid,
        "source": pub.spec.source,
        "options": dict(pub.spec.options),
        "context": pub.spec.context(),
        "fd_dir": pub.fd_dir,
        "socket": pub.sock_name,
    }


class StateFiles:
    """The state files in ``state_dir`` (made on the first save, mode 0700)."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir

    def path(self, target: str) -> str:
        digest = hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return os.path.join(self.state_dir, f"{digest}.json")

    def save(self, pub: Publication) -> None:
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        path = self.path(pub.target)
        temporary = path + ".tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record(pub), f)
        os.replace(temporary, path)

    def remove(self, target: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(target))


def recover_publications(
    files: StateFiles, offers: Offers, kubelet_dir: str, found: dict[str, Publication]
) -> None:
    """After a restart: listen again for the targets still mounted, forget the others. Each
    publication found goes into ``found`` (by target) before its offer thread starts, so one
    that started is known to the node (its shutdown stops it) even if a later one fails."""
    state_dir = files.state_dir
    names = sorted(os.listdir(state_dir)) if os.path.isdir(state_dir) else []
    for name in names:
        path = os.path.join(state_dir, name)
        if not name.endswith(".json"):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            target = str(saved["target_path"])
            context = dict(saved.get("context") or {})
            if not context:  # written by an objfs before the node cache
                context = {**saved["options"], "source": saved["source"]}
                context[POD_UID_KEY] = saved["pod_uid"]
            spec = parse_volume_context(context, target)
        except (OSError, ValueError, KeyError, TypeError, VolumeContextError) as exc:
            log.warning("ignoring state file %s: %s", path, exc)
            continue
        info = mounted(target)
        if info is None or info.fstype != FSTYPE:
            log.info("%s is no longer mounted: forgetting it", target)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(str(saved["fd_dir"]), str(saved["socket"])))
            files.remove(target)
            continue
        pub = Publication(
            volume_id=str(saved["volume_id"]),
            target=target,
            spec=spec,
            config=dataclasses.replace(spec.config, mountpoint=target),
            fd_dir=str(saved["fd_dir"]),
            sock_name=str(saved["socket"]),
            state=State.UNKNOWN,
        )
        try:
            offers.listen(pub)
        except CsiError as exc:
            log.warning("%s stays mounted, without a sidecar socket: %s", target, exc)
        found[target] = pub
        if pub.listener is not None:
            offers.start_thread(pub)
        log.info("found %s published on %s; listening for its sidecar", pub.volume_id, target)
    for target in mounts_below(kubelet_dir):
        if target not in found:
            log.warning(
                "%s is a %s mount without a state file: NodeUnpublishVolume will remove it",
                target,
                FSTYPE,
            )
