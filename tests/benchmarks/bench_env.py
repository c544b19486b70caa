"""The benchmark's environment: data, servers, FUSE mounts, page-cache control, machine facts.

Everything runs on 127.0.0.1. Servers and mounts are child processes of the benchmark, stopped
by their PIDs and unmounted in ``finally`` blocks; nothing here contacts any other address.

* Data: a Llama-shaped model (random bf16 weights with the real tensor names and shapes, two
  safetensors shards with an index, config, generation config and tokenizer files) and 1,000
  small objects, generated offline once and cached under ``.bench/data/``.
* s3rver (npm, installed by ``make bench`` into ``.npm-tools/s3rver``) with its data on
  ``/dev/shm``, so dropping the page cache never slows the "remote" store down.
* The shaping proxy (``tests/helpers/proxy.py``) in a child process of its own
  (``bench_proxy.py``), so the loader's Python never competes with it for the GIL.
* Mounts: objfs, s3fs-fuse, rclone and the binding ceiling (``binding_ceiling.py``, the model
  served from memory by a minimal pyfuse3 file system), each in the foreground as a child
  process, so its PID (for CPU seconds and peak RSS) is known.
* Bytes served: s3rver's own write counter (``S3rver.bytes_sent``), no proxy in the way.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from objfs.demo import free_port
from objfs.mountinfo import mount_entry

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
S3RVER_BIN = REPO / ".npm-tools" / "s3rver" / "node_modules" / ".bin" / "s3rver"
RUNAI_SITE = REPO / ".bench" / "runai-site"

MiB = 1 << 20
# s3rver's fixed credentials: it checks signatures against these unless told otherwise.
S3_KEY = "S3RVER"
S3_SECRET = "S3RVER"
MODEL_BUCKET = "bench-model"
SMALL_BUCKET = "bench-small"
SMALL_PREFIX = "objects"  # one level deep: s3rver mis-lists prefixes two or more levels down
RANDOM_KEY = "random.bin"  # a non-safetensors object for random reads (no whole-file prefetch)

# The environment every S3 client here gets: explicit keys for the local server, no config
# files, no instance metadata, no profile.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": S3_KEY,
    "AWS_SECRET_ACCESS_KEY": S3_SECRET,
    "AWS_CONFIG_FILE": "/nonexistent/objfs-bench-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/objfs-bench-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
_DROP_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ROLE_ARN")


def setup_process_env() -> None:
    """Make this process (and its children) talk only to the local servers, offline."""
    for name in _DROP_ENV:
        os.environ.pop(name, None)
    os.environ.update(AWS_ENV)
    os.environ.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )


# -- data --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """Llama architecture sizes; ``full`` is TinyLlama-1.1B's shape (2.2 GB in bf16)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 32000

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        kv = self.hidden // self.heads * self.kv_heads
        out: list[tuple[str, tuple[int, ...]]] = [
            ("model.embed_tokens.weight", (self.vocab, self.hidden))
        ]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (self.hidden,)),
                (p + "self_attn.q_proj.weight", (self.hidden, self.hidden)),
                (p + "self_attn.k_proj.weight", (kv, self.hidden)),
                (p + "self_attn.v_proj.weight", (kv, self.hidden)),
                (p + "self_attn.o_proj.weight", (self.hidden, self.hidden)),
                (p + "post_attention_layernorm.weight", (self.hidden,)),
                (p + "mlp.gate_proj.weight", (self.intermediate, self.hidden)),
                (p + "mlp.up_proj.weight", (self.intermediate, self.hidden)),
                (p + "mlp.down_proj.weight", (self.hidden, self.intermediate)),
            ]
        out += [
            ("model.norm.weight", (self.hidden,)),
            ("lm_head.weight", (self.vocab, self.hidden)),
        ]
        return out


