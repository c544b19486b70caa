"""objfs.options: one declaration of the options, one translation, one spelling of a boolean.

Every front end (fstab helper, environment sidecar, fd sidecar, CSI volume) reaches exactly the
options of ``objfs mount`` that are not command-line only, and each takes a flag as ``true`` or
``false`` and nothing else.
"""

from __future__ import annotations

import argparse

import pytest

from objfs.config import TRANSPORT_ENV
from objfs.csi.volume import NOT_HERE, VolumeContextError, parse_volume_context
from objfs.errors import UsageError
from objfs.mount_helper import FLAG_OPTIONS as FSTAB_FLAGS
from objfs.mount_helper import VALUE_OPTIONS as FSTAB_VALUES
from objfs.options import (
    COMMAND_LINE_ONLY,
    build_parser,
    flag_arguments,
    is_flag,
    mount_arguments,
    mount_options,
    mount_parser,
    parse_boolean,
)
from objfs.sidecar import FLAG_OPTIONS as ENV_FLAGS
from objfs.sidecar import READ_ELSEWHERE, sidecar_command
from objfs.sidecar import VALUE_OPTIONS as ENV_VALUES
from objfs.sidecar_fd import mount_arguments as offer_arguments

POD = {"csi.storage.k8s.io/pod.uid": "0f1e2d3c-aaaa-bbbb-cccc-000000000001"}
TARGET = "/k/pods/x/volumes/kubernetes.io~csi/m/mount"


def long_options() -> set[str]:
    return {
        option[2:]
        for action in mount_parser()._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def test_mount_options_are_the_parsers_less_the_command_line_only() -> None:
    names = set(mount_options())
    assert names == long_options() - COMMAND_LINE_ONLY
    assert {"endpoint-url", "cache-dir", "allow-other", "no-force-path-style"} <= names
    assert is_flag("allow-other")
    assert not is_flag("cache-dir")
    # The full parser's mount command is the same one.
    args = build_parser().parse_args(["mount", "s3://b", "/m", "--cache-dir", "/c"])
    assert args.cache_dir == "/c"


def test_every_front_end_reaches_every_mount_option() -> None:
    names = set(mount_options())
    fstab = {flag[2:] for flag in [*FSTAB_VALUES.values(), *FSTAB_FLAGS.values()]}
    assert fstab == names
    env = {flag[2:] for flag in ENV_VALUES.values()} | set(ENV_FLAGS.values())
    assert env == names - READ_ELSEWHERE
    assert set(ENV_VALUES) | set(ENV_FLAGS) == {
        "OBJFS_" + n.upper().replace("-", "_") for n in names - READ_ELSEWHERE
    }
    # A variable objfs reads by itself keeps its one meaning.
    assert TRANSPORT_ENV == "OBJFS_FUSE_TRANSPORT"
    assert TRANSPORT_ENV not in ENV_VALUES
    # A CSI volume takes them all but those it has a reason to refuse.
    assert set(NOT_HERE) >= COMMAND_LINE_ONLY


@pytest.mark.parametrize(("text", "truth"), [("true", True), (" TRUE ", True), ("False", False)])
def test_a_boolean_is_true_or_false(text: str, truth: bool) -> None:
    assert parse_boolean(text, "x") is truth


@pytest.mark.parametrize("text", ["1", "0", "yes", "no", "on", "off", "", "maybe"])
def test_no_other_spelling_of_a_boolean(text: str) -> None:
    with pytest.raises(UsageError, match=r"^allow-other is a flag: give true or false$"):
        parse_boolean(text, "allow-other is a flag")


@pytest.mark.parametrize("text", ["1", "yes", "on"])
def test_every_front_end_refuses_another_spelling(text: str) -> None:
    with pytest.raises(UsageError, match="is a flag"):
        offer_arguments("s3://b/p", {"allow-other": text})
    with pytest.raises(VolumeContextError, match="is a flag"):
        parse_volume_context({**POD, "source": "s3://bucket-a", "no-sign-request": text}, TARGET)
    env = {"OBJFS_SOURCE": "s3://b", "OBJFS_MOUNTPOINT": "/m", "OBJFS_ALLOW_OTHER": text}
    with pytest.raises(UsageError, match="is not a boolean"):
        sidecar_command(env)


def test_flags_and_their_other_form() -> None:
    assert flag_arguments("allow-other", True) == ["--allow-other"]
    assert flag_arguments("allow-other", False) == []
    assert flag_arguments("force-path-style", False) == ["--no-force-path-style"]
    assert flag_arguments("no-force-path-style", False) == ["--force-path-style"]
    assert isinstance(mount_options()["force-path-style"], argparse.BooleanOptionalAction)


def test_mount_arguments_translate_once() -> None:
    argv = mount_arguments({"region": "eu-west-1", "allow-other": "true", "cache-dir": "-x"})
    assert argv == ["--allow-other", "--cache-dir=-x", "--region=eu-west-1"]
    args = build_parser().parse_args(["mount", "s3://b", "/m", *argv])
    assert (args.allow_other, args.cache_dir, args.region) == (True, "-x", "eu-west-1")
    for bad in ({"foreground": "true"}, {"help": "true"}, {"bogus": "1"}):
        with pytest.raises(UsageError, match="unknown option"):
            mount_arguments(bad)
    # The same flags the same way from the environment sidecar and from a volume.
    env = {"OBJFS_SOURCE": "s3://b", "OBJFS_MOUNTPOINT": "/m", "OBJFS_FORCE_PATH_STYLE": "false"}
    assert sidecar_command(env)[2] == ["--no-force-path-style"]
    spec = parse_volume_context(
        {**POD, "source": "s3://bucket-a", "force-path-style": "false"}, TARGET
    )
    assert spec.options == {"no-force-path-style": "true"}
    assert spec.config.s3.force_path_style is False
