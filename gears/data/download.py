"""Cached, resumable, checksum-verified downloads of GEARS's public datasets and gene2go file."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from tqdm import tqdm

from gears.errors import DownloadError, GearsInputError

DATAVERSE_URL = "https://dataverse.harvard.edu/api/access/datafile/{}"
DATASETS: dict[str, int] = {
    "norman": 6154020,
    "adamson": 6154417,
    "dixit": 6154416,
    "replogle_k562_essential": 7458695,
    "replogle_rpe1_essential": 7458694,
}
GENE2GO_FILE_ID = 6153417  # GEARS's gene2go_all.pkl
MANIFEST_NAME = ".checksums.json"
H5AD_NAME = "perturb_processed.h5ad"

MIRROR_ENV = "GEARS_MIRROR_URL"

_CHUNK = 1 << 20
_USER_AGENT = "gears-fast/0.1 (python urllib)"


# ---------------------------------------------------------------------------------------------
# Checksum manifest
# ---------------------------------------------------------------------------------------------


def _manifest_path(dest: Path) -> Path:
    return dest.parent / MANIFEST_NAME


def _read_manifest(dest: Path) -> dict[str, dict]:
    path = _manifest_path(dest)
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DownloadError(
            f"checksum manifest {path} is unreadable ({err}); delete it to start afresh"
        ) from err
    return manifest if isinstance(manifest, dict) else {}


def _record(dest: Path, url: str, size: int, sha256: str) -> None:
    """Remember the first good download of ``dest`` (written atomically, never overwritten)."""
    manifest = _read_manifest(dest)
    if dest.name in manifest:
        return
    manifest[dest.name] = {"size": size, "sha256": sha256, "url": url}
    path = _manifest_path(dest)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _expected(dest: Path, sha256: str | None) -> tuple[int | None, str | None, str]:
    """(size, sha256, where the expectation comes from) for ``dest``; Nones when unknown."""
    if sha256:
        return None, sha256.lower(), "the sha256 passed by the caller"
    entry = _read_manifest(dest).get(dest.name)
    if entry:
        return (
            entry.get("size"),
            entry.get("sha256"),
            f"the first download ({_manifest_path(dest)})",
        )
    return None, None, ""


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _verify(path: Path, dest: Path, size: int | None, sha256: str | None, source: str) -> None:
    """Delete ``path`` and raise when its size or sha256 differ from the expectation."""
    actual_size = path.stat().st_size
    problem = None
    if size is not None and actual_size != size:
        problem = f"expected {size} bytes, got {actual_size}"
    elif sha256 is not None:
        actual = _file_sha256(path)
        if actual != sha256:
            problem = f"expected sha256 {sha256}, got {actual}"
    if problem:
        path.unlink(missing_ok=True)
        raise DownloadError(
            f"{dest} failed verification against {source}: {problem}. The bad file was deleted; "
            "run again to re-download. If the upstream file legitimately changed, remove the "
            f"entry {dest.name!r} from {_manifest_path(dest)}."
        )


# ---------------------------------------------------------------------------------------------
# Download
# ---------------------------------------------------------------------------------------------


def _manual_fix(url: str, dest: Path) -> str:
    return (
        f"To fix it, download {url} by hand (e.g. in a browser) and save it as {dest}, or set "
        f"data.mirror_url (or the environment variable {MIRROR_ENV}) to a mirror URL or folder "
        f"holding {dest.name}."
    )


def _network_error(url: str, dest: Path, err: BaseException) -> DownloadError:
    if isinstance(err, urllib.error.HTTPError):
        what = f"the server answered HTTP {err.code} {err.reason}"
    elif isinstance(err, TimeoutError | socket.timeout) or isinstance(
        getattr(err, "reason", None), TimeoutError | socket.timeout
    ):
        what = "the connection timed out (the machine seems offline or the server is slow)"
    elif isinstance(err, urllib.error.URLError | ConnectionError | http.client.HTTPException):
        reason = getattr(err, "reason", err)
        what = f"could not connect ({reason}); the machine seems offline or the host is unreachable"
    else:
        what = f"{type(err).__name__}: {err}"
    part = dest.with_name(dest.name + ".part")
    resume = ""
    if part.is_file() and part.stat().st_size:
        resume = f" The partial download {part} is kept; running again resumes it."
    return DownloadError(f"cannot download {url}: {what}. {_manual_fix(url, dest)}{resume}")


def _open(url: str, offset: int, timeout: float):
    headers = {"User-Agent": _USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)


def _start(url: str, offset: int, timeout: float):
    """Open ``url`` from byte ``offset`` if the server honours the range, else from the start."""
    if offset:
        try:
            response = _open(url, offset, timeout)
        except urllib.error.HTTPError as err:
            if err.code != 416:  # 416: the partial file is not a prefix of this resource
                raise
        else:
            content_range = response.headers.get("Content-Range", "")
            if response.status == 206 and content_range.startswith(f"bytes {offset}-"):
                return response, True
            if response.status == 200:  # range ignored: this full body restarts the file
                return response, False
            response.close()
    return _open(url, 0, timeout), False


def _fetch_part(url: str, dest: Path, part: Path, timeout: float, progress: bool) -> str:
    """Fill ``part`` with the whole file (resuming it when possible); return its sha256."""
    offset = part.stat().st_size if part.exists() else 0
    response, resumed = _start(url, offset, timeout)
    digest = hashlib.sha256()
    if resumed:
        with open(part, "rb") as fh:
            while block := fh.read(_CHUNK):
                digest.update(block)
    else:
        offset = 0
    with response:
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length and length.isdigit() else None
        with (
            open(part, "ab" if resumed else "wb") as out,
            tqdm(
                total=total,
                initial=offset,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=dest.name,
                file=sys.stderr,
                disable=not progress,
            ) as bar,
        ):
            while block := response.read(_CHUNK):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
    received = part.stat().st_size
    if total is not None and received < total:
        raise DownloadError(
            f"download of {url} stopped at {received} of {total} bytes; run again to resume "
            f"from {_resumable_part(dest)}. {_manual_fix(url, dest)}"
        )
    return digest.hexdigest()


def _resumable_part(dest: Path) -> Path:
    """Where an interrupted download waits to be resumed: ``dest + '.part'``."""
    return dest.with_name(dest.name + ".part")


def _own_part(dest: Path) -> Path:
    """This process's partial file, ``dest.<host>.<pid>.part``: processes on several nodes (or
    ranks of one node) downloading into one shared folder never write the same file. A leftover
    ``dest.part`` is claimed by an atomic rename, so exactly one process resumes it."""
    own = dest.with_name(f"{dest.name}.{socket.gethostname()}.{os.getpid()}.part")
    try:
        os.rename(_resumable_part(dest), own)
    except FileNotFoundError:
        pass  # nothing to resume, or another process claimed it first
    return own


def _keep_for_resume(part: Path, dest: Path) -> None:
    """Hand an interrupted partial file back as ``dest.part`` for the next attempt to resume."""
    if part.is_file() and part.stat().st_size:
        os.replace(part, _resumable_part(dest))
    else:
        part.unlink(missing_ok=True)


def download(
    url: str,
    dest: str | Path,
    *,
    sha256: str | None = None,
    timeout: float = 60.0,
    progress: bool = True,
) -> Path:
    """Download ``url`` to ``dest`` once; later calls verify the file and make no request.

    Bytes go to a per-process ``dest.<host>.<pid>.part`` (an interrupted download is left as
    ``dest + '.part'`` and resumed with an HTTP Range request when the server honours it) and
    are renamed into place only when complete and verified. Verification: against
    ``sha256`` when given, else against the size and sha256 recorded in ``<dir>/.checksums.json``
    by the first successful download. A bad file is deleted and ``DownloadError`` raised;
    network failures raise ``DownloadError`` saying what to download by hand and where to put it.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    size, expected_sha, source = _expected(dest, sha256)
    if dest.is_file():
        if expected_sha or size is not None:
            _verify(dest, dest, size, expected_sha, source)
        return dest
    part = _own_part(dest)
    try:
        actual_sha = _fetch_part(url, dest, part, timeout, progress)
    except DownloadError:
        _keep_for_resume(part, dest)
        raise
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
        _keep_for_resume(part, dest)
        raise _network_error(url, dest, err) from err
    except BaseException:
        _keep_for_resume(part, dest)
        raise
    if expected_sha and actual_sha != expected_sha:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"{dest} failed verification against {source}: expected sha256 {expected_sha}, "
            f"got {actual_sha}. The bad download was deleted. If the upstream file legitimately "
            f"changed, remove the entry {dest.name!r} from {_manifest_path(dest)}."
        )
    os.replace(part, dest)
    _record(dest, url, dest.stat().st_size, actual_sha)
    return dest


