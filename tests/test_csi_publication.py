"""The CSI publication's state machine (objfs.csi.publication), without mounts: every change
listed in TRANSITIONS goes through ``Publication.become``, every other one fails its
assertion, the node plugin's fd is held exactly while WAITING, and STOPPED is final."""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest

from objfs.csi.publication import INITIAL, TRANSITIONS, Publication, State
from objfs.csi.volume import POD_UID_KEY, parse_volume_context

TARGET = "/k/pods/0b7c3c5e-1f2a-4d8e-9a6b-2c4d6e8f0a1b/volumes/kubernetes.io~csi/m/mount"


def publication(state: State = State.NEW) -> Publication:
    context = {POD_UID_KEY: "0b7c3c5e-1f2a-4d8e-9a6b-2c4d6e8f0a1b", "source": "s3://bucket-a"}
    spec = parse_volume_context(context, TARGET)
    return Publication(
        volume_id="vol-a",
        target=TARGET,
        spec=spec,
        config=dataclasses.replace(spec.config, mountpoint=TARGET),
        fd_dir="/k/pods/x/volumes/kubernetes.io~empty-dir/objfs-fd",
        sock_name="vol-a.sock",
        state=state,
    )


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def reach(state: State) -> Publication:
    """A publication brought to ``state`` by allowed changes only."""
    paths = {
        State.NEW: [],
        State.UNKNOWN: [],
        State.WAITING: [State.WAITING],
        State.SERVED: [State.WAITING, State.SERVED],
        State.DEAD: [State.WAITING, State.DEAD],
        State.STOPPED: [State.WAITING, State.STOPPED],
    }
    pub = publication(State.UNKNOWN if state is State.UNKNOWN else State.NEW)
    for step in paths[state]:
        fd = os.open(os.devnull, os.O_RDONLY) if step is State.WAITING else -1
        assert pub.become(step, fd)
    assert pub.state is state
    return pub


def test_every_state_has_its_transitions_listed() -> None:
    assert set(TRANSITIONS) == set(State)
    assert {State.NEW, State.UNKNOWN} == INITIAL
    assert TRANSITIONS[State.STOPPED] == frozenset()


@pytest.mark.parametrize(
    ("old", "new"), list(itertools.product(State, State)), ids=lambda s: s.value
)
def test_become_allows_exactly_the_listed_transitions(old: State, new: State) -> None:
    pub = reach(old)
    held = pub.fd
    fd = os.open(os.devnull, os.O_RDONLY) if new is State.WAITING else -1
    try:
        if old is State.STOPPED:
            assert not pub.become(new, fd)  # final: a late change is dropped
            assert pub.state is State.STOPPED
        elif new in TRANSITIONS[old]:
            assert pub.become(new, fd)
            assert pub.state is new
            # The fd is the node plugin's exactly while WAITING; leaving WAITING closes it.
            assert (pub.fd >= 0) == (new is State.WAITING)
            if held >= 0:
                assert not fd_open(held)
        else:
            with pytest.raises(AssertionError, match=f"{old.value} -> {new.value}"):
                pub.become(new, fd)
            assert pub.state is old
            assert pub.fd == held
    finally:
        if pub.fd != fd and fd >= 0:
            os.close(fd)
        pub.release()
    assert pub.state is State.STOPPED
    assert pub.fd == -1


def test_a_publication_starts_new_or_unknown() -> None:
    for state in set(State) - INITIAL:
        with pytest.raises(AssertionError):
            publication(state)


def test_waiting_needs_an_fd_and_nothing_else_takes_one() -> None:
    pub = publication()
    with pytest.raises(AssertionError):
        pub.become(State.WAITING)
    fd = os.open(os.devnull, os.O_RDONLY)
    assert pub.become(State.WAITING, fd)
    assert pub.fd == fd
    other = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(AssertionError):
            pub.become(State.SERVED, other)
    finally:
        os.close(other)
    pub.release()
    assert not fd_open(fd)


def test_an_fd_changed_behind_become_fails_the_next_change() -> None:
    pub = publication()
    pub.fd = 7  # as code that bypassed become would
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(AssertionError):
            pub.become(State.WAITING, fd)
    finally:
        os.close(fd)
    assert pub.fd == 7


def test_a_failed_watch_leaves_the_target_to_be_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Watching a served target can fail (tune_kernel's OSError): the publication is then DEAD,
    so the next sidecar that connects gets a fresh mount, never a SERVED one nobody watches."""
    from objfs.csi import offers

    pub = reach(State.WAITING)
    monkeypatch.setattr(offers.fdpass, "send_offer", lambda conn, fd, payload: None)
    monkeypatch.setattr(offers.fdpass, "read_reply", lambda conn, timeout: None)

    def watch(self: object, pub: Publication, conn: object) -> None:
        raise OSError("no /sys/fs/fuse/connections")

    monkeypatch.setattr(offers.Offers, "_watch", watch)
    offers.Offers()._offer(pub, conn=None)  # type: ignore[arg-type]
    assert pub.state is State.DEAD
    assert pub.fd == -1