FULL_MODEL = ModelSpec("llama-1.1b", 2048, 5632, 22, 32, 4)
QUICK_MODEL = ModelSpec("llama-130m", 1024, 2816, 6, 16, 4)
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SMALL_COUNT = 1000


def _config_json(spec: ModelSpec) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "objfs mounts a bucket as a read only directory so model loaders read real files"
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *sorted(set(words.split()))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 2048,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2)
    )


def build_model(spec: ModelSpec, root: Path) -> Path:
    """Write ``spec``'s model under ``root/spec.name`` unless a complete copy is there."""
    out = root / spec.name
    marker = out / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == spec.__dict__:
        return out
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tensors = spec.tensors()
    # Split where the running byte count passes half: two shards of about equal size.
    total = sum(2 * _numel(shape) for _, shape in tensors)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[], []]
    running = 0
    for name, shape in tensors:
        shards[0 if running < total / 2 else 1].append((name, shape))
        running += 2 * _numel(shape)
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    print(f"generating {spec.name}: {total / 1e9:.2f} GB in {len(tensors)} tensors", flush=True)
    for shard_name, items in zip(SHARDS, shards, strict=True):
        data = {}
        for name, shape in items:
            if len(shape) == 1:
                data[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.float32)
                t.normal_(0.0, 0.02, generator=gen)
                data[name] = t.to(torch.bfloat16)
            weight_map[name] = shard_name
        save_file(data, str(out / shard_name), metadata={"format": "pt"})
        del data
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(_config_json(spec), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2)
    )
    _write_tokenizer(out)
    marker.write_text(json.dumps(spec.__dict__))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_small(root: Path, random_bytes: int) -> Path:
    """1,000 small objects (200 B to 8 KiB) under ``objects/`` and one ``random.bin``."""
    out = root / f"small-{SMALL_COUNT}-{random_bytes >> 20}m"
    marker = out / ".complete"
    if marker.exists():
        return out
    import random

    shutil.rmtree(out, ignore_errors=True)
    (out / SMALL_PREFIX).mkdir(parents=True)
    rng = random.Random(0)
    for i in range(SMALL_COUNT):
        data = rng.randbytes(rng.randint(200, 8192))
        (out / SMALL_PREFIX / f"obj-{i:04d}.json").write_bytes(data)
    with open(out / RANDOM_KEY, "wb") as f:
        for _ in range(random_bytes // (16 * MiB)):
            f.write(os.urandom(16 * MiB))
    marker.write_text("ok")
    return out


def local_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != ".complete")


# -- page cache ----------------------------------------------------------------------------------


