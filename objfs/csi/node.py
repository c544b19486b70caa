"""The CSI node plugin's gRPC side: the Identity and Node services, their checks, ``run_csi``.

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
   JSON state file (:mod:`objfs.csi.state`);
4. returns without waiting for the sidecar: the target's offer thread (:mod:`objfs.csi.offers`)
   offers the fd to each sidecar that connects, and replaces the mount when its sidecar is
   gone. Until a sidecar takes the fd, file operations on the mount wait in the kernel (a
   reader blocks; it is not an error), for at most
   :data:`~objfs.csi.publication.SIDECAR_WAIT_LIMIT_S` (``OBJFS_CSI_SIDECAR_WAIT_S``
   overrides it); then they fail with ENOTCONN. A publication's states:
   :mod:`objfs.csi.publication`.

With ``--node-cache-dir DIR`` (:mod:`objfs.csi.node_cache`) the plugin also keeps a disk-cache
folder per identity (the pod's namespace and service account, the sidecar's uid) under DIR,
hands the sidecar an open descriptor of it with the FUSE fd (its ``--cache-dir /dev/fd/N``,
replacing the volume's ``cache-dir``; ``node-cache: "false"`` keeps that), registers
passthrough backing files for the sidecar after checking them (a broker per offer), and holds
``--node-cache-size`` across the folders by evicting least recently used versions.

NodeUnpublishVolume stops the target's thread, removes its socket and state file, detaches
every objfs mount stacked on the target (``MNT_DETACH``, topmost first, until mountinfo shows
none there, at most :data:`objfs.csi.fusemount.MAX_STACKED`: never waits for a sidecar) and
removes the target directory; it answers OK for a target that is not mounted or not known,
INVALID_ARGUMENT for one outside ``--kubelet-dir``, and FAILED_PRECONDITION while any mount
remains at the target (one objfs did not make on top, or objfs mounts past that bound): never
OK with a mount left, so the kubelet retries instead of taking the volume for gone.

A fuse.objfs mount under the kubelet directory without a state file (an orphan: a crash
between the mount and its state file, or a wiped state directory) is removed by
NodeUnpublishVolume, and by a NodePublishVolume of that target (in the pod's volumes), which
then publishes afresh. Another file system on the target is ALREADY_EXISTS.

On SIGTERM/SIGINT the plugin stops serving gRPC and exits 0, leaving mounts, state files and
socket files in place: pods still use the mounts, and a sidecar reads a removed socket file as
an unpublished volume. After a restart it recovers its published targets
(:func:`objfs.csi.state.recover_publications`).

Invariants: the node plugin never stats, opens or resolves a path inside a mount it made (see
:mod:`objfs.csi.fusemount`); no credential reaches a log, a state file or an offer (the volume
attributes carry none, and the kubelet's service account tokens are dropped); every mount is
made under the kubelet directory only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any

import grpc

from objfs import __version__
from objfs.config import parse_size
from objfs.csi import DRIVER_NAME, proto
from objfs.csi.fusemount import FSTYPE, MountInfo, detach, detach_all, mounted, real_target
from objfs.csi.node_cache import NodeCache
from objfs.csi.offers import FD_VOLUME, Offers, socket_name
from objfs.csi.publication import CsiError, Publication
from objfs.csi.state import StateFiles, recover_publications
from objfs.csi.volume import VolumeContextError, parse_volume_context
from objfs.errors import UsageError
from objfs.logsetup import setup_logging

log = logging.getLogger("objfs.csi")

#: The node cache's cap when --node-cache-dir comes without --node-cache-size.
DEFAULT_NODE_CACHE_SIZE = "100G"
#: How often the main thread wakes up to run a signal handler the kernel's delivery to
#: another thread left pending (see run_csi).
_SIGNAL_POLL_S = 0.5


class Node:
    """The node plugin's state: published targets by real path, and what serves them."""

    def __init__(self, node_id: str, kubelet_dir: str, node_cache: NodeCache | None = None) -> None:
        self.node_id = node_id
        self.kubelet_dir = os.path.realpath(kubelet_dir)
        self.state_files = StateFiles(
            os.path.join(self.kubelet_dir, "plugins", DRIVER_NAME, "state")
        )
        self._publications: dict[str, Publication] = {}
        self._lock = threading.Lock()
        self.offers = Offers(node_cache)

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
                self.offers.stop(existing)
                existing.release()
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
            self.offers.mount_new(pub, make_target=True)
            try:
                self.offers.listen(pub)
                self.state_files.save(pub)
            except BaseException:
                self.offers.stop(pub)
                with contextlib.suppress(OSError):
                    detach(target)
                pub.release()
                self.state_files.remove(target)
                raise
            self._publications[target] = pub
            self.offers.start_thread(pub)
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
                self.offers.stop(pub)
                pub.release()
            # Every mount stacked there: the first one and one per sidecar takeover.
            count = _detach_objfs_stack(target)
            self.state_files.remove(target)
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

    # -- restart and stop --------------------------------------------------------------------

    def recover(self) -> None:
        """After a restart: listen again for the targets still mounted, forget the others."""
        recover_publications(self.state_files, self.offers, self.kubelet_dir, self._publications)

    def shutdown(self) -> None:
        """Stops every thread and closes sockets and fds; mounts, state files and socket files
        stay (a sidecar reads a removed socket file as an unpublished volume and stops serving
        it; a restarted node plugin binds the same names anew)."""
        with self._lock:
            for pub in self._publications.values():
                self.offers.stop(pub, remove_socket=False)
                pub.release()
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


def _objfs_mount(target: str) -> str | None:
    """``target`` if an objfs FUSE mount is the topmost mount there (from mountinfo)."""
    info = mounted(target)
    return target if info is not None and info.fstype == FSTYPE else None


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


def run_csi(
    *,
    endpoint: str | None,
    node_id: str | None,
    kubelet_dir: str,
    log_level: str,
    node_cache_dir: str | None = None,
    node_cache_size: str | None = None,
) -> int:
    """``objfs csi``: serves until SIGTERM/SIGINT, then exits 0 leaving mounts in place."""
    path = parse_endpoint(endpoint)
    if not node_id:
        raise UsageError("--node-id is missing: give this node's name or set KUBE_NODE_NAME")
    if not os.path.isdir(kubelet_dir):
        raise UsageError(f"--kubelet-dir {kubelet_dir} is not a directory")
    node_cache = None
    if node_cache_dir:
        if not os.path.isabs(node_cache_dir):
            raise UsageError(f"--node-cache-dir {node_cache_dir}: give an absolute path")
        size = parse_size(node_cache_size or DEFAULT_NODE_CACHE_SIZE, option="--node-cache-size")
        if size <= 0:
            raise UsageError("--node-cache-size: give a size above 0")
        node_cache = NodeCache(node_cache_dir, size)
        node_cache.prepare()
    elif node_cache_size:
        raise UsageError("--node-cache-size needs --node-cache-dir")
    setup_logging(log_level, None, daemon=False)
    if os.geteuid() != 0:
        log.warning("objfs csi runs as uid %d: mounting needs root (CAP_SYS_ADMIN)", os.geteuid())

    node = Node(node_id, kubelet_dir, node_cache)
    node.recover()
    if node_cache is not None:
        node_cache.start()
        log.info(
            "node cache: %s, at most %.1f GiB across identities",
            node_cache.root,
            node_cache.size_bytes / (1 << 30),
        )
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
        if node_cache is not None:
            node_cache.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            os.unlink(path)
    log.info("objfs csi stopped")
    return 0
