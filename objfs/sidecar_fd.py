"""``objfs sidecar --fd-dir DIR``: serve the FUSE fds that ``objfs csi`` hands over.

The privileged node plugin mounts each volume with ``fd=N`` and offers that fd on a Unix
socket ``DIR/*.sock`` (:mod:`objfs.fdpass`). This process needs no capability and no
``/dev/fuse``: it polls DIR, takes each offer and serves it with a child
``objfs mount SOURCE /dev/fd/N --foreground OPTIONS``, one per socket (pyfuse3 serves one
session per process).

Invariants:

* at most one child per socket; a socket whose file stays away for :data:`_GONE_AFTER_S`
  (the volume was unpublished) gets its child stopped. A socket bound anew under the same name
  (a restarted node plugin, which unlinks and binds again) leaves a serving child alone, and a
  child's answer is due before the node plugin stops waiting for it
  (:data:`_READY_TIMEOUT_S`);
* an fd is owned by exactly one of: the :class:`~objfs.fdpass.Offer` (until the child is
  spawned), the child (this process closes its copy right after spawning, so the mount's
  connection ends when the child does). The same holds for the extra fds of an offer with the
  node cache: the identity's cache folder (the child's ``--cache-dir /dev/fd/N``) and the
  passthrough broker's socket (``$OBJFS_BACKING_BROKER_FD``), so the broker's connection, too,
  ends with the child;
* the offer's connection is open iff its child starts or serves: it is answered ``ok`` once
  the child serves (its status file appeared), and closed when the child exits, so the node
  plugin sees end of file and, on the next connection, offers a fresh mount of the same target
  (a restarted sidecar takes over the same way);
* ``error MESSAGE`` answers an offer only if its fd was provably never read: the options are
  refused, the child cannot be started, or the child exited without leaving its
  :data:`FD_USED_FILE` mark (written just before ``pyfuse3.init``; from then on it may have
  read the kernel's INIT request, and that fd must not be offered again). Any other child that
  did not serve (killed, stopped, failed later, mark unreadable) has its connection closed
  without an answer: the node plugin drops that fd and mounts afresh;
* credentials come only from this process's environment and files (``credentials-file``,
  ``sas-token-file`` name files in this container), never from an offer; log lines carry
  sources, volume ids and option names, never option values;
* children die with this process (``PR_SET_PDEATHSIG``): a killed sidecar leaves dead mounts
  (ENOTCONN, EIO) that the node plugin replaces, never a server nobody supervises.

State files (the root file system is read-only in the pod, so everything goes under
``$OBJFS_STATE_DIR``, default DIR): ``.objfs-sidecar.json`` (rewritten every second: pid,
volumes and their state), ``.ready`` (present while every offered volume is served) and
``.objfs-run/NAME/`` (each child's status file). ``objfs status --probe DIR`` answers from
them.

SIGTERM or SIGINT stops every child (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`),
closes the connections and exits 0. Only a bad DIR is an error (exit 2).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from objfs import fdpass
from objfs.errors import UsageError
from objfs.kernel.passthrough import BROKER_ENV
from objfs.logsetup import setup_logging
from objfs.mountpoint import FD_USED_ENV
from objfs.options import build_parser
from objfs.options import mount_arguments as mount_arguments_of
from objfs.status import STATUS_FILE, STATUS_KIND

log = logging.getLogger("objfs.sidecar")

#: Environment variable naming where state files go (default: the fd dir itself).
STATE_DIR_ENV = "OBJFS_STATE_DIR"
READY_FILE = ".ready"
RUN_DIR = ".objfs-run"
#: How long a stopped child may take to exit before it is killed.
STOP_TIMEOUT_S = 20.0

_POLL_S = 0.5
_TAKE_TIMEOUT_S = 2.0
# A socket nobody listens on (the node plugin restarts, or the volume is going away).
_RETRY_REFUSED_S = 1.0
_BACKOFF_MIN_S = 1.0
_BACKOFF_MAX_S = 30.0
# A child that served this long before it died restarts without backoff.
_HEALTHY_AFTER_S = 60.0
# How long a child may take to serve: below the node plugin's wait for an answer (60 s), so
# that a child never serves an fd the node plugin still holds.
_READY_TIMEOUT_S = 55.0
_STATUS_INTERVAL_S = 1.0
# How long a socket file must stay away before its child is stopped: a restarting node plugin
# unlinks the socket, then binds it again.
_GONE_AFTER_S = 3.0
# Keys the kubelet adds to volume attributes; the node plugin should drop them, but they are
# no mount options either way.
_POD_INFO_PREFIX = "csi.storage.k8s.io/"
_PR_SET_PDEATHSIG = 1
#: A child writes this file in its run dir just before ``pyfuse3.init``: without it, the child
#: never touched its fd.
FD_USED_FILE = "fd-used"
_FD_USED_ENV = FD_USED_ENV
# The child's command, run by a new interpreter (a string: this module does not import the
# command): ``objfs mount SOURCE /dev/fd/N ...``. objfs.mount creates the file named by
# $OBJFS_SIDECAR_FD_USED_FILE (FD_USED_ENV) just before it sets up the session on the fd, and
# does not start if it cannot: no mark always means an untouched fd.
_CHILD_CODE = "import sys; from objfs.cli import main; sys.exit(main(sys.argv[1:]))"


# -- options ---------------------------------------------------------------------------------


def mount_arguments(source: str, options: dict[str, str]) -> list[str]:
    """``objfs mount`` options for an offer's ``options``; raises UsageError (one line).

    Keys are long options without dashes; flags take ``true``/``false``
    (:func:`objfs.options.mount_arguments`). The result is checked with ``objfs mount``'s own
    parser, so a value it would refuse is refused here already.
    """
    argv = mount_arguments_of(
        {key: value for key, value in options.items() if not key.startswith(_POD_INFO_PREFIX)}
    )
    # argparse reports to stderr and exits; catch both to get its one line.
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            build_parser().parse_args(["mount", source, "/dev/fd/0", *argv, "--foreground"])
    except SystemExit:
        message = captured.getvalue().strip().removeprefix("objfs: error:").strip()
        message = message.split(" (see `")[0] or "the options are not valid"
        raise UsageError(f"bad mount options: {message}") from None
    return argv


# -- children --------------------------------------------------------------------------------


def _die_with_parent_fn() -> Any:
    """A preexec_fn: the child gets SIGTERM when this process dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # died before the prctl
            os._exit(1)

    return preexec


