"""The CSI node plugin: Identity and Node services, mounts, and the offers to the sidecars.

What NodePublishVolume does (idempotent under kubelet retries):

1. checks the request and the volume attributes (:mod:`objfs.csi.volume`); the target must
   lie under ``KUBELET_DIR/pods/POD_UID/volumes/`` of the pod named in the attributes (its
   parent resolved, the target itself never stat-ed) and the pod must have an emptyDir named
   ``objfs-fd``
   (``KUBELET_DIR/pods/POD_UID/volumes/kubernetes.io~empty-dir/objfs-fd/``). Refused with
   INVALID_ARGUMENT: block volumes, CSI secrets (``nodePublishSecretRef``: credentials are the
   sidecar's), mount flags other than ro, nosuid, nodev, noatime (the PV's ``mountOptions``).
   Any access mode is accepted and ``readonly`` is not needed: the mount is always read-only;
2. opens ``/dev/fuse`` and mounts the target read-only with ``fd=N``
   (:func:`objfs.csi.fusemount.mount_fd`);
3. listens on ``<volume id>-<8 hex of sha256(target)>.sock`` in that emptyDir (mode 0666:
   the directory is private to the pod and the sidecar runs as any uid) and writes a small
   JSON state file under ``KUBELET_DIR/plugins/csi.objfs.dev/state/``;
4. returns without waiting for the sidecar. Until a sidecar takes the fd, file operations on
   the mount wait in the kernel (a reader blocks; it is not an error), for at most
   :data:`SIDECAR_WAIT_LIMIT_S` (10 minutes; the environment variable
   ``OBJFS_CSI_SIDECAR_WAIT_S`` overrides it, in seconds): a mount that no sidecar has
   answered ``ok`` for by then (none came, or each answered an error such as bad credentials)
   is marked dead and the node plugin closes its fd, so the waiting operations, and any host
   tool that stats the target (df, node-exporter), fail with ENOTCONN instead of blocking for
   good. The next sidecar that connects gets a fresh mount, as after a sidecar restart.

A thread per published target then offers the fd to each sidecar that connects
(:func:`objfs.fdpass.send_offer`). When the sidecar answers ``ok``, the node plugin closes its
own copy: from then on the sidecar holds the only one, so if the sidecar dies the kernel ends
the FUSE connection and readers get ENOTCONN (never a hang, never wrong bytes). The sidecar
keeps its connection open while it serves; end of file on it marks the mount dead. When a
sidecar connects to the socket of a dead mount (a restarted sidecar), the node plugin replaces
the mount: it mounts a fresh ``/dev/fuse`` fd on the same target *on top of* the dead mount,
which stays beneath it, and offers that, so the volume serves again without a new publish.
Stacking, not detach-then-mount: a container sees the target through its own copy, a slave of
the target's mount (``mountPropagation: HostToContainer``), which receives a mount made on top
of the dead one but neither a detach of it nor a mount made afterwards on the bare directory.
So containers with that propagation see the new mount; others keep the dead one until the pod
restarts. A target thus holds one dead mount per sidecar restart (or sidecar gone without
answering), all beneath the live one and all removed at unpublish. As any process in the pod
may connect to the socket (and leave without answering), replacements are bounded: at most
:data:`MAX_REPLACEMENTS` per target (counted in mountinfo), spent from a bucket of
:data:`REPLACE_BURST` that gains one every :data:`REPLACE_INTERVAL_S`; a connection beyond
those is closed without an offer, and each refusal is logged once. "mounted", the device number
(kernel tuning) and restart recovery read the topmost one from mountinfo
(:func:`objfs.csi.fusemount.mounted`). A sidecar that answers an error, or
nothing within :data:`OFFER_REPLY_TIMEOUT_S`, is dropped. After an error answer, or an offer
that could not be sent (the sidecar was gone before it), the fd is kept for the next one; after
none (the sidecar died or went silent with the fd in hand, and its
server may have read requests nobody will answer) the node plugin closes its copy, so the
kernel ends that connection instead of leaving those readers blocked, and the next sidecar gets
a fresh mount on top, as after a restart.

NodeUnpublishVolume stops the target's thread, removes its socket and state file, detaches
every objfs mount stacked on the target (``MNT_DETACH``, topmost first, until mountinfo shows
none there, at most :data:`objfs.csi.fusemount.MAX_STACKED`: never waits for a sidecar) and
removes the target directory; it answers OK for a target that is not mounted or not known,
INVALID_ARGUMENT for one outside ``--kubelet-dir``, and FAILED_PRECONDITION while any mount
remains at the target (one objfs did not make on top, or objfs mounts past that bound): never
OK with a mount left, so the kubelet retries instead of taking the volume for gone.

Invariants: the node plugin never stats, opens or resolves a path inside a mount it made (see
:mod:`objfs.csi.fusemount`); nothing waits on a sidecar without a timeout or a way to be woken
(unpublish and shutdown close the connection); no credential reaches a log, a state file or an
offer (the volume attributes carry none, and the kubelet's service account tokens are dropped);
every mount is made under the kubelet directory only, and nothing in a pod's objfs-fd
directory is followed as a symlink. On SIGTERM/SIGINT the plugin stops serving gRPC and exits 0,
leaving mounts, state files and socket files in place: pods still use the mounts, and a sidecar
reads a removed socket file as an unpublished volume. After a restart it finds its published
targets from the state files and the kernel's mount table and binds their sockets anew; a
sidecar that still serves carries on, a mount whose fd died with the old process (no sidecar had
taken it) is dead and is replaced when a sidecar connects, and NodeUnpublishVolume works as
usual. A fuse.objfs mount under the kubelet directory without a state file is only reported;
NodeUnpublishVolume still removes it, and a NodePublishVolume of that target (in the pod's
volumes) detaches it and publishes afresh (an orphan: a crash between the mount and its state
file, or a wiped state directory). Another file system on the target is ALREADY_EXISTS.

Kernel tuning (read-ahead, the FUSE queue; :func:`objfs.mount.tune_kernel`) is the node
plugin's job, as the sidecar may not write sysfs. It runs once the sidecar answers ``ok``, and
again during :data:`_RETUNE_S` if the kernel lowered the read-ahead on reading the answer to its
INIT request, which may come just after the ``ok``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import signal
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import grpc

from objfs import __version__, fdpass
from objfs.config import MountConfig
from objfs.csi import DRIVER_NAME, proto
from objfs.csi.fusemount import (
    FSTYPE,
    MountInfo,
    close_quietly,
    detach,
    detach_all,
    mount_fd,
    mounted,
    mounts_below,
    open_fuse_device,
    real_target,
    stacked,
)
from objfs.csi.volume import (
    POD_UID_KEY,
    VolumeContextError,
    VolumeSpec,
    parse_volume_context,
)
from objfs.errors import UsageError
from objfs.mount import setup_logging, tune_kernel

log = logging.getLogger("objfs.csi")

#: How long a sidecar has to answer an offer before the node plugin drops the connection.
OFFER_REPLY_TIMEOUT_S = 60.0
#: How long a mount may wait for a sidecar's ``ok`` (no sidecar, or one that keeps answering
#: ``error``) before the node plugin closes its fd and marks it dead: until then any process
#: on the node that stats the target (df, node-exporter) blocks in the kernel. The
#: environment variable :data:`WAIT_LIMIT_ENV` overrides it (seconds; for tests).
SIDECAR_WAIT_LIMIT_S = 600.0
WAIT_LIMIT_ENV = "OBJFS_CSI_SIDECAR_WAIT_S"
#: At most this many replacements per target, so at most 1 + this objfs mounts stacked there
#: (counted in mountinfo): each connection to the 0666 offer socket that finds the mount dead
#: stacks one, beneath the live one until NodeUnpublishVolume, in the host's mount table and
#: in every container's with HostToContainer propagation. 32 sidecar deaths in one pod's life
#: mean a broken pod (a sidecar OOM-killed at every start), not one worth more mounts.
MAX_REPLACEMENTS = 32
#: Replacements spend tokens from a bucket of this many: a sidecar restart and an abandoned
#: offer or two in quick succession all go through at once.
REPLACE_BURST = 4
#: The bucket gains one token per this many seconds (:data:`REPLACE_INTERVAL_ENV` overrides
#: it; for tests): the kubelet restarts a crash-looping sidecar 10, 20, 40 s... apart, which
#: never empties the bucket, while a pod looping connect/close on its socket gets
#: :data:`REPLACE_BURST` mounts at once, then one per half minute, up to the cap.
REPLACE_INTERVAL_S = 30.0
REPLACE_INTERVAL_ENV = "OBJFS_CSI_REPLACE_INTERVAL_S"
#: How often blocking socket calls wake up to see whether the target is being unpublished.
_POLL_S = 0.5
#: How often the main thread wakes up to run a signal handler the kernel's delivery to
#: another thread left pending (see run_csi).
_SIGNAL_POLL_S = 0.5
#: After the sidecar's ``ok``, how long the read-ahead is watched: the kernel lowers it when it
#: reads the answer to its INIT request, which may come just after the ``ok``.
_RETUNE_S = 5.0
_JOIN_TIMEOUT_S = 10.0
FD_VOLUME = "objfs-fd"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class CsiError(Exception):
    """A request fails with this gRPC status code; ``str()`` is the one-line message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def socket_name(volume_id: str, target: str) -> str:
    """``<volume id, made safe, at most 40 chars>-<8 hex of sha256(target)>.sock``."""
    digest = hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"{_SAFE_NAME.sub('_', volume_id)[:40]}-{digest}.sock"