class PageCache:
    """Drops the page cache: ``drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` per file."""

    def __init__(self) -> None:
        self.method = "drop_caches"
        try:
            self._drop_all()
        except OSError as exc:
            self.method = f"posix_fadvise(POSIX_FADV_DONTNEED) per file ({exc.strerror})"

    @staticmethod
    def _drop_all() -> None:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    def drop(self, files: Sequence[str | Path] = ()) -> None:
        if self.method == "drop_caches":
            self._drop_all()
            return
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(name, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


# How long freed memory stays with the guest on a VM with free page reporting (virtio-balloon:
# the guest reports free 2 MiB blocks to the host about 2 s after they were freed, and the
# host discards them); 4 s is past that.
HOST_RECLAIM_WAIT_S = 4.0
PAGE_SIZE = mmap.PAGESIZE


def touch_and_free(nbytes: int) -> None:
    """Write one byte per page of ``nbytes`` of new anonymous memory, then free it: the kernel
    hands those pages out next (the page cache's new pages among them) while they are still
    backed by the host."""
    if nbytes <= 0:
        return
    m = mmap.mmap(-1, nbytes)
    try:
        m[::PAGE_SIZE] = b"\1" * len(range(0, nbytes, PAGE_SIZE))
    finally:
        m.close()


def settle_page_cache(cache: PageCache, backed_bytes: int) -> None:
    """Drop the page cache and wait until a VM's host has taken the freed memory back (the
    state of a machine that has been up a while); then, if ``backed_bytes``, write and free
    that much memory so the next load's first new pages do not fault in the host."""
    cache.drop()
    time.sleep(HOST_RECLAIM_WAIT_S)
    touch_and_free(backed_bytes)


def machine_cpu() -> tuple[float, float]:
    """CPU seconds the whole machine spent busy (/proc/stat's cpu line: user, nice, system,
    irq, softirq), and those stolen by the hypervisor (steal: the host ran something else)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    clk = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / clk, v[7] / clk


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process ``pid``, its reaped children
    excluded."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_reported_mib() -> float | None:
    """MiB of free memory this guest has reported to its host so far (virtio-balloon free
    page reporting: the host takes such memory back, and the next write to it faults in the
    host); None where the kernel has no such counter. Only read, never changed."""
    try:
        kib = Path("/sys/module/page_reporting/parameters/reported_kib").read_text()
    except OSError:
        return None
    return int(kib) / 1024


def first_touch_s_per_gb(nbytes: int = 1 << 30) -> tuple[float, float]:
    """CPU seconds per GB to write one byte per page of new anonymous memory: (after the
    host took the machine's free memory back, right after the same amount was written and
    freed). On bare metal both are a few hundredths; on a VM whose freed memory goes back
    to the host, the first is the cost of a host page fault per page, which any cold load
    pays for the page cache it fills (in a FUSE mount, in the daemon's reply copy)."""
    out = []
    for backed in (False, True):
        time.sleep(HOST_RECLAIM_WAIT_S)
        if backed:
            touch_and_free(nbytes)
        start = time.process_time()
        touch_and_free(nbytes)
        out.append((time.process_time() - start) / (nbytes / 1e9))
    return out[0], out[1]


# -- servers ---------------------------------------------------------------------------------------


@dataclass
class Child:
    """A child process we started; ``stop()`` ends it by its PID."""

    proc: subprocess.Popen[bytes]
    log: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class S3rver(Child):
    port: int = 0
    data_dir: Path = field(default_factory=Path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
        super().stop(sig, timeout_s)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def bytes_sent(self) -> int:
        """Bytes the server process has written with write(2)/writev(2) (``wchar`` in
        /proc/PID/io): its responses, headers included, as Node writes sockets with those.

        Once the data is uploaded nothing else is written (it runs ``--silent``, its data is
        read, not written): the difference over a measure is what the server sent, counted
        without a proxy in the way (checked against boto3 GETs: within 0.1%).
        """
        with open(f"/proc/{self.pid}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "wchar":
                    return int(value)
        raise RuntimeError(f"no wchar in /proc/{self.pid}/io")


def start_s3rver(log: Path) -> S3rver:
    """s3rver on a free loopback port, its data on /dev/shm; waits until it answers."""
    if not os.access(S3RVER_BIN, os.X_OK):
        raise RuntimeError(f"s3rver is not installed at {S3RVER_BIN}: run `make bench`")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    data_dir = Path(tempfile.mkdtemp(prefix="objfs-bench-s3rver-", dir=shm))
    port = free_port()
    env = {**os.environ, "NODE_OPTIONS": "--openssl-legacy-provider"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(S3RVER_BIN), "-d", str(data_dir), "-a", "127.0.0.1", "-p", str(port), "--silent"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = S3rver(proc, log, port, data_dir)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"s3rver exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(server.url + "/", timeout=2):
                return server
        except urllib.error.HTTPError:
            return server  # an S3 error document: it is up
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"s3rver did not answer in 30 s; see {log}") from None
            time.sleep(0.1)


def s3_client(url: str, pool: int = 32) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        config=Config(
            max_pool_connections=pool,
            s3={"addressing_style": "path"},
            retries={"max_attempts": 3, "mode": "standard"},
        ),
    )


def upload_tree(client: Any, local: Path, bucket: str, threads: int = 8) -> None:
    """Upload every file under ``local`` to ``bucket`` (keys relative to ``local``)."""
    from concurrent.futures import ThreadPoolExecutor

    # A second upload to one bucket: s3rver answers BucketAlreadyExists, S3 ...OwnedByYou.
    with contextlib.suppress(
        client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists
    ):
        client.create_bucket(Bucket=bucket)

    def put(path: Path) -> None:
        with open(path, "rb") as f:
            client.put_object(Bucket=bucket, Key=path.relative_to(local).as_posix(), Body=f)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, local_files(local)))


@dataclass
class ProxyProc(Child):
    """The shaping proxy in its own process; ``stats()`` / ``reset()`` over its stdin."""

    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def stats(self) -> dict[str, Any]:
        return self._ask("stats")

    def reset(self) -> None:
        self._ask("reset")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        super().stop(sig, timeout_s)


def start_proxy(upstream_port: int, first_byte_delay_s: float, bytes_per_s: float) -> ProxyProc:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.benchmarks.bench_proxy",
            str(upstream_port),
            str(first_byte_delay_s),
            str(bytes_per_s),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the shaping proxy did not start")
    return ProxyProc(proc, None, int(json.loads(line)["port"]))


# -- mounts ----------------------------------------------------------------------------------------


class MountError(RuntimeError):
    pass


@dataclass
class MountProc(Child):
    """A FUSE file system served by a foreground child process."""

    path: Path = field(default_factory=Path)
    name: str = ""

    def cpu_s(self) -> float:
        """CPU seconds (user + system) of the server: all its threads, its live children and
        the children it has waited for."""
        import psutil

        try:
            proc = psutil.Process(self.pid)
            t = proc.cpu_times()
            total = t.user + t.system + t.children_user + t.children_system
            children = proc.children(recursive=True)
        except psutil.Error:
            return float("nan")
        for child in children:
            with contextlib.suppress(psutil.Error):
                c = child.cpu_times()
                total += c.user + c.system
        return float(total)

    def thread_cpu_s(self) -> dict[int, float]:
        """CPU seconds (user + system) of each of the server's threads now, by thread id."""
        import psutil

        try:
            return {t.id: t.user_time + t.system_time for t in psutil.Process(self.pid).threads()}
        except psutil.Error:
            return {}

    def peak_rss_mib(self) -> float:
        return self._status_mib("VmHWM")

    def rss_mib(self) -> float:
        """The daemon's resident memory now."""
        return self._status_mib("VmRSS")

    def _status_mib(self, field: str) -> float:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def unmount(self) -> None:
        if mount_entry(str(self.path)) is not None:
            subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True, check=False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if mount_entry(str(self.path)) is not None:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        self.stop(timeout_s=10)


@contextlib.contextmanager
def mounted(
    name: str, cmd: list[str], path: Path, log: Path, env: dict[str, str | None] | None = None
) -> Iterator[MountProc]:
    """Run ``cmd`` (a foreground FUSE server for ``path``) until ``path`` is mounted.

    ``env`` is added to this process's environment; a ``None`` value removes that variable.
    """
    child_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    path.mkdir(parents=True, exist_ok=True)
    if mount_entry(str(path)) is not None:
        raise MountError(f"{path} is already mounted")
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
        )
    m = MountProc(proc, log, path, name)
    try:
        deadline = time.monotonic() + 60
        while mount_entry(str(path)) is None:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise MountError(f"{name} exited with {proc.returncode} before mounting:\n{tail}")
            if time.monotonic() > deadline:
                raise MountError(f"{name} did not mount {path} in 60 s; see {log}")
            time.sleep(0.02)
        yield m
    finally:
        m.unmount()


