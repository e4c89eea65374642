"""Submission archives: what `submit` writes and what `grade` accepts.

A submission is a gzip-compressed tar holding only labs/<name>.py, notebooks/<name>.ipynb and
manifest.json, as regular files. Archives come from students, so nothing is extracted before the
whole archive has been checked, in two passes:

1. `scan`: the decompressed stream is read block by block with a budget, and every tar header is
   counted (directories and extension headers too) before tarfile sees it. A long-name or pax
   header larger than a name can be, more members than allowed, more header or file bytes than
   allowed, or a stream that never ends: rejected at once, having read at most the budget. A
   1 MiB archive of long-name headers or a million directory entries costs milliseconds and a few
   kilobytes of memory.
2. `validate`: tarfile lists the members (now bounded) and its "data" filter (PEP 706: Python's
   rules for untrusted archives) refuses absolute paths, paths that land outside the folder,
   links out of it and devices; then the course's rules: regular files only, no name outside that
   set, no duplicate.

Extraction then uses tarfile's own `extractall` with that filter, on the validated members only.
What tarfile has no rule for, the budgets of the first pass, stays ours.
"""
from __future__ import annotations

import gzip
import io
import re
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

MAX_ARCHIVE_BYTES = 20 * 2**20     # the compressed file
MAX_MEMBER_BYTES = 5 * 2**20       # one file, uncompressed
MAX_TOTAL_BYTES = 40 * 2**20       # all files, uncompressed
MAX_MEMBERS = 200                  # every entry counts: files, directories, anything
MAX_NAME_BYTES = 255               # a member's name (a long-name header's size)
MAX_EXTENSION_BYTES = 4096         # one pax header's size
MAX_HEADER_BYTES = 1 * 2**20       # all headers together (512 per entry, plus extensions)
BLOCK = 512
ALLOWED = (re.compile(r"labs/[A-Za-z0-9_]+\.py"), re.compile(r"notebooks/[A-Za-z0-9_.-]+\.ipynb"),
           re.compile(r"manifest\.json"))
ALLOWED_DIRS = {"labs", "notebooks"}
ALLOWED_TEXT = "labs/*.py, notebooks/*.ipynb and manifest.json"
_NOWHERE = "/nonexistent-destination"  # the data filter judges paths against a destination
_LONG_NAMES = (b"L", b"K")             # GNU long name / long link name: the data is a name
_EXTENSIONS = (b"x", b"g", b"X")       # pax headers: the data describes the next member


def _shown(name: str) -> str:
    """A member name for a message: quoted, and cut short if it is absurdly long."""
    return repr(name if len(name) <= 80 else name[:40] + "..." + name[-37:])


class ArchiveRejected(ValueError):
    """The archive is unsafe or malformed; the message says why (shown to the student)."""


@dataclass
class Member:
    name: str       # normalised relative path, e.g. labs/lab04_ring.py
    info: tarfile.TarInfo


def _name(info: tarfile.TarInfo) -> str:
    """A member's name once tarfile's "data" filter (Python's own rules for extracting untrusted
    archives: no absolute path, nothing that lands outside the folder, no link out of it, no
    device) accepts it; "" for the archive's own top folder (`tar -C folder .`)."""
    try:
        safe = tarfile.data_filter(info, _NOWHERE)
    except tarfile.FilterError as exc:
        raise ArchiveRejected(f"member {_shown(info.name)}: {exc}") from None
    name = safe.name
    while name.startswith("./"):
        name = name[2:]
    return "" if name in (".", "./") else name.rstrip("/")


