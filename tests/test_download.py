"""Tests for gears/data/download.py against a real HTTP server on 127.0.0.1 (no internet)."""

from __future__ import annotations

import hashlib
import io
import json
import socket
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gears.data.download import (
    DATASETS,
    GENE2GO_FILE_ID,
    download,
    fetch_dataset,
    fetch_gene2go,
)
from gears.errors import DownloadError, GearsInputError

BODY = bytes(range(256)) * 40  # 10,240 bytes


def make_zip(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


class Handler(BaseHTTPRequestHandler):
    """Serves server.files; honours 'Range: bytes=N-' when server.honour_range; logs requests."""

    def do_GET(self):
        server = self.server
        server.requests.append((self.path, self.headers.get("Range")))
        body = server.files.get(self.path)
        if body is None:
            self.send_error(404, "Not Found")
            return
        start, status = 0, 200
        wanted = self.headers.get("Range")
        if wanted and server.honour_range:
            start = int(wanted.removeprefix("bytes=").rstrip("-"))
            if start >= len(body):
                self.send_error(416, "Range Not Satisfiable")
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.end_headers()
        if self.path in server.cut_after and not wanted:
            # Announce the whole body but send only part of it, then drop the connection.
            self.wfile.write(body[: server.cut_after[self.path]])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.files, httpd.requests, httpd.honour_range, httpd.cut_after = {}, [], True, {}
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_download_then_cached_without_request(server, tmp_path: Path, capsys):
    server.files["/f.bin"] = BODY
    dest = tmp_path / "sub" / "f.bin"
    assert download(server.url + "/f.bin", dest) == dest
    assert dest.read_bytes() == BODY
    assert not (tmp_path / "sub" / "f.bin.part").exists()
    assert "f.bin" in capsys.readouterr().err  # the tqdm bar goes to stderr
    manifest = json.loads((tmp_path / "sub" / ".checksums.json").read_text())
    assert manifest["f.bin"]["size"] == len(BODY)
    assert manifest["f.bin"]["sha256"] == sha(BODY)
    assert len(server.requests) == 1
    assert download(server.url + "/f.bin", dest, progress=False) == dest
    assert len(server.requests) == 1  # verified against the manifest, no network
    assert capsys.readouterr().err == ""


def test_download_resumes_partial_file_with_range(server, tmp_path: Path):
    server.files["/f.bin"] = BODY
    dest = tmp_path / "f.bin"
    (tmp_path / "f.bin.part").write_bytes(BODY[:1000])
    download(server.url + "/f.bin", dest, sha256=sha(BODY), progress=False)
    assert server.requests == [("/f.bin", "bytes=1000-")]
    assert dest.read_bytes() == BODY


def test_download_restarts_when_server_ignores_range(server, tmp_path: Path):
    server.files["/f.bin"] = BODY
    server.honour_range = False
    dest = tmp_path / "f.bin"
    (tmp_path / "f.bin.part").write_bytes(b"x" * 3000)  # would corrupt the file if appended to
    download(server.url + "/f.bin", dest, progress=False)
    assert server.requests == [("/f.bin", "bytes=3000-")]
    assert dest.read_bytes() == BODY


def test_interrupted_download_keeps_part_and_resumes(server, tmp_path: Path):
    server.files["/f.bin"] = BODY
    server.cut_after["/f.bin"] = 4096
    dest = tmp_path / "f.bin"
    with pytest.raises(DownloadError, match="resume") as info:
        download(server.url + "/f.bin", dest, progress=False)
    assert str(dest) in str(info.value)
    assert (tmp_path / "f.bin.part").read_bytes() == BODY[:4096]
    download(server.url + "/f.bin", dest, progress=False)
    assert server.requests[-1] == ("/f.bin", "bytes=4096-")
    assert dest.read_bytes() == BODY
    manifest = json.loads((tmp_path / ".checksums.json").read_text())
    assert manifest["f.bin"]["sha256"] == sha(BODY)  # hash covers the resumed prefix too


def test_checksum_mismatch_deletes_and_names_both_hashes(server, tmp_path: Path):
    server.files["/f.bin"] = BODY
    dest = tmp_path / "f.bin"
    wrong = "0" * 64
    with pytest.raises(DownloadError) as info:
        download(server.url + "/f.bin", dest, sha256=wrong, progress=False)
    message = str(info.value)
    assert str(dest) in message and wrong in message and sha(BODY) in message
    assert not dest.exists() and not (tmp_path / "f.bin.part").exists()


def test_manifest_guards_later_downloads_and_tampered_files(server, tmp_path: Path):
    server.files["/f.bin"] = BODY
    dest = tmp_path / "f.bin"
    download(server.url + "/f.bin", dest, progress=False)
    dest.write_bytes(BODY[::-1])  # same size, different bytes
    with pytest.raises(DownloadError, match="expected sha256"):
        download(server.url + "/f.bin", dest, progress=False)
    assert not dest.exists() and len(server.requests) == 1
    server.files["/f.bin"] = BODY + b"changed upstream"
    with pytest.raises(DownloadError) as info:
        download(server.url + "/f.bin", dest, progress=False)
    assert sha(BODY) in str(info.value) and ".checksums.json" in str(info.value)
    assert not dest.exists()


def test_offline_error_names_url_and_destination(tmp_path: Path):
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/gene2go_all.pkl"
    dest = tmp_path / "gene2go_all.pkl"
    with pytest.raises(DownloadError) as info:
        download(url, dest, timeout=5, progress=False)
    message = str(info.value)
    assert url in message and "offline" in message and str(dest) in message
    assert "by hand" in message and not dest.exists()


def test_http_error_names_status_and_url(server, tmp_path: Path):
    with pytest.raises(DownloadError, match="HTTP 404") as info:
        download(server.url + "/missing", tmp_path / "m.bin", progress=False)
    assert server.url + "/missing" in str(info.value)


NORMAN_ZIP = make_zip(
    {"norman/perturb_processed.h5ad": b"not really hdf5", "norman/go.csv": b"source,target\n"}
)


def test_fetch_dataset_extracts_gears_layout_and_caches(server, tmp_path: Path):
    server.files[f"/files/{DATASETS['norman']}"] = NORMAN_ZIP
    base = server.url + "/files/{}"
    h5ad = fetch_dataset("norman", tmp_path, base_url=base)
    assert h5ad == tmp_path / "norman" / "perturb_processed.h5ad"
    assert h5ad.read_bytes() == b"not really hdf5"
    assert (tmp_path / "norman" / "go.csv").read_bytes() == b"source,target\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".extract")]
    assert len(server.requests) == 1
    assert fetch_dataset("norman", tmp_path, base_url=base) == h5ad
    assert len(server.requests) == 1
    # Lost h5ad: re-extracted from the kept zip (verified by the manifest), still no request.
    h5ad.unlink()
    assert fetch_dataset("norman", tmp_path, base_url=base).read_bytes() == b"not really hdf5"
    assert len(server.requests) == 1


def test_fetch_dataset_rejects_unknown_name(tmp_path: Path):
    with pytest.raises(GearsInputError, match="unknown dataset 'normann'.*adamson.*norman"):
        fetch_dataset("normann", tmp_path)


@pytest.mark.parametrize("evil", ["../evil.txt", "norman/../../evil.txt", "/tmp/evil_abs.txt"])
def test_fetch_dataset_refuses_paths_escaping_data_dir(server, tmp_path: Path, evil: str):
    data_dir = tmp_path / "data"
    server.files[f"/files/{DATASETS['dixit']}"] = make_zip(
        {"dixit/perturb_processed.h5ad": b"h5", evil: b"gotcha"}
    )
    with pytest.raises(DownloadError, match="outside"):
        fetch_dataset("dixit", data_dir, base_url=server.url + "/files/{}")
    assert not (tmp_path / "evil.txt").exists()
    assert not (data_dir / "dixit" / "perturb_processed.h5ad").exists()


def test_fetch_dataset_without_h5ad_in_zip(server, tmp_path: Path):
    server.files[f"/files/{DATASETS['adamson']}"] = make_zip({"other/file.txt": b"x"})
    with pytest.raises(DownloadError, match="adamson/perturb_processed.h5ad"):
        fetch_dataset("adamson", tmp_path, base_url=server.url + "/files/{}")


def test_fetch_dataset_bad_zip_is_deleted(server, tmp_path: Path):
    server.files[f"/files/{DATASETS['adamson']}"] = b"<html>maintenance</html>"
    with pytest.raises(DownloadError, match="not a valid zip"):
        fetch_dataset("adamson", tmp_path, base_url=server.url + "/files/{}")
    assert not (tmp_path / "adamson.zip").exists()


def test_fetch_dataset_offline_says_where_to_put_files(tmp_path: Path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(DownloadError) as info:
        fetch_dataset("norman", tmp_path, base_url=f"http://127.0.0.1:{port}/{{}}")
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/{DATASETS['norman']}" in message
    assert str(tmp_path / "norman.zip") in message
    assert str(tmp_path / "norman" / "perturb_processed.h5ad") in message


def test_fetch_gene2go(server, tmp_path: Path):
    server.files[f"/files/{GENE2GO_FILE_ID}"] = b"pickle bytes"
    path = fetch_gene2go(tmp_path, base_url=server.url + "/files/{}")
    assert path == tmp_path / "gene2go_all.pkl" and path.read_bytes() == b"pickle bytes"


def test_download_restarts_when_part_is_longer_than_file(server, tmp_path: Path):
    server.files["/f.bin"] = BODY
    dest = tmp_path / "f.bin"
    (tmp_path / "f.bin.part").write_bytes(BODY + b"stale tail")  # server answers 416
    download(server.url + "/f.bin", dest, progress=False)
    assert server.requests == [("/f.bin", f"bytes={len(BODY) + 10}-"), ("/f.bin", None)]
    assert dest.read_bytes() == BODY


def test_silent_server_times_out(tmp_path: Path):
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/f.bin"
        with pytest.raises(DownloadError, match="timed out") as info:
            download(url, tmp_path / "f.bin", timeout=0.3, progress=False)
    assert url in str(info.value) and str(tmp_path / "f.bin") in str(info.value)


def test_mirror_url_by_name_from_config_or_environment(server, tmp_path: Path, monkeypatch):
    """A mirror folder URL serves GEARS's files by name: <mirror>/norman.zip, gene2go_all.pkl."""
    from gears.data.download import DATAVERSE_URL, MIRROR_ENV, base_url

    server.files["/mirror/norman.zip"] = NORMAN_ZIP
    server.files["/mirror/gene2go_all.pkl"] = BODY
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    assert base_url(None) == DATAVERSE_URL
    h5ad = fetch_dataset("norman", tmp_path / "a", base_url=base_url(server.url + "/mirror/"))
    assert h5ad.read_bytes() == b"not really hdf5"
    monkeypatch.setenv(MIRROR_ENV, server.url + "/mirror")
    assert fetch_gene2go(tmp_path / "b", base_url=base_url()).read_bytes() == BODY
    assert [p for p, _ in server.requests] == ["/mirror/norman.zip", "/mirror/gene2go_all.pkl"]
    # The config key wins over the environment; a `{}` template takes the Dataverse file id.
    assert base_url(server.url + "/x/{}") == server.url + "/x/{}"


def test_mirror_as_local_folder(tmp_path: Path, monkeypatch):
    from gears.data.download import MIRROR_ENV, base_url

    folder = tmp_path / "fetched by hand"
    folder.mkdir()
    (folder / "gene2go_all.pkl").write_bytes(BODY)
    monkeypatch.setenv(MIRROR_ENV, str(folder))
    path = fetch_gene2go(tmp_path / "data", base_url=base_url())
    assert path.read_bytes() == BODY


def test_refused_download_names_the_mirror_options(server, tmp_path: Path):
    """Dataverse answering 403: the message says where to put the file and how to use a mirror."""
    from gears.data.download import MIRROR_ENV

    with pytest.raises(DownloadError) as info:
        fetch_dataset("adamson", tmp_path, base_url=server.url + "/forbidden/{}")
    message = str(info.value)
    assert "404" in message  # the fixture server answers 404 for unknown paths
    assert str(tmp_path / "adamson.zip") in message
    assert str(tmp_path / "adamson" / "perturb_processed.h5ad") in message
    assert "data.mirror_url" in message and MIRROR_ENV in message