def objfs_cmd(
    source: str, path: Path, cache_dir: Path | None, log_file: Path, extra: Sequence[str] = ()
) -> list[str]:
    cache = [] if cache_dir is None else ["--cache-dir", str(cache_dir)]
    return [
        str(VENV_BIN / "objfs"),
        "mount",
        source,
        str(path),
        "--foreground",
        *cache,
        "--log-file",
        str(log_file),
        *extra,
    ]


def binding_ceiling_cmd(src: Path, path: Path, transport: str = "pyfuse3") -> list[str]:
    """The memory-backed file system (``binding_ceiling.py``) serving ``src`` through
    ``transport`` (pyfuse3, or objfs's own: kernel)."""
    return [
        sys.executable,
        "-m",
        "tests.benchmarks.binding_ceiling",
        str(src),
        str(path),
        "--transport",
        transport,
    ]


def binding_ceiling_env() -> dict[str, str | None]:
    """What ``binding_ceiling_cmd`` adds to the environment (see ``mounted``): the repository
    ahead of any ``PYTHONPATH``, so ``tests.benchmarks`` imports from any working folder."""
    return {
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    }


def fuse_tuning(path: Path) -> dict[str, int]:
    """The kernel's settings for the FUSE mount at ``path``: the bdi's ``read_ahead_kb`` and
    the connection's ``max_background`` and ``congestion_threshold`` (what objfs tunes).

    The mount's major:minor comes from /proc/self/mountinfo, so the mount itself is never
    touched; a setting that cannot be read is left out.
    """
    target = str(path.parent.resolve() / path.name)
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == target:
                dev = fields[2]
    if dev is None:
        return {}
    major, minor = (int(x) for x in dev.split(":"))
    files = {
        "read_ahead_kb": f"/sys/class/bdi/{major}:{minor}/read_ahead_kb",
        "max_background": f"/sys/fs/fuse/connections/{(major << 20) | minor}/max_background",
        "congestion_threshold": (
            f"/sys/fs/fuse/connections/{(major << 20) | minor}/congestion_threshold"
        ),
    }
    out: dict[str, int] = {}
    for key, name in files.items():
        with contextlib.suppress(OSError, ValueError):
            out[key] = int(Path(name).read_text())
    return out