@dataclass
class _Child:
    """One ``objfs mount /dev/fd/N`` child and the offer whose fd it serves."""

    name: str
    proc: subprocess.Popen[bytes]
    offer: fdpass.Offer
    source: str
    volume_id: str
    run_dir: str
    started_at: float
    served_since: float | None = None
    stop_deadline: float | None = None
    partial: bytes = b""
    error: str = ""
    # The error answer for the offer, if it turns out that the fd was never read.
    fail_message: str = "the sidecar stopped the mount"

    def status_written(self) -> bool:
        with contextlib.suppress(OSError):
            return any(n.endswith(".json") for n in os.listdir(self.run_dir))
        return False

    def fd_untouched(self) -> bool:
        """True only if the child exited and provably never read its fd (no mark)."""
        if self.proc.poll() is None:
            return False
        try:
            os.lstat(os.path.join(self.run_dir, FD_USED_FILE))
        except FileNotFoundError:
            return True
        except OSError:
            pass
        return False


@dataclass
class _Volume:
    """What the sidecar knows of one socket ``DIR/NAME``."""

    name: str
    path: str
    child: _Child | None = None
    next_try: float = 0.0
    backoff: float = _BACKOFF_MIN_S
    # No node plugin listens (refused): nothing to serve there for now.
    idle: bool = False
    error: str = ""
    taken: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    # When a scan first found the socket file missing (None: present at the last scan).
    missing_since: float | None = None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


