"""CPU tests of objfs.torch_io (safetensors loader) and objfs.vllm_plugin (without vLLM)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from objfs import torch_io, torch_pipeline, vllm_plugin  # noqa: E402  (after the importorskip guards)
from objfs.torch_io import (  # noqa: E402
    iter_safetensors,
    load_safetensors,
    read_header,
    resolve_safetensors_files,
)

# Every safetensors dtype code that this torch can represent (F6_* have no torch dtype).
TORCH_DTYPES = {
    code: getattr(torch, info.torch_name)
    for code, info in torch_io.DTYPES.items()
    if info.torch_name and hasattr(torch, info.torch_name)
}


def random_tensor(dtype: Any, shape: tuple[int, ...], seed: int) -> Any:
    """A tensor of ``dtype``/``shape`` holding deterministic random bits (bool: 0/1)."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * dtype.itemsize
    if dtype == torch.bool:
        raw = torch.randint(0, 2, (nbytes,), dtype=torch.uint8, generator=gen)
    else:
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(tensor: Any) -> Any:
    """Bytes of a tensor: bit-exact comparison, immune to NaN != NaN."""
    return tensor.reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        out = got[name]
        assert out.dtype == ref.dtype, name
        assert out.shape == ref.shape, name
        assert out.device.type == "cpu", name
        assert torch.equal(bits(out), bits(ref)), name


def save(path: Path, tensors: dict[str, Any]) -> Path:
    safetensors_torch.save_file(tensors, str(path))
    return path


def test_import_does_not_import_torch() -> None:
    code = "import objfs, objfs.torch_io, objfs.vllm_plugin, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("code", sorted(TORCH_DTYPES))
def test_every_dtype_matches_load_file(tmp_path: Path, code: str) -> None:
    dtype = TORCH_DTYPES[code]
    tensors = {
        "matrix": random_tensor(dtype, (3, 6), seed=1),
        "vector": random_tensor(dtype, (10,), seed=2),
        "cube": random_tensor(dtype, (2, 3, 4), seed=3),
    }
    if code != "F4":  # F4 needs a last dimension; safetensors cannot write 0-d F4
        tensors["scalar"] = random_tensor(dtype, (), seed=4)
    file = save(tmp_path / f"{code}.safetensors", tensors)
    # A 64-byte buffer splits most tensors across several reads.
    got = load_safetensors(file, "cpu", threads=3, buffer_bytes=64)
    assert_same(got, safetensors_torch.load_file(str(file)))


def test_all_dtypes_in_one_file(tmp_path: Path) -> None:
    tensors = {
        f"{code}.{i}": random_tensor(dtype, (i + 1, 4), seed=i)
        for i, (code, dtype) in enumerate(sorted(TORCH_DTYPES.items()))
    }
    file = save(tmp_path / "all.safetensors", tensors)
    assert_same(load_safetensors(file, "cpu"), safetensors_torch.load_file(str(file)))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 5, 2), (1,), (1, 1, 1), (7,)], ids=str)
def test_scalar_and_zero_size_tensors(tmp_path: Path, shape: tuple[int, ...]) -> None:
    tensors = {
        "f32": random_tensor(torch.float32, shape, seed=5),
        "bf16": random_tensor(torch.bfloat16, shape, seed=6),
        "i64": random_tensor(torch.int64, shape, seed=7),
        "neighbour": random_tensor(torch.float16, (3,), seed=8),
    }
    file = save(tmp_path / "shapes.safetensors", tensors)
    assert_same(load_safetensors(file, "cpu", buffer_bytes=4), safetensors_torch.load_file(file))


@pytest.mark.parametrize("buffer_bytes", [1000, 4096, 1 << 20])
def test_tensor_larger_than_buffer(tmp_path: Path, buffer_bytes: int) -> None:
    tensors = {
        "big": random_tensor(torch.float32, (301, 333), seed=9),  # ~400 KB
        "odd": random_tensor(torch.int8, (12345,), seed=10),
        "tail": random_tensor(torch.float64, (17,), seed=11),
    }
    file = save(tmp_path / "big.safetensors", tensors)
    got = load_safetensors(file, "cpu", threads=4, buffer_bytes=buffer_bytes)
    assert_same(got, safetensors_torch.load_file(str(file)))


def test_huge_pages_option(tmp_path: Path) -> None:
    # 9 MiB and 10 MiB tensors: large enough for the madvise(MADV_HUGEPAGE) advice.
    tensors = {
        "a": random_tensor(torch.float32, (9 * 1024 * 256,), seed=12),
        "b": random_tensor(torch.uint8, (10 * 1024 * 1024 + 3,), seed=13),
    }
    file = save(tmp_path / "huge.safetensors", tensors)
    got = load_safetensors(file, "cpu", huge_pages=True)
    assert_same(got, safetensors_torch.load_file(str(file)))