def s3fs_cmd(
    bucket: str, path: Path, url: str, passwd_file: Path, parallel: int, part_mib: int
) -> list[str]:
    options = [
        "ro",
        f"passwd_file={passwd_file}",
        f"url={url}",
        "use_path_request_style",
        "endpoint=us-east-1",
        f"parallel_count={parallel}",
        f"multipart_size={part_mib}",
    ]
    return ["s3fs", bucket, str(path), "-f", "-o", ",".join(options)]


def rclone_s3_remote(url: str, bucket: str) -> str:
    return (
        ":s3,provider=Other,env_auth=false,"
        f"access_key_id={S3_KEY},secret_access_key={S3_SECRET},"
        f"endpoint='{url}',force_path_style=true:{bucket}"
    )


def rclone_cmd(remote: str, path: Path, cache_mode: str, cache_dir: Path, log: Path) -> list[str]:
    return [
        "rclone",
        "mount",
        remote,
        str(path),
        "--read-only",
        "--config",
        "/dev/null",
        "--vfs-cache-mode",
        cache_mode,
        "--cache-dir",
        str(cache_dir),
        "--log-file",
        str(log),
    ]


def rclone_env() -> dict[str, str | None]:
    """rclone 1.60 fails on this machine's AWS_CA_BUNDLE: the variable is removed for it only."""
    return {"AWS_CA_BUNDLE": None}


# -- machine facts ---------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def version(cmd: list[str]) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
        except OSError:
            return "missing"
        text = (out.stdout or out.stderr).strip()
        return text.splitlines()[0] if text else "?"

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "objfs"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "objfs_commit": commit + (" with uncommitted changes in objfs/" if dirty else ""),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "node": version(["node", "--version"]),
        "s3fs": version(["s3fs", "--version"]),
        "rclone": version(["rclone", "version"]),
    }