def _size(field: bytes) -> int:
    """A tar header's size field: octal text, or GNU base-256 when the top bit is set."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip() or b"0"
    try:
        return int(text, 8)
    except ValueError:
        raise ArchiveRejected("not a readable .tar.gz archive (a header's size is not a number)") from None


def _blocks(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def scan(path: Path) -> int:
    """Check the raw tar stream of a .tar.gz within fixed budgets; return the number of entries.

    Reads the decompressed stream header by header, skipping file data in chunks, so memory stays
    at a few kilobytes and reading stops at the first header over a limit."""
    entries = header_bytes = data_bytes = 0
    try:
        with gzip.open(path, "rb") as stream:
            while True:
                header = stream.read(BLOCK)
                if len(header) < BLOCK:
                    if header.strip(b"\0"):
                        raise ArchiveRejected("not a readable .tar.gz archive (it ends inside a header)")
                    break  # end of the stream: tarfile accepts an archive without end blocks
                if not header.strip(b"\0"):
                    break  # the end-of-archive block: nothing after it is read
                kind, size = header[156:157], _size(header[124:136])
                header_bytes += BLOCK
                if kind in _LONG_NAMES or kind in _EXTENSIONS:
                    limit = MAX_NAME_BYTES if kind in _LONG_NAMES else MAX_EXTENSION_BYTES
                    if size > limit:
                        raise ArchiveRejected(f"a {'long-name' if kind in _LONG_NAMES else 'pax'} "
                                              f"header of {size} bytes; at most {limit} allowed")
                    header_bytes += _blocks(size)
                else:
                    entries += 1
                    if entries > MAX_MEMBERS:
                        raise ArchiveRejected(f"more than {MAX_MEMBERS} entries (files, folders "
                                              "and anything else count)")
                    if size > MAX_MEMBER_BYTES:
                        raise ArchiveRejected(f"a member of {size} bytes; at most {MAX_MEMBER_BYTES} "
                                              "allowed per file")
                    data_bytes += size
                    if data_bytes > MAX_TOTAL_BYTES:
                        raise ArchiveRejected(f"the files add up to more than {MAX_TOTAL_BYTES} bytes")
                if header_bytes > MAX_HEADER_BYTES:
                    raise ArchiveRejected(f"more than {MAX_HEADER_BYTES} bytes of tar headers")
                left = _blocks(size)
                while left:  # skip the member's data without keeping it
                    chunk = stream.read(min(left, 65536))
                    if not chunk:
                        raise ArchiveRejected("not a readable .tar.gz archive (truncated)")
                    left -= len(chunk)
    except ArchiveRejected:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise ArchiveRejected(f"not a readable .tar.gz archive ({type(exc).__name__}: {exc})") from None
    return entries


def validate(path: Path) -> list[Member]:
    """The archive's members, all checked; ArchiveRejected naming the first problem."""
    path = Path(path)
    if not path.is_file():
        raise ArchiveRejected(f"{path.name}: no such file")
    size = path.stat().st_size
    if size > MAX_ARCHIVE_BYTES:
        raise ArchiveRejected(f"the archive is {size} bytes; at most {MAX_ARCHIVE_BYTES} allowed")
    scan(path)  # bounded first: tarfile below only ever sees an archive within the limits
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            return _members(tar)
    except ArchiveRejected:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        raise ArchiveRejected(f"not a readable .tar.gz archive ({type(exc).__name__}: {exc})") from None


def _members(tar: tarfile.TarFile) -> list[Member]:
    """Every member of `tar`, header by header (a bomb stops at its first oversized header): the
    data filter's rules, then the course's: regular files only, named as ALLOWED says, once each."""
    members: list[Member] = []
    seen: set[str] = set()
    for info in iter(tar.next, None):
        name = _name(info)
        if info.isdir():
            if name and name not in ALLOWED_DIRS:
                raise ArchiveRejected(f"member {_shown(info.name)}: only {ALLOWED_TEXT} are allowed")
            continue
        if not info.isreg() or info.issparse():
            raise ArchiveRejected(f"member {_shown(info.name)}: only regular files are allowed "
                                  "(no links, devices, fifos or other special members)")
        if not any(p.fullmatch(name) for p in ALLOWED):
            raise ArchiveRejected(f"member {_shown(info.name)}: only {ALLOWED_TEXT} are allowed")
        if name in seen:
            raise ArchiveRejected(f"member {_shown(info.name)} appears twice")
        seen.add(name)
        members.append(Member(name, info))
    if not members:
        raise ArchiveRejected("the archive holds no files")
    return members


def extract(path: Path, dest: Path) -> list[str]:
    """Validate, then extract the members under `dest` with tarfile's "data" filter; the names
    written (each a regular file, mode 0644)."""
    validate(path)  # the budgets and every rule, before anything is written
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode="r:gz") as tar:
        members = _members(tar)
        tar.extractall(dest, members=[m.info for m in members], filter="data")
    for member in members:
        (dest / member.name).chmod(0o644)
    return [m.name for m in members]


def pack(files: dict[str, bytes], out: Path, mtime: float) -> Path:
    """Write `files` (name -> bytes) as a .tar.gz of plain files owned by nobody in particular."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, mode="w:gz") as tar:
        for name in sorted(files):
            data = files[name]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = int(mtime)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return out
