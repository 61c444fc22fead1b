"""Fetching from a package index: a local index on 127.0.0.1 holding small wheels made here, one of them refused
(HTTP 403), one missing, one whose SHA-256 is not the one pinned. Each failure is one line, leaves no file in the
cache, and does not stop the other pieces; ``kvsieve data`` lists them and exits with 1."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import threading
import zipfile
from pathlib import Path

import pytest

from kvsieve import pieces
from kvsieve.cli import main
from kvsieve.fetch import Distribution, FetchError, cache_dir, fetch_members


def make_wheel(folder: Path, name: str, version: str, members: dict[str, bytes]) -> Distribution:
    """A wheel of ``members`` (with the metadata pip reads) in ``folder``, pinned by its SHA-256."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        **members,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    file = f"{name}-{version}-py3-none-any.whl"
    (folder / file).write_bytes(buffer.getvalue())
    return Distribution(file, hashlib.sha256(buffer.getvalue()).hexdigest())


class _Index(http.server.BaseHTTPRequestHandler):
    """A PEP 503 simple index of the wheels in ``root``; the files named in ``refused`` answer 403."""

    root: Path
    refused: set[str]

    def do_GET(self) -> None:
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        if parts[:1] == ["simple"] and len(parts) == 2:
            project = parts[1].replace("-", "_")
            links = [f'<a href="/files/{p.name}">{p.name}</a>' for p in self.root.glob(f"{project}-*.whl")]
            if not links:
                return self._answer(404, b"no such project")
            return self._answer(200, f"<html><body>{''.join(links)}</body></html>".encode(), "text/html")
        if parts[:1] == ["files"] and len(parts) == 2:
            if parts[1] in self.refused:
                return self._answer(403, b"Forbidden")
            path = self.root / parts[1]
            if path.is_file():
                return self._answer(200, path.read_bytes(), "application/octet-stream")
        self._answer(404, b"not found")

    def _answer(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index (127.0.0.1, a free port) that pip is pointed at alone, and an empty kvsieve cache:
    ``ok`` (two members), ``refused`` (403), ``missing`` (not on the index), ``tampered`` (another SHA-256)."""
    root = tmp_path / "index"
    root.mkdir()
    ok = make_wheel(root, "kvsieve_test_ok", "1.0", {"ok/data.txt": b"real data\n", "ok/more.txt": b"more\n"})
    refused = make_wheel(root, "kvsieve_test_refused", "1.0", {"refused/data.txt": b"x\n"})
    tampered = make_wheel(root, "kvsieve_test_tampered", "1.0", {"tampered/data.txt": b"y\n"})
    handler = type("Index", (_Index,), {"root": root, "refused": {refused.file}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple/")
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "20")
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path / "cache"))
    yield {
        "ok": ok,
        "refused": refused,
        "missing": Distribution("kvsieve_test_missing-1.0-py3-none-any.whl", "0" * 64),
        "tampered": Distribution(tampered.file, "f" * 64),
    }
    server.shutdown()
    server.server_close()


def _cached_files() -> list[str]:
    return sorted(str(p.relative_to(cache_dir())) for p in cache_dir().rglob("*") if p.is_file())


def test_a_pinned_wheel_gives_its_members(index) -> None:
    target = cache_dir() / "ok" / "data.txt"
    assert fetch_members(index["ok"], {"ok/data.txt": target}) == {"ok/data.txt": target}
    assert target.read_bytes() == b"real data\n"
    assert _cached_files() == ["ok/data.txt"]


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("refused", r"kvsieve-test-refused==1\.0 .*: refused by the package index \(HTTP 403\)$"),
        ("missing", r"kvsieve-test-missing==1\.0 .*: not on the package index$"),
        ("tampered", r"kvsieve-test-tampered==1\.0 .* has SHA-256 [0-9a-f]{64}, expected f{64}: not used$"),
    ],
)
def test_a_failed_fetch_is_one_line_and_leaves_nothing_in_the_cache(index, case, said) -> None:
    with pytest.raises(FetchError, match=said) as caught:
        fetch_members(index[case], {f"{case}/data.txt": cache_dir() / case / "data.txt"})
    assert "\n" not in str(caught.value)
    assert _cached_files() == []


def test_a_member_the_wheel_lacks_is_named_and_the_others_are_written(index) -> None:
    wanted = {"ok/more.txt": cache_dir() / "more.txt", "ok/absent.txt": cache_dir() / "absent.txt"}
    with pytest.raises(FetchError, match=r"does not contain: ok/absent\.txt$"):
        fetch_members(index["ok"], wanted)
    assert _cached_files() == ["more.txt"]


@pytest.fixture
def test_pieces(index, monkeypatch):
    """Four data pieces, one per wheel of the index, in the order refused, missing, tampered, ok."""
    from kvsieve.cli import parser

    names = ("refused", "missing", "tampered", "ok")

    def fetcher(name: str):
        target = cache_dir() / name / "data.txt"
        return lambda: fetch_members(index[name], {f"{name}/data.txt": target})[f"{name}/data.txt"]

    monkeypatch.setattr(pieces, "fetcher", fetcher)
    for module in (pieces, parser):
        monkeypatch.setattr(module, "DATA_PIECES", dict.fromkeys(names, "a test piece"))
    return names


def test_pieces_that_fail_do_not_stop_the_others(test_pieces) -> None:
    rows = pieces.fetch(test_pieces)
    assert [(r.piece, r.error is None) for r in rows] == [
        ("refused", False),
        ("missing", False),
        ("tampered", False),
        ("ok", True),
    ]
    assert rows[-1].path == str(cache_dir() / "ok" / "data.txt") and rows[-1].bytes == len(b"real data\n")
    assert _cached_files() == ["ok/data.txt"]


def test_kvsieve_data_lists_every_piece_and_fails_when_one_asked_for_is_missing(test_pieces, capsys) -> None:
    assert main(["data", "--only", *test_pieces]) == 1
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["piece", "status", "size", "where", "/", "why"]
    assert [line.split()[:2] for line in table[1:5]] == [
        ["refused", "MISSING"],
        ["missing", "MISSING"],
        ["tampered", "MISSING"],
        ["ok", "ok"],
    ]
    assert "HTTP 403" in table[1] and "not on the package index" in table[2] and "SHA-256" in table[3]
    assert table[5:] == ["1 of 4 piece(s) in the cache, 3 missing"]
    assert _cached_files() == ["ok/data.txt"]


def test_kvsieve_data_succeeds_when_every_piece_asked_for_is_there(test_pieces, capsys) -> None:
    assert main(["data", "--only", "ok", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["missing"] == [] and [row["piece"] for row in result["pieces"]] == ["ok"]
    assert main(["data", "--only", "ok"]) == 0  # (cached now: nothing fetched)
    assert capsys.readouterr().out.splitlines()[-1] == "1 of 1 piece(s) in the cache"
    assert main(["data", "--only", "missing", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["missing"] == ["missing"]


@pytest.mark.slow
def test_compare_needs_only_the_default_model_and_the_wikipedia_text(tmp_path, monkeypatch, capsys) -> None:
    """What ``make demo`` fetches is all ``kvsieve compare`` reads: on a cache of those two pieces alone, with every
    download refused, it runs."""
    from kvsieve.corpora.wikipedia import ensure_data
    from kvsieve.models import ensure_model

    model, articles = ensure_model("smollm2-135m"), ensure_data()["wiki_articles"]
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "smollm2-135m").symlink_to(model)
    (cache / "data").mkdir()
    (cache / "data" / articles.name).symlink_to(articles)
    monkeypatch.setenv("KVSIEVE_CACHE", str(cache))

    def refuse(dist: Distribution, dest: Path) -> Path:
        raise FetchError(f"{dist.requirement}: refused (test)")

    monkeypatch.setattr("kvsieve.fetch.download", refuse)
    argv = ["compare", "--json", "--policies", "h2o", "--max-tokens", "64", "--budget", "24", "--sample-tokens", "8"]
    assert main(argv) == 0
    assert [row["policy"] for row in json.loads(capsys.readouterr().out)["rows"]] == ["h2o"]
    assert sorted(p.name for p in cache.iterdir()) == ["data", "models"]


def test_a_piece_that_needs_an_extra_says_which(monkeypatch) -> None:
    def fetcher(name: str):
        def fetch():
            raise ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow")

        return fetch

    monkeypatch.setattr(pieces, "fetcher", fetcher)
    (row,) = pieces.fetch(["tasks"])
    assert row.path is None and row.error == "needs the Python package 'pyarrow': pip install 'kvsieve[eval]'"
