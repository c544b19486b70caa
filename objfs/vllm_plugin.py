"""vLLM integration: ``vllm serve /mnt/model --load-format objfs``.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes before it builds
the model; :func:`register` is that entry point.  It registers the load format ``"objfs"`` with
vLLM's model-loader registry (``vllm.model_executor.model_loader.register_model_loader``), so
vLLM itself is never modified.  The registered loader reads the checkpoint's safetensors files
with :func:`objfs.torch_io.iter_safetensors` on the CPU (parallel large reads, which an objfs
mount serves well) and streams them into ``model.load_weights``, whose weight loaders copy,
shard and convert each tensor into vLLM's own parameters.

Nothing here imports vLLM (or torch) at module import time.  Without vLLM, or with a vLLM too
old to have the registry, :func:`register` logs a message and does nothing.

Tuning goes through ``--model-loader-extra-config``, e.g.
``'{"threads": 16, "buffer_bytes": 33554432, "prefetch_bytes": 2147483648, "huge_pages": true}'``
(see :func:`objfs.torch_io.iter_safetensors`).
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from objfs.safetensors_header import INDEX_NAME, resolve_safetensors_files
from objfs.torch_io import DEFAULT_BUFFER_BYTES, DEFAULT_PREFETCH_BYTES, iter_safetensors

if TYPE_CHECKING:
    import torch

__all__ = ["LOAD_FORMAT", "register", "weight_files"]

LOAD_FORMAT: Final = "objfs"

# Keys of --model-loader-extra-config passed on to iter_safetensors.
_OPTIONS: Final = frozenset({"threads", "buffer_bytes", "prefetch_bytes", "huge_pages"})

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Register the ``"objfs"`` load format with vLLM; safe to call any number of times.

    A no-op with an INFO log line when vLLM is not installed or has no model-loader registry
    (vLLM releases before ``register_model_loader``); a WARNING if vLLM refuses the
    registration.  Never raises, so a broken plugin cannot stop vLLM from starting.
    """
    global _registered
    if _registered:
        return
    try:
        # import_module, not import statements: vLLM is optional and has no type stubs here.
        registry = importlib.import_module("vllm.model_executor.model_loader")
        register_model_loader = registry.register_model_loader
        base = importlib.import_module("vllm.model_executor.model_loader.base_loader")
    except (ImportError, AttributeError) as exc:
        logger.info(
            "objfs: vLLM with a model-loader registry is not available (%s); "
            "load format %r not registered",
            exc,
            LOAD_FORMAT,
        )
        return
    try:
        register_model_loader(LOAD_FORMAT)(_loader_class(base.BaseModelLoader))
    except Exception as exc:  # a plugin must not take vLLM down; report and carry on
        logger.warning("objfs: vLLM refused load format %r: %s", LOAD_FORMAT, exc)
        return
    _registered = True
    logger.info("objfs: registered vLLM load format %r", LOAD_FORMAT)


def weight_files(model_dir: str, config_format: object = None) -> list[str]:
    """The safetensors files vLLM should load from the local folder ``model_dir``.

    With ``model.safetensors.index.json``: the shards its ``weight_map`` names.  Otherwise every
    ``*.safetensors`` file, except that Mistral's ``consolidated*.safetensors`` duplicates are
    skipped when Hugging Face shards sit next to them (and used alone when ``config_format`` is
    ``"mistral"``).  Raises ``ValueError`` when ``model_dir`` is not a local directory (this
    loader reads mounted paths; it does not download) and ``FileNotFoundError`` when there is
    nothing to load.
    """
    if not os.path.isdir(model_dir):
        raise ValueError(
            f"load format {LOAD_FORMAT!r} reads a local directory such as an objfs mount; "
            f"{model_dir!r} is not one"
        )
    fmt = str(getattr(config_format, "value", config_format) or "").lower()
    mistral = os.path.join(model_dir, "consolidated.safetensors.index.json")
    if fmt == "mistral" and os.path.isfile(mistral):
        return resolve_safetensors_files(mistral)
    if os.path.isfile(os.path.join(model_dir, INDEX_NAME)):
        return resolve_safetensors_files(model_dir)
    files = resolve_safetensors_files(model_dir)
    consolidated = [f for f in files if os.path.basename(f).startswith("consolidated")]
    others = [f for f in files if f not in consolidated]
    if fmt == "mistral" and consolidated:
        return consolidated
    return others or consolidated


def _options(load_config: Any) -> dict[str, int | None]:
    extra: Mapping[str, Any] = getattr(load_config, "model_loader_extra_config", None) or {}
    unknown = set(extra) - _OPTIONS
    if unknown:
        raise ValueError(
            f"unknown --model-loader-extra-config keys for load format {LOAD_FORMAT!r}: "
            f"{sorted(unknown)}; allowed: {sorted(_OPTIONS)}"
        )
    options: dict[str, int | None] = dict(extra)
    return options


def _weights(
    files: list[str], options: dict[str, int | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights iterator handed to ``model.load_weights``: CPU tensors in file order."""
    return iter_safetensors(
        files,
        "cpu",
        threads=options.get("threads"),
        buffer_bytes=options.get("buffer_bytes") or DEFAULT_BUFFER_BYTES,
        prefetch_bytes=options.get("prefetch_bytes", DEFAULT_PREFETCH_BYTES),
        huge_pages=bool(options.get("huge_pages")),
    )


def _check_all_loaded(model: Any, model_config: Any, loaded: set[str] | None) -> None:
    """Like vLLM's default loader: unquantised models must get every parameter."""
    if loaded is None or getattr(model_config, "quantization", None) is not None:
        return
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"weights not initialized from checkpoint: {sorted(missing)}")


def _default_loader(load_config: Any) -> Any:
    """vLLM's own safetensors loader, for models that need its extra features."""
    default = importlib.import_module("vllm.model_executor.model_loader.default_loader")
    config = copy.copy(load_config)
    config.load_format = "safetensors"
    config.model_loader_extra_config = {}
    return default.DefaultModelLoader(config)


def _loader_class(base: Any) -> Any:
    """Build the loader class on vLLM's ``BaseModelLoader`` (only importable with vLLM)."""

    # base is vLLM's BaseModelLoader, only known at run time, hence Any and the ignore.
    class ObjfsModelLoader(base):  # type: ignore[misc]
        """Loads safetensors from a local folder (an objfs mount) with objfs.torch_io."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.objfs_options = _options(load_config)

        def download_model(self, model_config: Any) -> None:
            # Nothing to download: the files are already mounted.  Fail early if absent.
            weight_files(model_config.model, getattr(model_config, "config_format", None))

        def load_weights(self, model: Any, model_config: Any) -> None:
            if getattr(model, "secondary_weights", None) or getattr(
                model, "allow_patterns_overrides", None
            ):
                logger.info("objfs: model needs vLLM's default loader features; delegating")
                _default_loader(self.load_config).load_weights(model, model_config)
                return
            files = weight_files(model_config.model, getattr(model_config, "config_format", None))
            started = time.perf_counter()
            loaded = model.load_weights(_weights(files, self.objfs_options))
            logging.getLogger("vllm.objfs").info(
                "objfs: loaded weights from %d files in %.2f s",
                len(files),
                time.perf_counter() - started,
            )
            _check_all_loaded(model, model_config, loaded)

    return ObjfsModelLoader
