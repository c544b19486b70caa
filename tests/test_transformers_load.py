"""A real loader: transformers loads a sharded trust_remote_code model from the mount."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from objfs.demo import build_tiny_model, load_and_generate, upload_dir
from tests.conftest import Mount, sha256


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def test_from_pretrained_from_the_mount_equals_local(
    mount_s3: Any, s3: Any, bucket: str, tiny_model: Path
) -> None:
    import torch
    from transformers import AutoTokenizer

    uploaded = upload_dir(s3, tiny_model, bucket, "models/tiny-llama")
    assert {"model.safetensors.index.json", "modeling_objfs_tiny.py", "tokenizer.json"} <= set(
        uploaded
    )
    assert sum(name.endswith(".safetensors") for name in uploaded) > 1  # sharded
    m: Mount = mount_s3(f"s3://{bucket}/models/tiny-llama/")
    assert set(os.listdir(m.path)) == set(uploaded)
    for rel, digest in uploaded.items():
        assert sha256((m.path / rel).read_bytes()) == digest, rel

    local_model, local_tokens, _ = load_and_generate(tiny_model)
    mount_model, mount_tokens, _ = load_and_generate(m.path)
    assert type(mount_model).__name__ == "ObjfsTinyForCausalLM"  # the trust_remote_code class
    assert len(mount_tokens) == 8
    assert mount_tokens == local_tokens

    local_state, mount_state = local_model.state_dict(), mount_model.state_dict()
    assert local_state.keys() == mount_state.keys()
    for name, tensor in local_state.items():
        assert mount_state[name].dtype == tensor.dtype, name
        assert torch.equal(mount_state[name], tensor), name

    text = "the weights stream from object storage"
    local_tok = AutoTokenizer.from_pretrained(str(tiny_model))
    mount_tok = AutoTokenizer.from_pretrained(str(m.path))
    assert mount_tok(text)["input_ids"] == local_tok(text)["input_ids"]
    assert "Traceback" not in m.log()
    assert " ERROR " not in m.log()