@dataclass
class Publication:
    """One published target: its mount, the fd while the node plugin holds it, the offers."""

    volume_id: str
    target: str
    spec: VolumeSpec
    config: MountConfig
    fd_dir: str
    sock_name: str
    fd: int = -1
    #: "waiting" (fd held, no sidecar yet), "served", "dead" (sidecar gone) or "unknown"
    #: (found after a restart of the node plugin)
    state: str = "waiting"
    #: time.monotonic() when the current mount started waiting for a sidecar's ``ok``
    waiting_since: float = 0.0
    listener: socket.socket | None = None
    dir_fd: int = -1
    thread: threading.Thread | None = None
    active: socket.socket | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The replacement bucket (:data:`REPLACE_BURST`): tokens left, and when last counted.
    tokens: float = REPLACE_BURST
    tokens_at: float = field(default_factory=time.monotonic)
    #: Why the last replacement was refused ("rate" or "cap"; "" once one went through), so
    #: a refusal is logged once, not once per connection.
    refused: str = ""

    def payload(self) -> dict[str, Any]:
        return {
            "source": self.spec.source,
            "options": dict(self.spec.options),
            "volume_id": self.volume_id,
            "target_path": self.target,
        }

    def saved(self) -> dict[str, Any]:
        return {
            "volume_id": self.volume_id,
            "target_path": self.target,
            "pod_uid": self.spec.pod_uid,
            "source": self.spec.source,
            "options": dict(self.spec.options),
            "fd_dir": self.fd_dir,
            "socket": self.sock_name,
        }