class FdSidecar:
    def __init__(
        self, fd_dir: str, state_dir: str, log_level: str = "info", log_format: str = "text"
    ) -> None:
        self.fd_dir = fd_dir
        # The children log like this process unless an offer says otherwise.
        self.log_defaults = {"log-level": log_level, "log-format": log_format}
        self.state_dir = state_dir
        self.run_root = os.path.join(state_dir, RUN_DIR)
        self.volumes: dict[str, _Volume] = {}
        self.children: list[_Child] = []  # serving, starting and stopping
        self.stop_requested = False
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._preexec = _die_with_parent_fn()
        self._last_status = 0.0
        self._ready: bool | None = None
        self._polled = False

    # -- signals -----------------------------------------------------------------------------

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.stop_requested:
            log.info("received %s: stopping every mount", signal.Signals(signum).name)
        self.stop_requested = True

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.on_signal)
        old_wakeup = signal.set_wakeup_fd(self._wake_w)
        os.makedirs(self.run_root, mode=0o700, exist_ok=True)
        self._remove(os.path.join(self.state_dir, READY_FILE))
        log.info("objfs sidecar: serving the FUSE fds offered in %s", self.fd_dir)
        try:
            while not self.stop_requested:
                self._scan()
                self._check_children()
                self._polled = True
                self._write_state()
                self._wait(_POLL_S)
        finally:
            self._shutdown()
            signal.set_wakeup_fd(old_wakeup)
            self._remove(os.path.join(self.state_dir, READY_FILE))
            self._remove(os.path.join(self.state_dir, STATUS_FILE))
            shutil.rmtree(self.run_root, ignore_errors=True)
        log.info("objfs sidecar stopped")
        return 0

    def _wait(self, timeout: float) -> None:
        """Sleep up to ``timeout``, forwarding the children's stderr; a signal wakes it."""
        deadline = time.monotonic() + timeout
        while not self.stop_requested:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for key, _ in self.selector.select(remaining):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 512):
                            pass
                else:
                    self._forward(key.data)

    def _forward(self, child: _Child) -> None:
        """Copy a child's stderr to ours, remembering its last error line."""
        pipe = child.proc.stderr
        assert pipe is not None
        try:
            data = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(pipe)
            pipe.close()
            data = b"\n" if child.partial else b""
        else:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.buffer.write(data)
                sys.stderr.buffer.flush()
        lines = (child.partial + data).split(b"\n")
        child.partial = lines.pop()[-8192:]
        for line in lines:
            text = line.decode("utf-8", "replace").strip()
            if text.startswith(("objfs: error:", "objfs: internal error:")):
                child.error = text.removeprefix("objfs: ").removeprefix("error:").strip()

    # -- sockets -----------------------------------------------------------------------------

    def _scan(self) -> None:
        present: set[str] = set()
        try:
            names = os.listdir(self.fd_dir)
        except OSError as exc:
            log.warning("cannot list %s: %s", self.fd_dir, exc.strerror)
            return
        for name in sorted(names):
            if name.endswith(".sock") and _is_socket(os.path.join(self.fd_dir, name)):
                present.add(name)
        now = time.monotonic()
        for name, volume in list(self.volumes.items()):
            # Only a socket removed for good stops its child. A socket bound anew under the
            # same name (a restarted node plugin unlinks it and listens again) leaves a serving
            # child alone: replacing the mount would cut off containers the new mount does not
            # propagate to.
            if name in present:
                volume.missing_since = None
                continue
            if volume.child is not None:
                if volume.missing_since is None:
                    volume.missing_since = now
                    log.debug("%s is gone: stopping its mount unless it comes back", name)
                if now - volume.missing_since < _GONE_AFTER_S:
                    continue
                log.info("%s was removed: stopping the mount it served", name)
                self._stop_child(volume.child)
            del self.volumes[name]
        for name in sorted(present):
            volume = self.volumes.setdefault(name, _Volume(name, os.path.join(self.fd_dir, name)))
            if volume.child is None and now >= volume.next_try and not self.stop_requested:
                self._take(volume)

    def _take(self, volume: _Volume) -> None:
        now = time.monotonic()
        try:
            offer = fdpass.take(volume.path, _TAKE_TIMEOUT_S)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                self._failed(volume, f"cannot connect: {exc.strerror or exc}", now)
                return
            # Nobody listens: a leftover socket, or the node plugin restarts. Quietly later.
            log.debug("%s: no offer (%s)", volume.name, exc.strerror or exc)
            volume.idle = True
            volume.next_try = now + _RETRY_REFUSED_S
            return
        except fdpass.FdPassError as exc:
            self._failed(volume, str(exc), now)
            return
        volume.idle = False
        volume.taken += 1
        volume.info = {
            "source": offer.source,
            "volume_id": str(offer.payload.get("volume_id", "")),
            "target_path": str(offer.payload.get("target_path", "")),
            "node_cache": offer.payload.get("node_cache") if "cache-dir" in offer.extra else None,
        }
        try:
            argv = mount_arguments(offer.source, {**self.log_defaults, **offer.options})
            cache_fd = offer.extra.get("cache-dir", -1)
            if cache_fd >= 0:
                # The node cache: the identity's folder, open (this container has no path
                # to it); it replaces any cache-dir of the volume's.
                argv += ["--cache-dir", f"/dev/fd/{cache_fd}"]
        except UsageError as exc:
            offer.fail(str(exc))
            offer.close()
            self._failed(volume, str(exc), now)
            return
        self._spawn(volume, offer, argv)

    def _spawn(self, volume: _Volume, offer: fdpass.Offer, argv: list[str]) -> None:
        now = time.monotonic()
        run_dir = os.path.join(self.run_root, volume.name.removesuffix(".sock"))
        shutil.rmtree(run_dir, ignore_errors=True)  # a status file of an earlier child
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        env["OBJFS_RUNTIME_DIR"] = run_dir
        env[_FD_USED_ENV] = os.path.join(run_dir, FD_USED_FILE)
        fd = offer.detach_fd()
        extra = offer.detach_extra()
        env.pop(BROKER_ENV, None)
        if "backing" in extra:
            env[BROKER_ENV] = str(extra["backing"])
        cmd = [
            sys.executable or "python3",
            "-c",
            _CHILD_CODE,
            "mount",
            offer.source,
            f"/dev/fd/{fd}",
            *argv,
        ]
        try:
            os.makedirs(run_dir, mode=0o700)
            proc = subprocess.Popen(
                [*cmd, "--foreground"],
                # This very interpreter, even where its path is not searchable by this uid
                # (exec of the magic link skips the path); argv[0] keeps the virtualenv.
                executable="/proc/self/exe" if os.path.exists("/proc/self/exe") else None,
                pass_fds=(fd, *extra.values()),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # this process decides when it stops
                preexec_fn=self._preexec,
            )
        except OSError as exc:
            message = f"cannot start objfs mount: {exc.strerror or exc}"
            offer.fail(message)
            offer.close()
            self._failed(volume, message, now)
            return
        finally:
            for own in (fd, *extra.values()):
                os.close(own)  # the child's now: the mount ends with it
        assert proc.stderr is not None
        os.set_blocking(proc.stderr.fileno(), False)
        child = _Child(
            name=volume.name,
            proc=proc,
            offer=offer,
            source=offer.source,
            volume_id=volume.info["volume_id"],
            run_dir=run_dir,
            started_at=now,
        )
        self.selector.register(proc.stderr, selectors.EVENT_READ, child)
        volume.child = child
        self.children.append(child)
        log.info(
            "%s: starting objfs for %s (volume %s, options: %s), pid %d",
            volume.name,
            offer.source,
            child.volume_id or "?",
            ", ".join(sorted(offer.options)) or "none",
            proc.pid,
        )

    def _failed(self, volume: _Volume, message: str, now: float) -> None:
        log.warning("%s: %s; trying again in %.0f s", volume.name, message, volume.backoff)
        volume.error = message
        volume.next_try = now + volume.backoff
        volume.backoff = min(_BACKOFF_MAX_S, volume.backoff * 2)

    # -- children ----------------------------------------------------------------------------

    def _check_children(self) -> None:
        now = time.monotonic()
        for child in list(self.children):
            volume = self.volumes.get(child.name)
            if volume is not None and volume.child is not child:
                volume = None
            code = child.proc.poll()
            if child.stop_deadline is not None:  # being stopped
                if code is None:
                    if now > child.stop_deadline:
                        log.warning(
                            "%s: objfs (pid %d) did not stop: killing it",
                            child.name,
                            child.proc.pid,
                        )
                        child.proc.kill()
                        child.stop_deadline = now + STOP_TIMEOUT_S
                    continue
                self._reap(child)
                continue
            if code is None:
                if child.served_since is None:
                    if child.status_written():
                        child.served_since = now
                        child.offer.ready()
                        if volume is not None:
                            volume.error = ""
                        log.info(
                            "%s: serving %s (pid %d)", child.name, child.source, child.proc.pid
                        )
                    elif now - child.started_at > _READY_TIMEOUT_S or _hung_up(child.offer):
                        message = (
                            f"objfs did not serve within {_READY_TIMEOUT_S:.0f} s (is the store "
                            "reachable?)"
                            if now - child.started_at > _READY_TIMEOUT_S
                            else "the node plugin stopped waiting for this sidecar's answer"
                        )
                        # Answered once it exited: `error` only if it never read the fd.
                        child.fail_message = message
                        self._stop_child(child)
                        if volume is not None:
                            volume.child = None
                            self._failed(volume, message, now)
                continue
            # The child exited on its own.
            self._drain(child)
            how = f"exit status {code}" if code >= 0 else f"killed by {_signame(-code)}"
            if child.served_since is None:
                message = child.error or f"objfs mount stopped ({how}) before serving"
                child.fail_message = message
            self._reap(child)
            if volume is None:
                continue
            volume.child = None
            if child.served_since is None:
                self._failed(volume, message, now)
            else:
                served = now - child.served_since
                if served >= _HEALTHY_AFTER_S:
                    volume.backoff = _BACKOFF_MIN_S
                message = f"objfs serving {child.source} stopped after {served:.0f} s ({how})"
                if child.error:
                    message += f": {child.error}"
                # The connection is closed: the node plugin mounts afresh on the next offer.
                self._failed(volume, message, now)

    def _drain(self, child: _Child) -> None:
        pipe = child.proc.stderr
        if pipe is not None and not pipe.closed:
            for _ in range(64):
                if pipe.closed:
                    break
                self._forward(child)

    def _stop_child(self, child: _Child) -> None:
        if child.stop_deadline is None:
            child.stop_deadline = time.monotonic() + STOP_TIMEOUT_S
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)

    def _reap(self, child: _Child) -> None:
        """The child is gone: close its connection (end of file for the node plugin)."""
        child.proc.wait()
        pipe = child.proc.stderr
        if pipe is not None and not pipe.closed:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(pipe)
            pipe.close()
        if not child.offer.answered:
            if child.fd_untouched():
                child.offer.fail(child.fail_message)
            else:
                # It may have read the kernel's INIT request: that fd is spoiled. No answer,
                # so the node plugin drops it and offers a fresh mount next time.
                log.info(
                    "%s: objfs (pid %d) set up its FUSE session but did not serve: closing "
                    "without an answer, for a fresh mount",
                    child.name,
                    child.proc.pid,
                )
        child.offer.close()
        shutil.rmtree(child.run_dir, ignore_errors=True)
        if child in self.children:
            self.children.remove(child)

    def _shutdown(self) -> None:
        for child in self.children:
            self._stop_child(child)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in list(self.children):
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s: objfs (pid %d) did not stop: killing it", child.name, child.proc.pid
                )
                child.proc.kill()
                child.proc.wait()
            self._drain(child)
            self._reap(child)
        for volume in self.volumes.values():
            volume.child = None

    # -- state files -------------------------------------------------------------------------

    def _write_state(self) -> None:
        ready = self._polled and all(
            (v.child is not None and v.child.served_since is not None) or v.idle
            for v in self.volumes.values()
        )
        ready_path = os.path.join(self.state_dir, READY_FILE)
        if ready != self._ready:
            try:
                if ready:
                    _write_atomic(ready_path, f"{os.getpid()}\n")
                    log.info("every offered volume is served")
                else:
                    self._remove(ready_path)
                self._ready = ready
            except OSError as exc:
                log.warning("cannot write %s: %s", ready_path, exc.strerror)
        now = time.time()
        if now - self._last_status < _STATUS_INTERVAL_S:
            return
        self._last_status = now
        volumes: dict[str, Any] = {}
        for volume in self.volumes.values():
            child = volume.child
            state = "idle" if volume.idle else "waiting"
            if child is not None:
                state = "serving" if child.served_since is not None else "starting"
            elif volume.error:
                state = "failed"
            volumes[volume.name] = {
                **volume.info,
                "state": state,
                "pid": None if child is None else child.proc.pid,
                "error": volume.error or None,
                "offers_taken": volume.taken,
            }
        data = {
            "kind": STATUS_KIND,
            "format": 1,
            "pid": os.getpid(),
            "fd_dir": self.fd_dir,
            "updated_at": now,
            "ready": ready,
            "volumes": volumes,
        }
        try:
            _write_atomic(os.path.join(self.state_dir, STATUS_FILE), json.dumps(data) + "\n")
        except OSError as exc:
            log.warning("cannot write the status file in %s: %s", self.state_dir, exc.strerror)

    @staticmethod
    def _remove(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _hung_up(offer: fdpass.Offer) -> bool:
    """True if the node plugin closed the connection (it gave up waiting for an answer)."""
    try:
        return offer.conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _check_dir(path: str, what: str) -> str:
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UsageError(f"{what} {path} is not a directory: give the pod's objfs-fd emptyDir")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(
            f"{what} {path} is not writable by uid {os.geteuid()}: give the pod an fsGroup or "
            "run the sidecar as a user that can write it"
        )
    return path


def run_fd_sidecar(fd_dir: str) -> int:
    """The ``objfs sidecar --fd-dir DIR`` command; raises UsageError for a bad DIR."""
    level = (os.environ.get("OBJFS_LOG_LEVEL") or "info").lower()
    log_format = (os.environ.get("OBJFS_LOG_FORMAT") or "text").lower()
    if level not in ("debug", "info", "warning", "error") or log_format not in ("text", "json"):
        raise UsageError(
            "OBJFS_LOG_LEVEL must be debug, info, warning or error; OBJFS_LOG_FORMAT text or json"
        )
    fd_dir = _check_dir(fd_dir, "--fd-dir")
    state_dir = _check_dir(os.environ.get(STATE_DIR_ENV) or fd_dir, STATE_DIR_ENV)
    setup_logging(level, None, daemon=False, log_format=log_format)
    return FdSidecar(fd_dir, state_dir, level, log_format).run()
