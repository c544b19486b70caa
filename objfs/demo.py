"""``make demo``: a local S3 server, a small model, an objfs mount, a transformers load.

Also the home of the helpers the tests share with the demo: starting moto's S3 server on a
free loopback port, building a small Llama-architecture model offline (random weights,
sharded safetensors with an index, a real tokenizer, ``trust_remote_code`` modules) and
uploading a directory. transformers, torch and moto are imported inside functions: they are
development dependencies, not objfs's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_TYPE = "objfs_tiny_llama"

_CONFIGURATION_PY = '''\
"""Configuration of the objfs demo model (loaded with trust_remote_code)."""

from transformers import LlamaConfig


class ObjfsTinyConfig(LlamaConfig):
    model_type = "objfs_tiny_llama"
'''

_MODELING_PY = '''\
"""Modeling code of the objfs demo model (loaded with trust_remote_code)."""

from transformers import LlamaForCausalLM, LlamaModel

from .configuration_objfs_tiny import ObjfsTinyConfig


class ObjfsTinyModel(LlamaModel):
    config_class = ObjfsTinyConfig


class ObjfsTinyForCausalLM(LlamaForCausalLM):
    config_class = ObjfsTinyConfig
'''

_CORPUS = (
    "objfs mounts a bucket as a read only directory so that model loaders read real files "
    "the weights stream from object storage into memory while the tokenizer and the config "
    "come from the same place a second load is served from the local cache at disk speed"
)

PROMPT = "objfs mounts a bucket as a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalServer:
    """A test object store running as a child process on 127.0.0.1."""

    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_moto_server(
    log_path: str | None = None, env: dict[str, str] | None = None
) -> LocalServer:
    """Start moto's S3 server on a free port and wait until it answers (at most 30 s)."""
    port = free_port()
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    if log_path:
        out.close()  # type: ignore[union-attr]
    server = LocalServer(f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{server.url}/moto-api/", timeout=2):
                return server
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError("moto server did not start within 30 s") from None
            time.sleep(0.1)


def s3_client(endpoint_url: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        config=Config(max_pool_connections=16, s3={"addressing_style": "path"}),
    )


def upload_dir(client: Any, local: Path, bucket: str, prefix: str) -> dict[str, str]:
    """Upload every file under ``local`` to ``bucket/prefix``; returns {relpath: sha256}."""
    files = sorted(p for p in local.rglob("*") if p.is_file())

    def put(path: Path) -> tuple[str, str]:
        rel = path.relative_to(local).as_posix()
        data = path.read_bytes()
        client.put_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/{rel}".lstrip("/"), Body=data)
        return rel, hashlib.sha256(data).hexdigest()

    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(put, files))


def build_tiny_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Write a small Llama-architecture model with trust_remote_code modules to ``out_dir``.

    Random weights (seeded), sharded safetensors with ``model.safetensors.index.json``, a
    word-level tokenizer built with the ``tokenizers`` package, and ``auto_map`` entries that
    point at ``configuration_objfs_tiny.py`` / ``modeling_objfs_tiny.py``. Runs offline.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    words = sorted(set(_CORPUS.split()))
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: a size vLLM's CPU attention supports
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)  # large enough that greedy decoding is not all one token
    # Small shards so the model has several files and an index json, like a real checkpoint.
    model.save_pretrained(out_dir, max_shard_size="200KB", safe_serialization=True)

    (out_dir / "configuration_objfs_tiny.py").write_text(_CONFIGURATION_PY)
    (out_dir / "modeling_objfs_tiny.py").write_text(_MODELING_PY)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = MODEL_TYPE
    cfg["architectures"] = ["ObjfsTinyForCausalLM"]
    cfg["auto_map"] = {
        "AutoConfig": "configuration_objfs_tiny.ObjfsTinyConfig",
        "AutoModel": "modeling_objfs_tiny.ObjfsTinyModel",
        "AutoModelForCausalLM": "modeling_objfs_tiny.ObjfsTinyForCausalLM",
    }
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def load_and_generate(path: str | Path, *, new_tokens: int = 8) -> tuple[Any, list[int], str]:
    """Load tokenizer and model from ``path`` (trust_remote_code) and greedily generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True)
    model.eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    tokens: list[int] = out[0, inputs["input_ids"].shape[1] :].tolist()
    return model, tokens, str(tokenizer.decode(tokens))


# -- the demo itself ------------------------------------------------------------------------


@contextlib.contextmanager
def _step(title: str) -> Iterator[None]:
    print(f"==> {title} ...", flush=True)
    start = time.perf_counter()
    yield
    print(f"    done in {time.perf_counter() - start:.2f} s", flush=True)


def _objfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "objfs", *args], capture_output=True, text=True, check=False
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "objfs-demo")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "objfs-demo")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="objfs-demo-"))
    os.environ["HF_HOME"] = str(work / "hf-home")
    mountpoint = work / "mnt"
    mountpoint.mkdir()
    server: LocalServer | None = None
    mounted = False
    # Ctrl-C or a TERM: clean up the same way as a normal exit.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with _step("starting a local S3 server (moto)"):
            server = start_moto_server(str(work / "moto.log"))
            print(f"    {server.url}")
        with _step("building a small Llama-architecture model with trust_remote_code files"):
            model_dir = build_tiny_model(work / "model")
            size = sum(p.stat().st_size for p in model_dir.iterdir())
            print(f"    {len(list(model_dir.iterdir()))} files, {size / 1e6:.1f} MB in {model_dir}")
        with _step("uploading it to s3://objfs-demo/models/tiny-llama/"):
            client = s3_client(server.url)
            client.create_bucket(Bucket="objfs-demo")
            upload_dir(client, model_dir, "objfs-demo", "models/tiny-llama")
        with _step(f"objfs mount s3://objfs-demo/models/tiny-llama {mountpoint}"):
            res = _objfs(
                "mount",
                "s3://objfs-demo/models/tiny-llama",
                str(mountpoint),
                "--endpoint-url",
                server.url,
                "--log-file",
                str(work / "objfs.log"),
            )
            if res.returncode != 0:
                print(res.stderr.strip(), file=sys.stderr)
                return res.returncode
            mounted = True
            print("    " + "  ".join(sorted(os.listdir(mountpoint))))
        import transformers  # already imported by the model builder: no import in the timings

        transformers.utils.logging.disable_progress_bar()
        timings: dict[str, float] = {}
        tokens: dict[str, list[int]] = {}
        for label, path in (
            ("from the objfs mount (cold)", mountpoint),
            ("from the objfs mount (warm)", mountpoint),
            ("from a local copy", model_dir),
        ):
            with _step(f"transformers: from_pretrained + generate 8 tokens {label}"):
                start = time.perf_counter()
                _, toks, text = load_and_generate(path)
                timings[label] = time.perf_counter() - start
                tokens[label] = toks
                print(f"    tokens: {toks}\n    text:   {text!r}")
        same = len({tuple(t) for t in tokens.values()}) == 1
        print("\nsummary")
        for label, seconds in timings.items():
            print(f"  load + generate {label:<28} {seconds:6.2f} s")
        print(f"  generated tokens identical across all loads: {'yes' if same else 'NO'}")
        return 0 if same else 1
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        return 130
    finally:
        if mounted:
            res = _objfs("unmount", str(mountpoint))
            if res.returncode != 0:
                _objfs("unmount", "--force", str(mountpoint))
            print(f"==> unmounted {mountpoint}")
        if server is not None:
            server.stop()
            print("==> stopped the S3 server")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