class Node:
    """The node plugin's state: published targets by real path, and what serves them."""

    def __init__(self, node_id: str, kubelet_dir: str) -> None:
        self.node_id = node_id
        self.kubelet_dir = os.path.realpath(kubelet_dir)
        self.state_dir = os.path.join(self.kubelet_dir, "plugins", DRIVER_NAME, "state")
        self._publications: dict[str, Publication] = {}
        self._lock = threading.Lock()
        self.wait_limit_s = _seconds_from_env(WAIT_LIMIT_ENV, SIDECAR_WAIT_LIMIT_S)
        self.replace_interval_s = _seconds_from_env(REPLACE_INTERVAL_ENV, REPLACE_INTERVAL_S)

    # -- Identity ----------------------------------------------------------------------------

    def get_plugin_info(self, request: Any) -> Any:
        return proto.message_class("GetPluginInfoResponse")(
            name=DRIVER_NAME, vendor_version=__version__
        )

    def get_plugin_capabilities(self, request: Any) -> Any:
        # Node service only: no controller (nothing to provision or attach) and every node can
        # reach the store, so no accessibility constraints.
        return proto.message_class("GetPluginCapabilitiesResponse")()

    def probe(self, request: Any) -> Any:
        return proto.message_class("ProbeResponse")(ready={"value": True})

    # -- Node --------------------------------------------------------------------------------

    def get_info(self, request: Any) -> Any:
        return proto.message_class("NodeGetInfoResponse")(node_id=self.node_id)

    def get_capabilities(self, request: Any) -> Any:
        # No STAGE_UNSTAGE_VOLUME: every target gets its own mount and its own sidecar.
        return proto.message_class("NodeGetCapabilitiesResponse")()

    def publish(self, request: Any) -> Any:
        volume_id = request.volume_id
        if not volume_id:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is missing")
        target = self._check_target(request.target_path)
        self._check_capability(request)
        if len(request.secrets):
            raise CsiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "objfs takes no CSI secrets (nodePublishSecretRef): credentials belong to the "
                "objfs sidecar (its service account identity, or a Secret mounted into it and "
                "the credentials-file attribute)",
            )
        try:
            spec = parse_volume_context(dict(request.volume_context), target)
        except VolumeContextError as exc:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self._check_pod_target(target, spec.pod_uid)

        with self._lock:
            existing = self._publications.get(target)
            if existing is not None and _objfs_mount(target) is None:
                # Unmounted behind the plugin's back (by hand, or a node cleanup): start over.
                log.warning("%s is no longer mounted: publishing it again", target)
                self._publications.pop(target)
                self._stop(existing)
                close_quietly(existing.fd)
                existing = None
            if existing is not None:
                if (
                    existing.volume_id == volume_id
                    and existing.spec.identity() == spec.identity()
                    and existing.spec.pod_uid == spec.pod_uid
                ):
                    log.debug("%s is already published on %s", volume_id, target)
                    return proto.message_class("NodePublishVolumeResponse")()
                raise CsiError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"{target} is already published with another volume or other attributes "
                    f"(volume {existing.volume_id}): unpublish it first",
                )
            info = mounted(target)
            if info is not None and info.fstype == FSTYPE:
                # An orphan: mounted by this plugin before a crash that came before its state
                # file, or its state directory was wiped. Nothing serves it for this publish
                # (the target is in this pod's volumes, checked above): removed, then published.
                log.warning(
                    "%s holds a %s mount this plugin did not record: removing it",
                    target,
                    FSTYPE,
                )
                _detach_objfs_stack(target)
            if mounted(target) is not None:
                raise CsiError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"{target} is already a mount point that objfs did not publish",
                )
            fd_dir = os.path.join(
                self.kubelet_dir,
                "pods",
                spec.pod_uid,
                "volumes",
                "kubernetes.io~empty-dir",
                FD_VOLUME,
            )
            if not os.path.isdir(fd_dir):
                raise CsiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the pod has no emptyDir volume named {FD_VOLUME} (or the kubelet has not "
                    f"set it up yet): add it and the objfs sidecar (see the README's "
                    f"Kubernetes section); looked in {fd_dir}",
                )
            config = dataclasses.replace(spec.config, mountpoint=target)
            pub = Publication(
                volume_id=volume_id,
                target=target,
                spec=spec,
                config=config,
                fd_dir=fd_dir,
                sock_name=socket_name(volume_id, target),
            )
            self._mount_new(pub, make_target=True)
            try:
                self._listen(pub)
                self._save(pub)
            except BaseException:
                self._stop(pub)
                with contextlib.suppress(OSError):
                    detach(target)
                close_quietly(pub.fd)
                self._remove_saved(target)
                raise
            self._publications[target] = pub
            self._start_thread(pub)
        log.info(
            "published %s (%s) on %s; offering it on %s",
            volume_id,
            spec.fsname,
            target,
            os.path.join(fd_dir, pub.sock_name),
        )
        return proto.message_class("NodePublishVolumeResponse")()

    def unpublish(self, request: Any) -> Any:
        if not request.volume_id:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is missing")
        # Only under the kubelet directory: nothing else is ever unmounted or removed.
        target = self._check_target(request.target_path)
        with self._lock:
            pub = self._publications.pop(target, None)
            if pub is not None:
                self._stop(pub)
                close_quietly(pub.fd)
                pub.fd = -1
            # Every mount stacked there: the first one and one per sidecar takeover.
            count = _detach_objfs_stack(target)
            self._remove_saved(target)
            left = mounted(target)
            if left is not None:
                # Never OK with a mount left: the kubelet would take the volume for gone.
                raise CsiError(
                    grpc.StatusCode.FAILED_PRECONDITION, _left_message(target, left, count)
                )
            try:
                os.rmdir(target)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("leaving %s in place: %s", target, exc.strerror)
        if pub is not None or count:
            log.info("unpublished %s from %s", request.volume_id, target)
        return proto.message_class("NodeUnpublishVolumeResponse")()

    # -- checks ------------------------------------------------------------------------------

    def _check_target(self, target_path: str) -> str:
        if not target_path:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "target_path is missing")
        if not os.path.isabs(target_path) or os.path.normpath(target_path) != target_path:
            raise CsiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"target_path {target_path!r} is not a normalized absolute path",
            )
        target = real_target(target_path)
        if not target.startswith(self.kubelet_dir + os.sep):
            raise CsiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"target_path {target_path} is outside the kubelet directory "
                f"{self.kubelet_dir}: check --kubelet-dir",
            )
        return target

    def _pod_volumes_dir(self, pod_uid: str) -> str:
        return os.path.join(self.kubelet_dir, "pods", pod_uid, "volumes")

    def _check_pod_target(self, target: str, pod_uid: str) -> None:
        """The target (a real path) must lie in the volumes of the pod the offer goes to: the
        sidecar of the pod named in the volume attributes gets the mount, so a target of
        another pod (or outside any pod) would hand that pod's sidecar a mount elsewhere."""
        if not target.startswith(self._pod_volumes_dir(pod_uid) + os.sep):
            raise CsiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"target_path {target} is not under the volumes of pod {pod_uid} "
                f"({self._pod_volumes_dir(pod_uid)})",
            )

    @staticmethod
    def _check_capability(request: Any) -> None:
        if not request.HasField("volume_capability"):
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_capability is missing")
        capability = request.volume_capability
        if capability.WhichOneof("access_type") == "block":
            raise CsiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "objfs volumes are file systems, not block devices: use volumeMode: Filesystem",
            )
        # mount_flags may hold secrets (CSI spec): checked, never echoed.
        allowed = {"ro", "nosuid", "nodev", "noatime"}
        if any(flag not in allowed for flag in capability.mount.mount_flags):
            raise CsiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "objfs takes no mountOptions other than ro, nosuid, nodev, noatime (it always "
                "mounts read-only): give objfs options as volume attributes",
            )

    # -- mounts and offers -------------------------------------------------------------------

    def _mount_new(self, pub: Publication, *, make_target: bool) -> None:
        """A fresh FUSE connection mounted on the target; the fd goes to ``pub.fd``."""
        if make_target:
            os.makedirs(os.path.dirname(pub.target), exist_ok=True)
            with contextlib.suppress(FileExistsError):
                # Not makedirs(exist_ok=True) on the target: it would stat a possible mount.
                os.mkdir(pub.target, 0o755)
        try:
            fd = open_fuse_device()
        except OSError as exc:
            raise CsiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot open /dev/fuse ({exc.strerror}): the node plugin needs the host's "
                "/dev/fuse and to run privileged",
            ) from None
        try:
            mount_fd(fd, pub.target, pub.spec.fsname)
        except OSError as exc:
            close_quietly(fd)
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if exc.errno in (errno.EPERM, errno.EACCES)
                else grpc.StatusCode.INTERNAL
            )
            hint = ""
            if exc.errno == errno.EPERM:
                hint = ": the node plugin needs CAP_SYS_ADMIN (privileged)"
            raise CsiError(code, f"mounting {pub.target} failed: {exc.strerror}{hint}") from None
        pub.fd = fd
        pub.state = "waiting"
        pub.waiting_since = time.monotonic()

    def _listen(self, pub: Publication) -> None:
        """Binds the offer socket in the pod's objfs-fd directory (through a directory fd:
        kubelet paths are longer than a socket address may be)."""
        try:
            dir_fd = os.open(
                pub.fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError as exc:
            raise CsiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot open the pod's {FD_VOLUME} directory {pub.fd_dir}: {exc.strerror}",
            ) from None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pub.sock_name, dir_fd=dir_fd)
            listener.bind(f"/proc/self/fd/{dir_fd}/{pub.sock_name}")
            _make_connectable(dir_fd, pub.sock_name)
            listener.listen(8)
            listener.settimeout(_POLL_S)
        except OSError as exc:
            listener.close()
            os.close(dir_fd)
            raise CsiError(
                grpc.StatusCode.INTERNAL,
                f"cannot listen on {os.path.join(pub.fd_dir, pub.sock_name)}: {exc.strerror}",
            ) from None
        pub.listener, pub.dir_fd = listener, dir_fd

    def _start_thread(self, pub: Publication) -> None:
        pub.thread = threading.Thread(
            target=self._serve_offers, args=(pub,), name=f"offer {pub.volume_id}", daemon=True
        )
        pub.thread.start()

    def _stop(self, pub: Publication, *, remove_socket: bool = True) -> None:
        """Stops the target's thread (waking it from any wait) and closes its socket."""
        with pub.lock:
            pub.stop.set()
            if pub.active is not None:
                with contextlib.suppress(OSError):
                    pub.active.shutdown(socket.SHUT_RDWR)
        if pub.thread is not None:
            pub.thread.join(_JOIN_TIMEOUT_S)
            if pub.thread.is_alive():
                log.warning("the offer thread of %s did not stop in time", pub.target)
        if pub.listener is not None:
            pub.listener.close()
            pub.listener = None
        if pub.dir_fd >= 0:
            if remove_socket:
                with contextlib.suppress(OSError):
                    os.unlink(pub.sock_name, dir_fd=pub.dir_fd)
            os.close(pub.dir_fd)
            pub.dir_fd = -1

    def _serve_offers(self, pub: Publication) -> None:
        """The target's thread: one sidecar connection at a time, until unpublish or stop."""
        listener = pub.listener
        assert listener is not None
        while not pub.stop.is_set():
            self._expire_waiting(pub)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if pub.stop.is_set():
                    break
                log.warning("offer socket of %s: %s", pub.target, exc.strerror)
                pub.stop.wait(_POLL_S)
                continue
            with pub.lock:
                if pub.stop.is_set():
                    conn.close()
                    break
                pub.active = conn
            try:
                self._offer(pub, conn)
            except Exception as exc:  # one bad sidecar must not end the thread
                log.warning("offering %s failed: %s", pub.target, exc)
            finally:
                with pub.lock:
                    pub.active = None
                conn.close()

    def _expire_waiting(self, pub: Publication) -> None:
        """Marks the mount dead once it waited :attr:`wait_limit_s` for a sidecar's ``ok``.

        Until a server reads its INIT request, every stat of the target (df, node-exporter on
        the host) blocks in the kernel. Closing the node plugin's copy of the fd ends the FUSE
        connection (if no sidecar holds one), so those fail with ENOTCONN instead; the next
        sidecar that connects gets a fresh mount stacked on top, as after a sidecar died."""
        with pub.lock:
            if pub.stop.is_set() or pub.state != "waiting" or pub.fd < 0:
                return
            waited = time.monotonic() - pub.waiting_since
            if waited < self.wait_limit_s:
                return
            close_quietly(pub.fd)
            pub.fd = -1
            pub.state = "dead"
        log.warning(
            "no sidecar served %s within %g s: ending its FUSE connection (readers get "
            "ENOTCONN); the next sidecar that connects gets a fresh mount",
            pub.target,
            self.wait_limit_s,
        )

    def _offer(self, pub: Publication, conn: socket.socket) -> None:
        with pub.lock:
            if pub.stop.is_set():
                return
            if pub.fd < 0:
                # Dead (its sidecar is gone) or unknown (found after a restart): a connecting
                # sidecar is not serving this target, so replace the mount, if the bounds
                # allow; if not, the connection is closed without an offer (the sidecar
                # retries later, and a pod looping on the socket stacks nothing more).
                if not self._may_replace(pub):
                    return
                self._replace_mount(pub)
            fd = pub.fd
        try:
            fdpass.send_offer(conn, fd, pub.payload())
        except (fdpass.FdPassError, OSError) as exc:
            # Not sent (the sidecar went away before the offer, EPIPE): the fd rides on the
            # first segment, so nobody received it and nobody read from it; keep it for the
            # next sidecar. (Were part of the offer sent before the error, a peer that read the
            # fd and then died could have taken requests from it: the wait limit still ends
            # such a connection, see _expire_waiting.)
            if not pub.stop.is_set():
                log.warning(
                    "could not offer %s to a sidecar: %s; keeping the mount for the next one",
                    pub.target,
                    exc,
                )
            return
        try:
            answer = fdpass.read_reply(conn, OFFER_REPLY_TIMEOUT_S)
        except (fdpass.FdPassError, OSError) as exc:
            if pub.stop.is_set():
                return
            # Gone (killed) or silent with the fd in hand: its server may have read requests
            # (INIT, a reader's) that nobody will answer. Keeping a copy would keep the
            # connection alive, so those readers would wait in the kernel for good, unkillable,
            # and the next sidecar would get a connection without its INIT. Dropped instead:
            # once no process holds the fd the kernel ends the connection (ENOTCONN), and the
            # next sidecar gets a fresh mount on top, as after a sidecar dies while serving.
            with pub.lock:
                if pub.fd == fd:
                    close_quietly(pub.fd)
                    pub.fd = -1
                    pub.state = "dead"
            log.warning(
                "sidecar for %s did not take the mount: %s; the next one gets a fresh mount",
                pub.target,
                exc,
            )
            return
        if answer is not None:
            log.warning("sidecar refused %s: %s; waiting for another", pub.target, answer)
            return
        with pub.lock:
            close_quietly(pub.fd)  # the sidecar holds the only fd now
            pub.fd = -1
            pub.state = "served"
        log.info("the sidecar serves %s", pub.target)
        self._watch(pub, conn)
        if not pub.stop.is_set():
            with pub.lock:
                pub.state = "dead"
            log.warning(
                "the sidecar of %s is gone: readers get ENOTCONN until a sidecar connects again",
                pub.target,
            )

    def _may_replace(self, pub: Publication) -> bool:
        """Whether a replacement may go ahead now (it then spends a token); called under
        ``pub.lock``. Refused past :data:`MAX_REPLACEMENTS` (the objfs mounts stacked at the
        target, from mountinfo, so a restarted plugin counts them too) or while the bucket
        (:data:`REPLACE_BURST`, one more every :attr:`replace_interval_s`) is empty; each
        refusal is logged once, until a replacement goes through again."""
        now = time.monotonic()
        pub.tokens = min(
            float(REPLACE_BURST),
            pub.tokens + (now - pub.tokens_at) / self.replace_interval_s,
        )
        pub.tokens_at = now
        if stacked(pub.target) > MAX_REPLACEMENTS:
            reason = "cap"
            message = (
                f"not replacing the dead mount on {pub.target}: {MAX_REPLACEMENTS} "
                "replacements are stacked there already (one per sidecar that died or left "
                "without answering); readers get ENOTCONN until the pod is deleted"
            )
        elif pub.tokens < 1:
            reason = "rate"
            message = (
                f"not replacing the dead mount on {pub.target} yet: sidecars connect faster "
                f"than {REPLACE_BURST} replacements at once, then one per "
                f"{self.replace_interval_s:g} s; their connections are closed meanwhile"
            )
        else:
            pub.tokens -= 1
            pub.refused = ""
            return True
        if pub.refused != reason:
            pub.refused = reason
            log.warning("%s", message)
        return False

    def _replace_mount(self, pub: Publication) -> None:
        """Mounts a fresh FUSE connection on top of the dead one, which stays beneath.

        Not detach-then-mount: a container's copy of the target (``mountPropagation:
        HostToContainer``, a slave of the target's mount) receives a mount made on top of the
        dead one, but neither the detach nor a mount made afterwards on the bare directory, so
        it would stay on the dead mount. Dead mounts below the top are not trimmed either: a
        container (re)started after a takeover holds a slave copy of the mount that was on top
        then, and sees the next one only if it is mounted on top of that one. So the stack
        grows by one per replacement; NodeUnpublishVolume removes it whole."""
        self._mount_new(pub, make_target=False)
        log.info("replaced the mount on %s for a new sidecar (stacked on the dead one)", pub.target)

    def _watch(self, pub: Publication, conn: socket.socket) -> None:
        """Waits for end of file on the sidecar's connection; tunes the mount meanwhile."""
        tune_kernel(pub.config)
        checks = int(_RETUNE_S / _POLL_S)
        conn.settimeout(_POLL_S)
        while not pub.stop.is_set():
            try:
                if not conn.recv(64):
                    return
            except TimeoutError:
                pass
            except OSError:
                return
            if checks > 0:
                checks -= 1
                if _read_ahead_lowered(pub.config):
                    tune_kernel(pub.config)

    # -- state files -------------------------------------------------------------------------

    def _state_path(self, target: str) -> str:
        digest = hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return os.path.join(self.state_dir, f"{digest}.json")

    def _save(self, pub: Publication) -> None:
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        path = self._state_path(pub.target)
        temporary = path + ".tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(pub.saved(), f)
        os.replace(temporary, path)

    def _remove_saved(self, target: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._state_path(target))

    def recover(self) -> None:
        """After a restart: listen again for the targets still mounted, forget the others."""
        names = sorted(os.listdir(self.state_dir)) if os.path.isdir(self.state_dir) else []
        for name in names:
            path = os.path.join(self.state_dir, name)
            if not name.endswith(".json"):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    saved = json.load(f)
                target = str(saved["target_path"])
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
                self._remove_saved(target)
                continue
            pub = Publication(
                volume_id=str(saved["volume_id"]),
                target=target,
                spec=spec,
                config=dataclasses.replace(spec.config, mountpoint=target),
                fd_dir=str(saved["fd_dir"]),
                sock_name=str(saved["socket"]),
                state="unknown",
            )
            try:
                self._listen(pub)
            except CsiError as exc:
                log.warning("%s stays mounted, without a sidecar socket: %s", target, exc)
            self._publications[target] = pub
            if pub.listener is not None:
                self._start_thread(pub)
            log.info("found %s published on %s; listening for its sidecar", pub.volume_id, target)
        for target in mounts_below(self.kubelet_dir):
            if target not in self._publications:
                log.warning(
                    "%s is a %s mount without a state file: NodeUnpublishVolume will remove it",
                    target,
                    FSTYPE,
                )

    def shutdown(self) -> None:
        """Stops every thread and closes sockets and fds; mounts, state files and socket files
        stay (a sidecar reads a removed socket file as an unpublished volume and stops serving
        it; a restarted node plugin binds the same names anew)."""
        with self._lock:
            for pub in self._publications.values():
                self._stop(pub, remove_socket=False)
                close_quietly(pub.fd)
                pub.fd = -1
            self._publications.clear()


