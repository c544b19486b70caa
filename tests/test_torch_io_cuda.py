"""CUDA tests of objfs.torch_io: pinned-buffer loading must equal safetensors' load_file.

Skipped unless torch.cuda.is_available(); run them on a GPU machine with tests/gpu/check.sh.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from objfs import torch_io  # noqa: E402  (after the importorskip guards)
from objfs.torch_io import iter_safetensors, load_safetensors, read_header  # noqa: E402
from tests.test_torch_io import TORCH_DTYPES, bits, random_tensor  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

DEVICE = "cuda:0"


def assert_same(got: dict[str, Any], want: dict[str, Any], device: str = DEVICE) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        out = got[name]
        assert out.dtype == ref.dtype, name
        assert out.shape == ref.shape, name
        assert out.device == torch.device(device), name
        assert torch.equal(bits(out).cpu(), bits(ref.cpu())), name


def save(path: Path, tensors: dict[str, Any]) -> Path:
    safetensors_torch.save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("code", sorted(TORCH_DTYPES))
def test_every_dtype_matches_load_file(tmp_path: Path, code: str) -> None:
    dtype = TORCH_DTYPES[code]
    tensors = {
        "matrix": random_tensor(dtype, (3, 6), seed=1),
        "vector": random_tensor(dtype, (10,), seed=2),
        "cube": random_tensor(dtype, (2, 3, 4), seed=3),
    }
    if code != "F4":  # safetensors cannot write a 0-d F4 tensor
        tensors["scalar"] = random_tensor(dtype, (), seed=4)
    file = save(tmp_path / f"{code}.safetensors", tensors)
    got = load_safetensors(file, DEVICE, threads=3, buffer_bytes=64, num_buffers=2)
    assert_same(got, safetensors_torch.load_file(str(file)))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,)], ids=str)
def test_scalar_and_zero_size_tensors(tmp_path: Path, shape: tuple[int, ...]) -> None:
    tensors = {
        "f32": random_tensor(torch.float32, shape, seed=5),
        "bf16": random_tensor(torch.bfloat16, shape, seed=6),
        "neighbour": random_tensor(torch.float16, (3,), seed=8),
    }
    file = save(tmp_path / "shapes.safetensors", tensors)
    assert_same(load_safetensors(file, DEVICE, buffer_bytes=4), safetensors_torch.load_file(file))


@pytest.mark.parametrize(("buffer_bytes", "num_buffers"), [(1000, 2), (4096, 3), (1 << 20, 8)])
def test_tensor_larger_than_buffer(tmp_path: Path, buffer_bytes: int, num_buffers: int) -> None:
    tensors = {
        "big": random_tensor(torch.float32, (301, 333), seed=9),
        "odd": random_tensor(torch.int8, (12345,), seed=10),
        "tail": random_tensor(torch.float64, (17,), seed=11),
    }
    file = save(tmp_path / "big.safetensors", tensors)
    got = load_safetensors(
        file, DEVICE, threads=4, buffer_bytes=buffer_bytes, num_buffers=num_buffers
    )
    assert_same(got, safetensors_torch.load_file(str(file)))


def test_large_file_many_buffers(tmp_path: Path) -> None:
    # ~96 MiB through 1 MiB buffers: many buffer recycles, events and multi-piece tensors.
    tensors = {f"w{i}": random_tensor(torch.bfloat16, (1024, 4096 + i), seed=i) for i in range(12)}
    file = save(tmp_path / "large.safetensors", tensors)
    got = load_safetensors(file, DEVICE, buffer_bytes=1 << 20, num_buffers=4)
    assert_same(got, safetensors_torch.load_file(str(file)))


def test_many_tiny_tensors(tmp_path: Path) -> None:
    kinds = [torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool]
    tensors = {
        f"layer.{i}.w": random_tensor(kinds[i % len(kinds)], (i % 7 + 1,), seed=i)
        for i in range(2000)
    }
    file = save(tmp_path / "tiny.safetensors", tensors)
    assert_same(load_safetensors(file, DEVICE), safetensors_torch.load_file(str(file)))


def test_multi_file_model_with_index(tmp_path: Path) -> None:
    want: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    for shard in range(3):
        name = f"model-{shard + 1:05d}-of-00003.safetensors"
        part = {f"layers.{shard}.{k}": random_tensor(torch.bfloat16, (64, 9), shard) for k in "qkv"}
        save(tmp_path / name, part)
        want.update(part)
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / torch_io.INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    assert_same(load_safetensors(tmp_path, DEVICE, buffer_bytes=500, num_buffers=2), want)


def test_streaming_order_and_use_while_loading(tmp_path: Path) -> None:
    tensors = {f"t{i}": random_tensor(torch.float32, (257, 31 + i), seed=i) for i in range(20)}
    file = save(tmp_path / "stream.safetensors", tensors)
    order = [entry.name for entry in read_header(file).tensors]
    seen = []
    for name, tensor in iter_safetensors(file, DEVICE, buffer_bytes=4096, num_buffers=2):
        seen.append(name)
        # Used right away on the current stream while later tensors are still being copied.
        doubled = (bits(tensor).to(torch.int32) * 2).cpu()
        assert torch.equal(doubled, bits(tensors[name]).to(torch.int32) * 2), name
    assert seen == order


def test_non_default_current_stream(tmp_path: Path) -> None:
    tensors = {"a": random_tensor(torch.float16, (512, 513), seed=1)}
    file = save(tmp_path / "s.safetensors", tensors)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = load_safetensors(file, DEVICE, buffer_bytes=8192)
        total = bits(got["a"]).to(torch.int64).sum()
    side.synchronize()
    assert int(total) == int(bits(tensors["a"]).to(torch.int64).sum())


def test_device_without_index(tmp_path: Path) -> None:
    file = save(tmp_path / "s.safetensors", {"a": torch.arange(10.0)})
    got = load_safetensors(file, "cuda")
    assert got["a"].is_cuda
    assert torch.equal(got["a"].cpu(), torch.arange(10.0))


def test_dtype_cast_on_device(tmp_path: Path) -> None:
    tensors = {"f32": torch.randn(40, 3), "i32": torch.arange(6, dtype=torch.int32)}
    file = save(tmp_path / "cast.safetensors", tensors)
    got = load_safetensors(file, DEVICE, dtype=torch.bfloat16)
    assert got["f32"].dtype == torch.bfloat16
    assert torch.equal(got["f32"].cpu(), tensors["f32"].to(torch.bfloat16))
    assert got["i32"].dtype == torch.int32


def test_pinning_failure_falls_back_to_cpu_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = {"a": random_tensor(torch.float32, (100, 7), seed=3)}
    file = save(tmp_path / "s.safetensors", tensors)
    real_empty = torch.empty

    def no_pinning(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pin_memory"):
            raise RuntimeError("cannot pin memory (simulated)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    with caplog.at_level(logging.WARNING, logger="objfs.torch_io"):
        got = load_safetensors(file, DEVICE)
    assert "cannot pin" in caplog.text
    assert_same(got, tensors)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_closing_stream_early(tmp_path: Path) -> None:
    tensors = {f"t{i}": random_tensor(torch.float32, (1000,), seed=i) for i in range(50)}
    file = save(tmp_path / "s.safetensors", tensors)
    before = len(os.listdir("/proc/self/fd"))
    stream = iter_safetensors(file, DEVICE, buffer_bytes=1024, num_buffers=2)
    name, tensor = next(stream)
    stream.close()
    assert len(os.listdir("/proc/self/fd")) == before
    assert torch.equal(bits(tensor).cpu(), bits(tensors[name]))
