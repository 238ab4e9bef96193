"""`infer_manifest.json`: the size and sha256 of every file of a converted model folder.

Written last, after every other file is on disk, so a folder with a manifest is complete. The
cheap check (sizes) runs on every use; the full check (sha256) on `infer models fetch --verify`.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST_FILE = "infer_manifest.json"
MANIFEST_FORMAT = 1
_HASH_BLOCK_BYTES = 4 * 1024 * 1024


class ModelFolderError(ValueError):
    """A model folder does not match its manifest (a file is missing, truncated or altered)."""


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, *, source: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in `folder` (not in subfolders) and write the manifest beside them.

    `source` records where the files came from (alias, package, GGUF file and its sha256).
    """
    folder = Path(folder)
    files = {
        path.name: {"size_bytes": path.stat().st_size, "sha256": sha256_of_file(path)}
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != MANIFEST_FILE
    }
    manifest = {"format": MANIFEST_FORMAT, "source": source, "files": files}
    manifest_path = folder / MANIFEST_FILE
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fsync_file(manifest_path)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None when it has none (a folder the user made, not `fetch`)."""
    manifest_path = Path(folder) / MANIFEST_FILE
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFolderError(f"{manifest_path} is not valid JSON ({err})") from err
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
        raise ModelFolderError(
            f"{manifest_path} has format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}"
        )
    return manifest


def verify_model_folder(folder: Path, *, rehash: bool = False) -> None:
    """Check every file listed in the folder's manifest: its size, and its sha256 when `rehash`.

    Raises ModelFolderError naming every mismatching file. A folder without a manifest passes:
    there is nothing to compare it with.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return
    problems = []
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != expected["size_bytes"]:
            problems.append(f"{name}: {size} bytes, manifest says {expected['size_bytes']}")
        elif rehash and (digest := sha256_of_file(path)) != expected["sha256"]:
            problems.append(f"{name}: sha256 {digest}, manifest says {expected['sha256']}")
    if problems:
        raise ModelFolderError(f"{folder} does not match its {MANIFEST_FILE}: " + "; ".join(problems))


def fsync_file(path: Path) -> None:
    with Path(path).open("rb") as f:
        os.fsync(f.fileno())


def fsync_folder(folder: Path) -> None:
    """Flush a folder's files and its entry list, so a rename after this publishes whole files."""
    folder = Path(folder)
    for path in folder.iterdir():
        if path.is_file():
            fsync_file(path)
    fsync_directory(folder)


def fsync_directory(folder: Path) -> None:
    """Flush a folder's entry list (names created or renamed in it), not its files' data."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