def _detach_objfs_stack(target: str) -> int:
    """:func:`~objfs.csi.fusemount.detach_all`, with a failure as a CSI error."""
    try:
        return detach_all(target)
    except OSError as exc:
        raise CsiError(
            grpc.StatusCode.INTERNAL, f"unmounting {target} failed: {exc.strerror}"
        ) from None


def _left_message(target: str, left: MountInfo, detached: int) -> str:
    """Why NodeUnpublishVolume fails with ``left`` still the topmost mount at ``target``."""
    if left.fstype == FSTYPE:
        return (
            f"objfs mounts remain at {target} after detaching {detached} (more than the node "
            "plugin ever stacks): the kubelet's next NodeUnpublishVolume detaches more"
        )
    return (
        f"a {left.fstype} mount that objfs did not make remains at {target}: unmount it on "
        "the node; the kubelet's next NodeUnpublishVolume then finishes"
    )


def _seconds_from_env(name: str, default: float) -> float:
    """``default``, or the seconds in the environment variable ``name`` when set."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"{name}={value!r}: give a number of seconds") from None
    if not seconds > 0:
        raise UsageError(f"{name}={value!r}: give a positive number of seconds")
    return seconds


def _objfs_mount(target: str) -> str | None:
    """``target`` if an objfs FUSE mount is the topmost mount there (from mountinfo)."""
    info = mounted(target)
    return target if info is not None and info.fstype == FSTYPE else None


def _make_connectable(dir_fd: int, name: str) -> None:
    """chmod 0666 the socket just bound, without following a symlink: the directory is the
    pod's, and a pod could swap the socket for a link to a host file between bind and chmod."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.EEXIST, "replaced by something that is not our socket", name)
        os.chmod(f"/proc/self/fd/{fd}", 0o666)  # the inode the O_PATH fd holds
    finally:
        os.close(fd)