# ---------------------------------------------------------------------------------------------
# GEARS's public files
# ---------------------------------------------------------------------------------------------


def _safe_members(archive: zipfile.ZipFile, root: Path, zip_path: Path) -> list[zipfile.ZipInfo]:
    """The archive's members, refusing any whose path would land outside ``root``."""
    members = archive.infolist()
    for info in members:
        name = info.filename
        target = (root / name).resolve()
        if (
            name.startswith(("/", "\\"))
            or "\\" in name
            or (len(name) > 1 and name[1] == ":")
            or not target.is_relative_to(root)
        ):
            raise DownloadError(
                f"{zip_path} holds the entry {name!r}, which would be written outside {root}; "
                "refusing to extract it. Delete the archive and download it again from a "
                "trusted source."
            )
    return members


def _extract(zip_path: Path, data_dir: Path) -> None:
    """Unpack ``zip_path`` into ``data_dir``; each file appears complete or not at all."""
    root = data_dir.resolve()
    staging = root / f".extract-{zip_path.stem}-{os.getpid()}"
    try:
        with zipfile.ZipFile(zip_path) as archive:
            members = _safe_members(archive, root, zip_path)
            archive.extractall(staging, members=members)
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = root / path.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    except (zipfile.BadZipFile, EOFError) as err:
        zip_path.unlink(missing_ok=True)
        raise DownloadError(
            f"{zip_path} is not a valid zip archive ({err}); it was deleted, run again to "
            "re-download it"
        ) from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def base_url(mirror_url: str | None = None) -> str:
    """The URL template for GEARS's public files: `mirror_url`, else the GEARS_MIRROR_URL
    environment variable, else Harvard Dataverse.

    A mirror holding `{}` is a template filled with the Dataverse file id (a Dataverse mirror);
    otherwise it is a base URL (http(s)://, file://) or a local folder under which the files
    are found by name: `<mirror>/norman.zip`, `<mirror>/gene2go_all.pkl`.
    """
    mirror = (mirror_url or os.environ.get(MIRROR_ENV, "")).strip()
    if not mirror:
        return DATAVERSE_URL
    if "{}" in mirror:
        return mirror
    if "://" not in mirror:
        mirror = Path(mirror).expanduser().resolve().as_uri()
    return mirror.rstrip("/") + "/{name}"


