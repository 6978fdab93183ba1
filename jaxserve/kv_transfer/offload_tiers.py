"""The two tiers behind the device prefix cache: host memory and a directory of files.

Both map a block hash (core/kv/prefix_hash.py) to one block's KV as a byte row
(kv_transfer/offload_copy.py) and both are LRU with a byte bound.

A disk block is one file, `<hash hex>.kvb`:

    header (HEADER, little-endian)   magic "JXKVBLK1", format version,
                                     model fingerprint (32 bytes), layout digest (32:
                                     leaf shapes and dtypes of a block), block hash (32),
                                     payload length (8), BLAKE2b-256 of the payload (32)
    payload                          the block's byte row

Nothing is pickled. A file whose header, length or checksum does not match what this
engine would write (truncated, bit-flipped, another model or cache layout) is a miss and
is deleted. Files are written to a temporary name in the same directory and renamed
into place (os.replace), so an engine reading the directory (another replica, a P/D
server, a restarted server) sees a whole block or no file. Any OSError while writing
(a full disk, a read-only directory) turns the disk tier off with one log line; the
engine goes on serving from the device and host tiers.

Each engine bounds the bytes it knows of: the files it found at start-up and the ones
it wrote, evicting its least recently used. Engines sharing a directory each keep that
bound over their own view, so the directory holds at most the sum of their bounds.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np

log = logging.getLogger("jaxserve")

MAGIC = b"JXKVBLK1"
VERSION = 1
HEADER = struct.Struct("<8sI32s32s32sQ32s")
SUFFIX = ".kvb"
KEY_FILE = "hash_key"


class HostTier:
    """Byte rows in host memory, LRU, at most max_bytes in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, block_hash: bytes) -> np.ndarray | None:
        row = self._rows.get(block_hash)
        if row is not None:
            self._rows.move_to_end(block_hash)
        return row

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._rows:
            self._rows.move_to_end(block_hash)

    def put(self, block_hash: bytes, row: np.ndarray) -> bool:
        """Keep the row (evicting the least recently used); False: larger than the bound."""
        if row.nbytes > self.max_bytes:
            return False
        old = self._rows.pop(block_hash, None)
        if old is not None:
            self.nbytes -= old.nbytes
        while self._rows and self.nbytes + row.nbytes > self.max_bytes:
            _, evicted = self._rows.popitem(last=False)
            self.nbytes -= evicted.nbytes
        self._rows[block_hash] = row
        self.nbytes += row.nbytes
        return True

    def clear(self) -> None:
        self._rows.clear()
        self.nbytes = 0


def shared_key(directory: Path) -> bytes:
    """The prefix-hash key every engine on this directory shares (so their hashes and
    file names agree, across restarts too): read, or created once atomically."""
    path = directory / KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except FileNotFoundError:
        pass
    tmp = directory / f".{KEY_FILE}.{uuid.uuid4().hex}"
    tmp.write_bytes(os.urandom(32))
    try:
        os.link(tmp, path)              # fails if another engine made it first
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != 32:              # a damaged key file: replace it
            os.replace(tmp, path)
            return path.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()


class DiskTier:
    """Block files in one directory, LRU over the bytes this engine knows of."""

    def __init__(self, directory: str | Path, max_bytes: int, fingerprint: bytes,
                 layout: bytes, row_bytes: int) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.layout = layout
        self.row_bytes = row_bytes
        self.file_bytes = HEADER.size + row_bytes
        self.enabled = True
        self.nbytes = 0
        self.corrupt = 0                # files found damaged or foreign (deleted)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.key = shared_key(self.dir)
            self._scan()
        except OSError as e:
            self.key = b""
            self.disable(e)

    def _scan(self) -> None:
        """Index the block files already there, oldest first (their mtime)."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(SUFFIX) and len(entry.name) == 64 + len(SUFFIX):
                try:
                    st = entry.stat()
                    found.append((st.st_mtime, bytes.fromhex(entry.name[:64]), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, h, size in sorted(found):
            self._index[h] = size
            self.nbytes += size
        self._shrink()

    def disable(self, err: OSError) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("kv offload: disk tier at %s turned off (%s); serving goes on "
                        "from the device and host tiers", self.dir, err)

    def __len__(self) -> int:
        return len(self._index)

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def __contains__(self, block_hash: bytes) -> bool:
        """On disk, as far as this engine can tell (another engine may have written it:
        then it joins the index)."""
        if not self.enabled:
            return False
        with self._lock:
            if block_hash in self._index:
                return True
        if not self.path(block_hash).exists():
            return False
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = self.file_bytes
                self.nbytes += self.file_bytes
            return True

    # ---- worker threads ------------------------------------------------------------
    def header(self, block_hash: bytes, row: np.ndarray) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.fingerprint, self.layout, block_hash,
                           row.nbytes, hashlib.blake2b(row, digest_size=32).digest())

    def write(self, block_hash: bytes, row: np.ndarray) -> bool:
        """Write one block (skipped if already there); False if nothing was written."""
        if not self.enabled or block_hash in self:
            return False
        tmp = self.dir / f".tmp.{os.getpid()}.{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(self.header(block_hash, row))
                f.write(row.tobytes())
            os.replace(tmp, self.path(block_hash))
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.disable(e)
            return False
        with self._lock:
            self._index[block_hash] = self.file_bytes
            self.nbytes += self.file_bytes
        self._shrink()
        return True

    def read(self, block_hash: bytes) -> np.ndarray | None:
        """The block's row, or None: missing, or damaged / foreign (then deleted)."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError:
            self._forget(block_hash)
            return None
        row = self._check(block_hash, data)
        if row is None:
            self.corrupt += 1
            log.info("kv offload: %s is damaged or from another model; deleted", path.name)
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            self._forget(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return row

    def _check(self, block_hash: bytes, data: bytes) -> np.ndarray | None:
        if len(data) != self.file_bytes:
            return None
        magic, version, fp, layout, h, n, digest = HEADER.unpack_from(data)
        if (magic, version, fp, layout, h, n) != (MAGIC, VERSION, self.fingerprint,
                                                  self.layout, block_hash, self.row_bytes):
            return None
        payload = data[HEADER.size:]
        if hashlib.blake2b(payload, digest_size=32).digest() != digest:
            return None
        return np.frombuffer(payload, np.uint8).copy()

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.nbytes -= size

    def _shrink(self) -> None:
        """Delete the least recently used files until within the bound."""
        while True:
            with self._lock:
                if self.nbytes <= self.max_bytes or not self._index:
                    return
                h, size = self._index.popitem(last=False)
                self.nbytes -= size
            try:
                self.path(h).unlink(missing_ok=True)
            except OSError:
                pass