def _read_ahead_lowered(config: MountConfig) -> bool:
    if config.read_ahead_kb <= 0:
        return False
    info = mounted(config.mountpoint)
    if info is None:
        return False
    try:
        with open(f"/sys/class/bdi/{info.major}:{info.minor}/read_ahead_kb") as f:
            return int(f.read().strip()) < config.read_ahead_kb
    except (OSError, ValueError):
        return False


# -- the gRPC server -------------------------------------------------------------------------


def _rpc(function: Any) -> Any:
    """Turns CsiError into its status code and anything else into INTERNAL, in one line."""

    def handler(request: Any, context: Any) -> Any:
        try:
            return function(request)
        except CsiError as exc:
            log.warning("%s: %s", function.__name__, exc)
            context.abort(exc.code, str(exc))
        except Exception as exc:
            log.error("%s failed: %s: %s", function.__name__, type(exc).__name__, exc)
            log.debug("details", exc_info=True)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable: context.abort raises")

    return handler


def parse_endpoint(endpoint: str | None) -> str:
    """The socket path of ``unix:///ABS/PATH``; a UsageError for anything else."""
    if not endpoint:
        raise UsageError("--endpoint is missing: give unix:///PATH or set CSI_ENDPOINT")
    if not endpoint.startswith("unix://"):
        raise UsageError(f"--endpoint {endpoint}: give unix:///ABSOLUTE/PATH (a Unix socket)")
    path = endpoint.removeprefix("unix://")
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        raise UsageError(f"--endpoint {endpoint}: give unix:///ABSOLUTE/PATH (an absolute path)")
    return path