def fetch_dataset(name: str, data_dir: str | Path, *, base_url: str = DATAVERSE_URL) -> Path:
    """Path of ``<data_dir>/<name>/perturb_processed.h5ad``, downloading GEARS's zip if needed.

    Already present: returned with no network access. Otherwise ``<data_dir>/<name>.zip`` is
    downloaded (or reused and re-verified) and extracted into ``data_dir``.
    """
    key = name.strip().lower()
    if key not in DATASETS:
        raise GearsInputError(
            f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}. "
            "For your own data, load an .h5ad with PertData.new_data_process instead."
        )
    data_dir = Path(data_dir)
    h5ad = data_dir / key / H5AD_NAME
    if h5ad.is_file():
        return h5ad
    url = base_url.format(DATASETS[key], name=f"{key}.zip")
    zip_path = data_dir / f"{key}.zip"
    try:
        download(url, zip_path)
    except DownloadError as err:
        raise DownloadError(
            f"{err} Alternatively unzip it yourself so that the file {h5ad} exists."
        ) from err
    _extract(zip_path, data_dir)
    if not h5ad.is_file():
        raise DownloadError(
            f"{zip_path} (from {url}) was extracted but holds no {key}/{H5AD_NAME}; "
            f"put the dataset's processed .h5ad at {h5ad} by hand"
        )
    return h5ad


def fetch_gene2go(data_dir: str | Path, *, base_url: str = DATAVERSE_URL) -> Path:
    """Path of ``<data_dir>/gene2go_all.pkl`` (GEARS's gene -> GO terms), downloaded if needed."""
    name = "gene2go_all.pkl"
    return download(base_url.format(GENE2GO_FILE_ID, name=name), Path(data_dir) / name)
