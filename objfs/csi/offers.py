"""The offer thread of each published target: mounts, the offer socket, the sidecar's answers.

A thread per published target offers the mount's fd to each sidecar that connects to its
socket in the pod's ``objfs-fd`` emptyDir (:func:`objfs.fdpass.send_offer`), one connection
at a time, and moves the :class:`~objfs.csi.publication.Publication` between its states:

* ``ok``: the node plugin closes its copy (SERVED), so if the sidecar dies the kernel ends the
  FUSE connection and readers get ENOTCONN (never a hang, never wrong bytes). The sidecar keeps
  its connection open while it serves; end of file on it marks the mount DEAD;
* an error answer, or an offer that could not be sent: the fd is kept for the next sidecar;
* no answer within :data:`~objfs.csi.publication.OFFER_REPLY_TIMEOUT_S`, or the sidecar gone
  with the fd in hand (its server may have read requests nobody will answer): the copy is
  closed (DEAD), so the kernel ends that connection instead of leaving readers blocked;
* no ``ok`` within :attr:`Offers.wait_limit_s` of the mount: the copy is closed (DEAD), so
  whatever stats the target (df, node-exporter) fails with ENOTCONN instead of blocking;
* a sidecar that connects to a DEAD or UNKNOWN mount gets a fresh one stacked on top
  (:meth:`Offers._replace_mount` says why on top): containers whose copy of the target has
  ``mountPropagation: HostToContainer`` see it, others keep the dead one until the pod
  restarts. The dead mounts stay beneath until NodeUnpublishVolume. As any process in the pod
  may connect, replacements are bounded (:meth:`Offers._may_replace`): at most
  :data:`~objfs.csi.publication.MAX_REPLACEMENTS` per target, from a bucket of
  :data:`~objfs.csi.publication.REPLACE_BURST`; a connection past them is closed unanswered.

"Mounted", the device number (kernel tuning) and recovery read the topmost mount from
mountinfo (:func:`objfs.csi.fusemount.mounted`). Kernel tuning (read-ahead, the FUSE queue;
:func:`objfs.kernel_setup.tune_kernel`) is the node plugin's job, as the sidecar may not write
sysfs: it runs once the sidecar answers ``ok``, and again during :data:`_RETUNE_S` if the
kernel lowered the read-ahead on reading the answer to its INIT request, which may come just
after the ``ok``.

Invariants: nothing waits on a sidecar without a timeout or a way to be woken (stop closes the
connection); nothing in the pod's objfs-fd directory is followed as a symlink; nothing here
stats, opens or resolves a path inside a mount it made.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import socket
import stat
import threading
import time
from typing import Any

import grpc

from objfs import fdpass
from objfs.config import MountConfig
from objfs.csi.fusemount import close_quietly, mount_fd, mounted, open_fuse_device, stacked
from objfs.csi.node_cache import Broker, NodeCache, NodeCacheError, peer_identity
from objfs.csi.publication import (
    MAX_REPLACEMENTS,
    OFFER_REPLY_TIMEOUT_S,
    REPLACE_BURST,
    REPLACE_INTERVAL_ENV,
    REPLACE_INTERVAL_S,
    SIDECAR_WAIT_LIMIT_S,
    WAIT_LIMIT_ENV,
    CsiError,
    Publication,
    State,
)
from objfs.errors import UsageError
from objfs.kernel_setup import tune_kernel

log = logging.getLogger("objfs.csi")

#: How often blocking socket calls wake up to see whether the target is being unpublished.
_POLL_S = 0.5
#: After the sidecar's ``ok``, how long the read-ahead is watched: the kernel lowers it when it
#: reads the answer to its INIT request, which may come just after the ``ok``.
_RETUNE_S = 5.0
_JOIN_TIMEOUT_S = 10.0
FD_VOLUME = "objfs-fd"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def socket_name(volume_id: str, target: str) -> str:
    """``<volume id, made safe, at most 40 chars>-<8 hex of sha256(target)>.sock``."""
    digest = hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"{_SAFE_NAME.sub('_', volume_id)[:40]}-{digest}.sock"


class Offers:
    """Mounts, offer sockets and offer threads for the node's publications, with its limits
    (read from the environment once, here) and the node cache, if any."""

    def __init__(self, node_cache: NodeCache | None = None) -> None:
        self.wait_limit_s = _seconds_from_env(WAIT_LIMIT_ENV, SIDECAR_WAIT_LIMIT_S)
        self.replace_interval_s = _seconds_from_env(REPLACE_INTERVAL_ENV, REPLACE_INTERVAL_S)
        self.node_cache = node_cache

    def mount_new(self, pub: Publication, *, make_target: bool) -> None:
        """A fresh FUSE connection mounted on the target: ``pub`` becomes WAITING with its fd."""
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
        pub.become(State.WAITING, fd)

    def listen(self, pub: Publication) -> None:
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

    def start_thread(self, pub: Publication) -> None:
        pub.thread = threading.Thread(
            target=self._serve_offers, args=(pub,), name=f"offer {pub.volume_id}", daemon=True
        )
        pub.thread.start()

    def stop(self, pub: Publication, *, remove_socket: bool = True) -> None:
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
            if pub.stop.is_set() or pub.state is not State.WAITING or pub.fd < 0:
                return
            waited = time.monotonic() - pub.waiting_since
            if waited < self.wait_limit_s:
                return
            pub.become(State.DEAD)
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
            # With the node cache: the identity's folder and a broker holding a copy of this
            # connection's fd (made under the lock: an unpublish closes pub.fd).
            node = self._node_cache_for(pub, conn, fd)
        broker = node[1] if node is not None else None
        try:
            self._offer_fd(pub, conn, fd, node)
        finally:
            if broker is not None:
                broker.close()  # the sidecar's connection ended: its copy goes at once

    def _node_cache_for(
        self, pub: Publication, conn: socket.socket, fd: int
    ) -> tuple[int, Broker] | None:
        """The identity's folder (an open fd) and a broker for the sidecar on ``conn``, or
        None (no node cache, ``node-cache: "false"``, or the folder cannot be had: the
        volume's own ``cache-dir`` then, with a warning)."""
        if self.node_cache is None or not pub.spec.node_cache:
            return None
        try:
            identity = peer_identity(conn, pub.spec.namespace, pub.spec.service_account)
            folder, dir_fd = self.node_cache.folder(identity)
        except (NodeCacheError, OSError) as exc:
            log.warning("no node cache for the sidecar of %s: %s", pub.target, exc)
            return None
        copy = -1
        try:
            copy = os.dup(fd)
            broker = Broker(copy, folder, identity, pub.volume_id)
        except OSError as exc:
            close_quietly(copy)
            close_quietly(dir_fd)
            log.warning("no node cache for the sidecar of %s: %s", pub.target, exc.strerror)
            return None
        return dir_fd, broker

    def _offer_fd(
        self,
        pub: Publication,
        conn: socket.socket,
        fd: int,
        node: tuple[int, Broker] | None,
    ) -> None:
        fds = {"fuse": fd}
        payload = pub.payload()
        if node is not None:
            dir_fd, broker = node
            fds.update({"cache-dir": dir_fd, "backing": broker.theirs})
            payload = self.node_cache_payload(payload, broker)
        try:
            try:
                fdpass.send_offer(conn, fds, payload)
            finally:
                if node is not None:
                    close_quietly(node[0])  # the sidecar has its own copies now, or none
                    node[1].start()
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
                    pub.become(State.DEAD)
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
            # Closes the publication's copy: the sidecar holds the only fd now, but for the
            # broker's (node cache), which goes as soon as the sidecar's connection ends.
            pub.become(State.SERVED)
        if node is not None:
            log.info(
                "the sidecar serves %s, with the node cache of %s and passthrough through "
                "the plugin",
                pub.target,
                node[1].identity,
            )
        else:
            log.info("the sidecar serves %s", pub.target)
        try:
            self._watch(pub, conn)
        except Exception as exc:  # e.g. tune_kernel's OSError: never left SERVED unwatched
            with pub.lock:
                pub.become(State.DEAD)
            log.warning(
                "watching the sidecar of %s failed: %s; the next sidecar to connect gets a "
                "fresh mount",
                pub.target,
                exc,
            )
            return
        if not pub.stop.is_set():
            with pub.lock:
                pub.become(State.DEAD)
            log.warning(
                "the sidecar of %s is gone: readers get ENOTCONN until a sidecar connects again",
                pub.target,
            )

    def node_cache_payload(self, payload: dict[str, Any], broker: Broker) -> dict[str, Any]:
        """The offer's payload for a sidecar that gets the node cache: no ``cache-dir`` of its
        own, the node's cap as its ``cache-size`` (the sweep holds the cap across folders)."""
        assert self.node_cache is not None
        options = {k: v for k, v in dict(payload.get("options", {})).items() if k != "cache-dir"}
        options["cache-size"] = str(self.node_cache.size_bytes)
        return {**payload, "options": options, "node_cache": str(broker.identity)}

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
        self.mount_new(pub, make_target=False)
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
