"""One published target and its states, from NodePublishVolume to NodeUnpublishVolume.

A :class:`Publication` is in one :class:`State` at a time; :data:`TRANSITIONS` lists the
changes allowed, and :meth:`Publication.become` is the only code that makes one (it asserts
the change is listed). The fd field follows the state: the node plugin holds a ``/dev/fuse``
fd exactly while the publication is WAITING, and every change away from WAITING closes it.
The bounds on how long a mount waits and how often it is replaced are here too; the thread
that drives the changes is :mod:`objfs.csi.offers`.
"""

from __future__ import annotations

import enum
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from objfs.config import MountConfig
from objfs.csi.fusemount import close_quietly
from objfs.csi.volume import VolumeSpec

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


class CsiError(Exception):
    """A request fails with this gRPC status code; ``str()`` is the one-line message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class State(enum.Enum):
    """Where a publication stands."""

    #: Created by NodePublishVolume, not mounted yet.
    NEW = "new"
    #: Mounted; the node plugin holds the fd and offers it to each sidecar that connects.
    WAITING = "waiting"
    #: A sidecar answered ``ok``: it holds the only fd.
    SERVED = "served"
    #: No fd anywhere the node plugin knows of (the sidecar left, or none answered ``ok`` in
    #: time): the next sidecar that connects gets a fresh mount on top.
    DEAD = "dead"
    #: Found after a restart of the node plugin: a sidecar may still serve it, or not; the
    #: next sidecar that connects gets a fresh mount on top.
    UNKNOWN = "unknown"
    #: Unpublished, or the node plugin is stopping: its offer thread is stopped, nothing
    #: changes any more.
    STOPPED = "stopped"


#: The states a publication starts in: NEW (NodePublishVolume), UNKNOWN (recovery).
INITIAL = frozenset({State.NEW, State.UNKNOWN})
#: The changes :meth:`Publication.become` allows, from each state.
TRANSITIONS: dict[State, frozenset[State]] = {
    # the first mount (or stopped before it)
    State.NEW: frozenset({State.WAITING, State.STOPPED}),
    # the sidecar's ``ok``; the wait limit, or a sidecar gone with the fd unanswered
    State.WAITING: frozenset({State.SERVED, State.DEAD, State.STOPPED}),
    # end of file on the serving sidecar's connection
    State.SERVED: frozenset({State.DEAD, State.STOPPED}),
    # a replacement mount for the next sidecar
    State.DEAD: frozenset({State.WAITING, State.STOPPED}),
    State.UNKNOWN: frozenset({State.WAITING, State.STOPPED}),
    State.STOPPED: frozenset(),
}


@dataclass
class Publication:
    """One published target: its mount, the fd while the node plugin holds it, the offers."""

    volume_id: str
    target: str
    spec: VolumeSpec
    config: MountConfig
    fd_dir: str
    sock_name: str
    #: one of :data:`INITIAL`; changed by :meth:`become` only
    state: State = State.NEW
    #: the fd while WAITING, else -1; changed by :meth:`become` only
    fd: int = field(default=-1, init=False)
    #: time.monotonic() when the current mount started waiting for a sidecar's ``ok``
    waiting_since: float = field(default=0.0, init=False)
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

    def __post_init__(self) -> None:
        assert self.state in INITIAL, f"a publication cannot start {self.state.value}"

    def become(self, new: State, fd: int = -1) -> bool:
        """Changes the state to ``new`` (asserting :data:`TRANSITIONS` allows it): WAITING takes
        ``fd``, the new mount's, and starts its wait; any other state closes the fd held, if
        any. Called under :attr:`lock` once the offer thread runs. Once STOPPED nothing
        changes: a late change from an offer thread that outlived its stop (the join timed
        out) is dropped, and False returned."""
        assert (self.fd >= 0) == (self.state is State.WAITING), (self.state, self.fd)
        if self.state is State.STOPPED:
            return False
        assert new in TRANSITIONS[self.state], f"{self.state.value} -> {new.value}"
        if new is State.WAITING:
            assert fd >= 0, "WAITING needs the mount's fd"
            self.fd = fd
            self.waiting_since = time.monotonic()
        else:
            assert fd < 0, f"{new.value} holds no fd"
            close_quietly(self.fd)
            self.fd = -1
        self.state = new
        return True

    def release(self) -> None:
        """STOPPED: closes the node plugin's fd, if any (after :meth:`Offers.stop
        <objfs.csi.offers.Offers.stop>`, at unpublish and shutdown)."""
        with self.lock:
            self.become(State.STOPPED)

    def payload(self) -> dict[str, Any]:
        return {
            "source": self.spec.source,
            "options": dict(self.spec.options),
            "volume_id": self.volume_id,
            "target_path": self.target,
        }