def test_many_tiny_tensors(tmp_path: Path) -> None:
    # 2,000 tensors in one read window: more than one preadv's iovec limit.
    kinds = [torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool]
    tensors = {
        f"layer.{i}.w": random_tensor(kinds[i % len(kinds)], (i % 7 + 1,), seed=i)
        for i in range(2000)
    }
    file = save(tmp_path / "tiny.safetensors", tensors)
    assert_same(load_safetensors(file, "cpu"), safetensors_torch.load_file(str(file)))


def write_sharded(folder: Path, n_shards: int = 3) -> dict[str, Any]:
    """A transformers-style sharded checkpoint with model.safetensors.index.json."""
    folder.mkdir(exist_ok=True)
    everything: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    for shard in range(n_shards):
        name = f"model-{shard + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {
            f"layers.{shard}.{kind}": random_tensor(torch.bfloat16, (16, 8 + shard), seed=shard)
            for kind in ("q", "k", "v")
        }
        save(folder / name, part)
        everything.update(part)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / torch_io.INDEX_NAME).write_text(json.dumps(index))
    return everything


def test_multi_file_model_with_index(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    want = write_sharded(folder)
    (folder / "stray.safetensors").write_bytes(b"not listed in the index, never read")
    for source in (folder, folder / torch_io.INDEX_NAME):
        assert_same(load_safetensors(source, "cpu", buffer_bytes=100), want)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert resolve_safetensors_files(folder) == [str(s) for s in shards]
    assert_same(load_safetensors(shards, "cpu"), want)


def test_directory_without_index_and_file_list_order(tmp_path: Path) -> None:
    a = save(tmp_path / "b.safetensors", {"x": torch.ones(2)})
    b = save(tmp_path / "a.safetensors", {"y": torch.zeros(3)})
    assert resolve_safetensors_files(tmp_path) == [str(b), str(a)]  # sorted
    assert resolve_safetensors_files([a, b, a]) == [str(a), str(b)]  # given order, deduplicated
    assert list(load_safetensors([a, b], "cpu")) == ["x", "y"]


def test_duplicate_tensor_across_files_rejected(tmp_path: Path) -> None:
    a = save(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    b = save(tmp_path / "b.safetensors", {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="appears in both"):
        load_safetensors([a, b], "cpu")


def test_index_problems(tmp_path: Path) -> None:
    (tmp_path / "escape.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(ValueError, match="not a path inside"):
        resolve_safetensors_files(tmp_path / "escape.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_safetensors_files(tmp_path / "broken.json")
    (tmp_path / "gone.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"listed by .*gone\.json"):
        resolve_safetensors_files(tmp_path / "gone.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        resolve_safetensors_files(empty)


def test_streaming_order_and_bounded_prefetch(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    write_sharded(folder)
    expected = [
        entry.name
        for file in resolve_safetensors_files(folder)
        for entry in read_header(file).tensors
    ]
    stream = iter_safetensors(folder, "cpu", buffer_bytes=64, prefetch_bytes=1)
    seen = []
    for name, tensor in stream:
        seen.append(name)
        assert tensor.dtype == torch.bfloat16
    assert seen == expected


def test_streaming_file_order_is_data_offset_order(tmp_path: Path) -> None:
    # A hand-written header listing tensors in a different order than their data.
    data = b"".join(bytes([i]) * 4 for i in range(3))
    header = {
        "c": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
    }
    file = raw_file(tmp_path / "order.safetensors", header, data)
    assert [n for n, _ in iter_safetensors(file, "cpu")] == ["c", "b", "a"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_closing_stream_early_releases_files(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    write_sharded(folder)
    before = open_fds()
    stream = iter_safetensors(folder, "cpu", buffer_bytes=64)
    next(stream)
    assert open_fds() > before
    stream.close()
    assert open_fds() == before


def test_dtype_casts_only_plain_floats(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(4, 3),
        "f16": torch.randn(5).half(),
        "i32": torch.arange(6, dtype=torch.int32),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    file = save(tmp_path / "cast.safetensors", tensors)
    got = load_safetensors(file, "cpu", dtype=torch.bfloat16)
    assert got["f32"].dtype == got["f16"].dtype == torch.bfloat16
    assert torch.equal(got["f32"], tensors["f32"].to(torch.bfloat16))
    assert torch.equal(got["f16"], tensors["f16"].to(torch.bfloat16))
    assert got["i32"].dtype == torch.int32
    assert got["fp8"].dtype == torch.float8_e4m3fn


def test_misaligned_offsets_load_correctly(tmp_path: Path) -> None:
    # Hand-written file whose F64 tensor starts at an odd offset: we allocate aligned storage.
    values = struct.pack("<3d", 1.5, -2.25, 1e300)
    header = {
        "pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "x": {"dtype": "F64", "shape": [3], "data_offsets": [1, 25]},
    }
    file = raw_file(tmp_path / "odd.safetensors", header, b"\x07" + values)
    got = load_safetensors(file, "cpu", buffer_bytes=5)
    assert got["x"].tolist() == [1.5, -2.25, 1e300]
    assert got["pad"].tolist() == [7]


def test_short_reads_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = save(tmp_path / "s.safetensors", {"a": random_tensor(torch.float32, (999,), 1)})
    real = os.preadv

    def dribble(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, [buffers[0][:7]], offset)  # at most 7 bytes per call

    monkeypatch.setattr(os, "preadv", dribble)
    got = load_safetensors(file, "cpu", buffer_bytes=1000)
    assert_same(got, safetensors_torch.load_file(str(file)))


def test_file_shrinking_during_load_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = save(tmp_path / "s.safetensors", {"a": torch.ones(100)})
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)  # EOF
    with pytest.raises(ValueError, match=r"s\.safetensors: unexpected end of file"):
        load_safetensors(file, "cpu")


def test_bad_arguments(tmp_path: Path) -> None:
    file = save(tmp_path / "s.safetensors", {"a": torch.ones(1)})
    with pytest.raises(ValueError, match="threads"):
        load_safetensors(file, "cpu", threads=0)
    with pytest.raises(ValueError, match="buffer_bytes"):
        load_safetensors(file, "cpu", buffer_bytes=0)
    with pytest.raises(ValueError, match="prefetch_bytes"):
        iter_safetensors(file, "cpu", prefetch_bytes=-1)  # raised before iterating
    with pytest.raises(FileNotFoundError):
        iter_safetensors(tmp_path / "missing", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    file = save(tmp_path / "s.safetensors", {"a": torch.ones(1)})
    with pytest.raises(RuntimeError, match="cuda"):
        load_safetensors(file, "cuda:0")


def test_other_devices_go_through_cpu(tmp_path: Path) -> None:
    file = save(tmp_path / "s.safetensors", {"a": torch.arange(5.0)})
    got = load_safetensors(file, "meta")
    assert got["a"].device.type == "meta"
    assert got["a"].shape == (5,)


def test_read_header_reports_metadata(tmp_path: Path) -> None:
    file = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"a": torch.ones(2)}, str(file), metadata={"format": "pt"})
    header = read_header(file)
    assert header.metadata == {"format": "pt"}
    assert [(e.name, e.dtype, e.shape, e.nbytes) for e in header.tensors] == [("a", "F32", (2,), 8)]


# --------------------------------------------------------------------------------------------
# Malformed files: one case each, always a ValueError naming the file.


def raw_file(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    """Write a safetensors file by hand; ``header`` is a JSON-able object or raw bytes."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", size) + blob + data)
    return path


def f32(offsets: list[Any], shape: Any = None, dtype: Any = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": offsets}


MALFORMED: dict[str, tuple[Any, str]] = {
    # name: (writer(path) -> path, message regex)
    "truncated_file": (lambda p: (p.write_bytes(b"\x10\x00\x00"), p)[1], "shorter than the 8"),
    "truncated_data": (
        lambda p: raw_file(p, {"a": f32([0, 8])}, b"\0" * 5),
        "outside the 5-byte data",
    ),
    "header_past_end": (lambda p: raw_file(p, {}, length=4096), "runs past the end"),
    "header_huge": (lambda p: raw_file(p, b"{}", length=2**63), "exceeds the 100000000"),
    "invalid_json": (lambda p: raw_file(p, b'{"a": {'), "not valid JSON"),
    "invalid_utf8": (lambda p: raw_file(p, b'{"\xff": 1}'), "not valid JSON"),
    "not_an_object": (lambda p: raw_file(p, [1, 2]), "JSON list, not an object"),
    "entry_not_object": (lambda p: raw_file(p, {"a": 3}), "not an object"),
    "duplicate_key": (lambda p: raw_file(p, b'{"a": 1, "a": 2}'), "duplicate key"),
    "bad_metadata": (lambda p: raw_file(p, {"__metadata__": {"k": 1}}), "__metadata__"),
    "unknown_dtype": (
        lambda p: raw_file(p, {"a": f32([0, 8], dtype="F128")}, b"\0" * 8),
        "unknown dtype 'F128'",
    ),
    "dtype_not_in_torch": (
        lambda p: raw_file(p, {"a": f32([0, 3], shape=[4], dtype="F6_E2M3")}, b"\0" * 3),
        "F6_E2M3 has no equivalent in torch",
    ),
    "offsets_outside_data": (
        lambda p: raw_file(p, {"a": f32([8, 16])}, b"\0" * 8),
        "outside the [0-9]+-byte data region",
    ),
    "offsets_reversed": (
        lambda p: raw_file(p, {"a": f32([8, 0])}, b"\0" * 8),
        "outside the [0-9]+-byte data region",
    ),
    "offsets_malformed": (
        lambda p: raw_file(p, {"a": f32([0, 4, 8])}, b"\0" * 8),
        "data_offsets must be",
    ),
    "overlapping_offsets": (
        lambda p: raw_file(p, {"a": f32([0, 8]), "b": f32([4, 12])}, b"\0" * 12),
        "overlap",
    ),
    "size_mismatch": (
        lambda p: raw_file(p, {"a": f32([0, 8], shape=[3])}, b"\0" * 12),
        "needs 12 bytes",
    ),
    "negative_shape": (
        lambda p: raw_file(p, {"a": f32([0, 8], shape=[-2, -1])}, b"\0" * 8),
        "non-negative integers",
    ),
    "non_integer_shape": (
        lambda p: raw_file(p, {"a": f32([0, 8], shape=[2.0])}, b"\0" * 8),
        "non-negative integers",
    ),
    "boolean_shape": (
        lambda p: raw_file(p, {"a": f32([0, 4], shape=[True])}, b"\0" * 4),
        "non-negative integers",
    ),
    "huge_shape": (
        lambda p: raw_file(p, {"a": f32([0, 8], shape=[2**62, 2**62])}, b"\0" * 8),
        "needs",
    ),
    "odd_f4": (
        lambda p: raw_file(p, {"a": f32([0, 1], shape=[2, 1], dtype="F4")}, b"\0"),
        "even last dimension",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_rejected(tmp_path: Path, case: str) -> None:
    writer, message = MALFORMED[case]
    file = writer(tmp_path / f"{case}.safetensors")
    with pytest.raises(ValueError, match=message) as info:
        load_safetensors(file, "cpu")
    assert str(file) in str(info.value)
    if case != "dtype_not_in_torch":  # a valid header for a dtype torch lacks
        with pytest.raises(ValueError, match=message):
            read_header(file)


# --------------------------------------------------------------------------------------------
# vLLM plugin, without vLLM.


def test_vllm_register_is_a_logged_noop_without_vllm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes "import vllm" raise ImportError
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    with caplog.at_level(logging.INFO, logger="objfs.vllm_plugin"):
        vllm_plugin.register()
        vllm_plugin.register()
    assert "not registered" in caplog.text
    assert not vllm_plugin._registered


class FakeBaseModelLoader:
    def __init__(self, load_config: Any) -> None:
        self.load_config = load_config


class FakeModel:
    """Stands in for a vLLM model: load_weights consumes (name, tensor) pairs."""

    def __init__(self, names: list[str]) -> None:
        self.params = {n: torch.nn.Parameter(torch.empty(0)) for n in names}
        self.received: dict[str, Any] = {}

    def named_parameters(self) -> Any:
        return iter(self.params.items())

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            self.received[name] = tensor.clone()
        return set(self.received)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Minimal vllm.model_executor.model_loader modules with a registry."""
    registry: dict[str, Any] = {}

    def register_model_loader(name: str) -> Any:
        def wrap(cls: Any) -> Any:
            assert issubclass(cls, FakeBaseModelLoader)
            registry[name] = cls
            return cls

        return wrap

    loader_pkg = types.ModuleType("vllm.model_executor.model_loader")
    loader_pkg.register_model_loader = register_model_loader  # type: ignore[attr-defined]
    base = types.ModuleType("vllm.model_executor.model_loader.base_loader")
    base.BaseModelLoader = FakeBaseModelLoader  # type: ignore[attr-defined]
    for name, module in {
        "vllm": types.ModuleType("vllm"),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.model_loader": loader_pkg,
        "vllm.model_executor.model_loader.base_loader": base,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    return registry


def test_vllm_loader_streams_weights_into_model(tmp_path: Path, fake_vllm: dict[str, Any]) -> None:
    folder = tmp_path / "model"
    want = write_sharded(folder)
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent
    loader_cls = fake_vllm[vllm_plugin.LOAD_FORMAT]
    options = {"threads": 2, "buffer_bytes": 64, "huge_pages": True}
    config = types.SimpleNamespace(model_loader_extra_config=options)
    loader = loader_cls(config)
    model_config = types.SimpleNamespace(model=str(folder), quantization=None)
    loader.download_model(model_config)
    model = FakeModel(list(want))
    loader.load_weights(model, model_config)
    assert_same(model.received, want)

    model = FakeModel([*want, "lm_head.weight"])
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        loader.load_weights(model, model_config)


def test_vllm_loader_rejects_bad_config(tmp_path: Path, fake_vllm: dict[str, Any]) -> None:
    vllm_plugin.register()
    loader_cls = fake_vllm[vllm_plugin.LOAD_FORMAT]
    with pytest.raises(ValueError, match="unknown --model-loader-extra-config"):
        loader_cls(types.SimpleNamespace(model_loader_extra_config={"concurrency": 4}))
    loader = loader_cls(types.SimpleNamespace(model_loader_extra_config={}))
    with pytest.raises(ValueError, match="not one"):
        loader.download_model(types.SimpleNamespace(model="org/model-on-the-hub"))


def test_vllm_weight_files_prefers_hf_shards_over_consolidated(tmp_path: Path) -> None:
    hf = save(tmp_path / "model.safetensors", {"a": torch.ones(1)})
    mistral = save(tmp_path / "consolidated.safetensors", {"b": torch.ones(1)})
    assert vllm_plugin.weight_files(str(tmp_path)) == [str(hf)]
    assert vllm_plugin.weight_files(str(tmp_path), "mistral") == [str(mistral)]


# --------------------------------------------------------------------------------------------
# The pinned-buffer pipeline's bookkeeping, run on the CPU with stand-ins for CUDA streams and
# events (the real thing runs in tests/test_torch_io_cuda.py on a GPU machine).


class FakeEvent:
    created: ClassVar[list[FakeEvent]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.recorded = False
        self.waits = 0
        FakeEvent.created.append(self)

    def record(self, stream: Any) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "a buffer was refilled before its copies were queued"
        self.waits += 1


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: FakeEvent) -> None:
        assert event.recorded


@pytest.mark.parametrize(
    ("buffer_bytes", "num_buffers", "threads"), [(64, 2, 3), (1000, 2, 1), (4096, 5, 4)]
)
def test_pinned_buffer_pipeline_with_fake_cuda(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    buffer_bytes: int,
    num_buffers: int,
    threads: int,
) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    FakeEvent.created = []
    tensors = {f"t{i}": random_tensor(torch.float32, (57, 31 + i), seed=i) for i in range(20)}
    tensors.update({f"z{i}": random_tensor(torch.bfloat16, (i % 3,), seed=i) for i in range(50)})
    tensors["scalar"] = random_tensor(torch.float64, (), seed=1)
    files = [
        str(save(tmp_path / "a.safetensors", tensors)),
        str(save(tmp_path / "b.safetensors", {"b": random_tensor(torch.int8, (10001,), 3)})),
    ]
    opened = torch_pipeline.open_all(files)
    try:
        items, segments = torch_pipeline.plan([o.header for o in opened], buffer_bytes)
        pool = [
            torch_pipeline._Pinned(buf, buf.numpy().data, None)
            for buf in (torch.empty(buffer_bytes, dtype=torch.uint8) for _ in range(num_buffers))
        ]
        cpu = torch.device("cpu")
        got = list(torch_pipeline.iter_cuda(opened, items, segments, threads, cpu, pool))
    finally:
        torch_pipeline.close_all(opened)
    want = {**safetensors_torch.load_file(files[0]), **safetensors_torch.load_file(files[1])}
    assert [name for name, _ in got] == [e.name for f in files for e in read_header(f).tensors]
    assert_same(dict(got), want)
    assert len(FakeEvent.created) == len(segments)
    assert sum(e.waits for e in FakeEvent.created) == len(segments) - num_buffers


# --------------------------------------------------------------------------------------------
# The transformers recipe documented in the README.


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformers_skeleton_recipe(tmp_path: Path, tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    initialization = pytest.importorskip("transformers.initialization")
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    original.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + index
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)

    # --- README recipe (device "cpu" here; "cuda:0" on a GPU) ---
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with initialization.no_init_weights():  # skeleton: uninitialised torch.empty parameters
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = load_safetensors(tmp_path, "cpu")
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # tied lm_head.weight is not stored in the checkpoint
    model.to("cpu").eval()
    # --- end of recipe ---

    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if tie else [])
    loaded = state["model.layers.0.mlp.up_proj.weight"]  # assigned, not copied:
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() == loaded.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