def _prepare_socket_path(path: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"--endpoint {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise UsageError(f"--endpoint {path} exists and is not a socket: remove it or pick another")
    os.unlink(path)  # a stale socket of an earlier run


def run_csi(*, endpoint: str | None, node_id: str | None, kubelet_dir: str, log_level: str) -> int:
    """``objfs csi``: serves until SIGTERM/SIGINT, then exits 0 leaving mounts in place."""
    path = parse_endpoint(endpoint)
    if not node_id:
        raise UsageError("--node-id is missing: give this node's name or set KUBE_NODE_NAME")
    if not os.path.isdir(kubelet_dir):
        raise UsageError(f"--kubelet-dir {kubelet_dir} is not a directory")
    setup_logging(log_level, None, daemon=False)
    if os.geteuid() != 0:
        log.warning("objfs csi runs as uid %d: mounting needs root (CAP_SYS_ADMIN)", os.geteuid())

    node = Node(node_id, kubelet_dir)
    node.recover()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: stopping (mounts stay in place)", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="csi"))
    server.add_generic_rpc_handlers(
        proto.generic_handlers(
            {
                "Identity": {
                    "GetPluginInfo": _rpc(node.get_plugin_info),
                    "GetPluginCapabilities": _rpc(node.get_plugin_capabilities),
                    "Probe": _rpc(node.probe),
                },
                "Node": {
                    "NodePublishVolume": _rpc(node.publish),
                    "NodeUnpublishVolume": _rpc(node.unpublish),
                    "NodeGetCapabilities": _rpc(node.get_capabilities),
                    "NodeGetInfo": _rpc(node.get_info),
                },
            }
        )
    )
    try:
        _prepare_socket_path(path)
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as exc:
            raise UsageError(f"--endpoint {endpoint}: cannot listen there ({exc})") from None
        server.start()
        log.info(
            "objfs csi %s (%s) serving on %s for node %s",
            __version__,
            DRIVER_NAME,
            path,
            node_id,
        )
        # Short waits: Python runs a signal's handler in the main thread, but the kernel may
        # deliver SIGTERM to one of gRPC's threads, and then nothing interrupts a long wait
        # here (a test once waited 30 s for a stop that never came: no "received" line).
        while not stop.wait(_SIGNAL_POLL_S):
            pass
        server.stop(grace=5).wait()
    finally:
        node.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            os.unlink(path)
    log.info("objfs csi stopped")
    return 0
