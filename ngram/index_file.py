"""The on-disk n-gram index: write it atomically, load it memory-mapped, refuse it when broken.

Layout. An index is a directory. Each build writes a complete generation `gen-<n>/` and then swaps the
symlink `current` to it with one atomic rename, so a reader never sees a half-written index and a
crash mid-build leaves the previous generation in service. A generation holds:
  ngrams.marisa  marisa-trie of keys: for every position p of every indexed turn, the encoded tokens
                 turn[p : p + key_tokens] (turn = last `anchor_tokens` prompt tokens + the assistant's
                 generated tokens). Keys are deduplicated; shared prefixes are stored once.
  counts.u32     uint32 per trie key id: how many positions produced that key (frequency weights).
  corpus.u32     the indexed turns' tokens back to back (lets a rebuild add new traces without
                 re-tokenizing the old ones); corpus_offsets.u64 marks turn boundaries.
  meta.msgpack   format name and version, tokenizer fingerprint, build parameters, statistics,
                 the source files indexed, and size + CRC-32 of every other file.
Loading checks the format, the CRC and size of every file, and the tokenizer fingerprint, and raises
`IndexLoadError` with a message that says what is wrong; it never returns a partial index.
"""
from __future__ import annotations

import os
import shutil
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import marisa_trie
import msgpack
import numpy as np

from ngram.codec import encode

FORMAT_NAME = "sailfish-ngram-index"
FORMAT_VERSION = 1
CURRENT_LINK = "current"
TRIE_FILE = "ngrams.marisa"
COUNTS_FILE = "counts.u32"
CORPUS_FILE = "corpus.u32"
OFFSETS_FILE = "corpus_offsets.u64"
META_FILE = "meta.msgpack"
_DATA_FILES = (TRIE_FILE, COUNTS_FILE, CORPUS_FILE, OFFSETS_FILE)


class IndexLoadError(RuntimeError):
    """The index cannot be used: missing, truncated, corrupted, or built for another tokenizer."""


@dataclass(frozen=True)
class BuildParams:
    # Longest key: bounds match length plus the continuation a scan reads. 64 lets followed rows
    # outlive a fully accepted 16-token draft (match 16 + 17 new tokens), so long accepted runs need
    # no trie search; on the BFCL replay 64 gave multi-turn tau 11.6 vs 11.0 for 32 at a lower
    # proposal p50, for 8.0 vs 6.7 bytes per token on disk.
    key_tokens: int = 64
    anchor_tokens: int = 6    # prompt tokens kept before each turn so turn starts can be matched

    def as_dict(self) -> dict:
        return {"key_tokens": self.key_tokens, "anchor_tokens": self.anchor_tokens}


@dataclass
class NgramIndex:
    """A loaded (memory-mapped) index. `trie` keys are encoded token strings; `counts[key_id]`."""

    path: Path
    trie: marisa_trie.Trie
    counts: np.ndarray
    corpus: np.ndarray
    offsets: np.ndarray
    meta: dict = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def params(self) -> BuildParams:
        return BuildParams(**self.meta["params"])

    @property
    def num_turns(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def turns(self) -> Iterable[np.ndarray]:
        for i in range(self.num_turns):
            yield self.corpus[self.offsets[i] : self.offsets[i + 1]]


def count_keys(turns: Iterable[Sequence[int]], key_tokens: int) -> Counter:
    """Key string -> number of positions that produced it (keys shorter than 2 tokens carry nothing)."""
    counter: Counter = Counter()
    for turn in turns:
        text = encode(turn)
        last = len(text) - 1
        counter.update(text[p : p + key_tokens] for p in range(last))
    return counter


def write_index(
    out_dir: str | os.PathLike,
    turns: Sequence[np.ndarray],
    fingerprint: str,
    params: BuildParams,
    extra_meta: dict | None = None,
) -> Path:
    """Build the trie over `turns` (anchor + generated token ids each) and publish it atomically.

    Returns the path of the new generation. Raises ValueError on an empty corpus: an empty index is
    never written.
    """
    if not turns or sum(len(t) for t in turns) == 0:
        raise ValueError("no usable turns: refusing to write an empty index")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(out)
    staging = out / f".building-{os.getpid()}-{time.time_ns()}"
    staging.mkdir()
    try:
        counter = count_keys(turns, params.key_tokens)
        keys = list(counter.keys())
        # weights order each node's children by frequency, so prefix scans meet heavy keys first
        trie = marisa_trie.Trie(keys, weights=[counter[k] for k in keys])
        counts = np.zeros(len(trie), dtype=np.uint32)
        for key, n in counter.items():
            counts[trie.key_id(key)] = n
        trie.save(str(staging / TRIE_FILE))
        counts.tofile(staging / COUNTS_FILE)
        lengths = np.fromiter((len(t) for t in turns), dtype=np.uint64, count=len(turns))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
        corpus = np.concatenate([np.asarray(t, dtype=np.uint32) for t in turns])
        corpus.tofile(staging / CORPUS_FILE)
        offsets.tofile(staging / OFFSETS_FILE)
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "params": params.as_dict(),
            "stats": {"turns": len(turns), "tokens": int(corpus.shape[0]), "keys": len(trie)},
            "created": time.time(),
            **(extra_meta or {}),
            "files": {name: _file_record(staging / name) for name in _DATA_FILES},
        }
        _write_file_synced(staging / META_FILE, msgpack.packb(meta))
        generation = _publish(out, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return generation


def _file_record(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _write_file_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _publish(out: Path, staging: Path) -> Path:
    """Rename the staged build to the next generation and swap `current` to it atomically."""
    existing = [int(p.name[4:]) for p in out.glob("gen-*") if p.name[4:].isdigit()]
    generation = out / f"gen-{max(existing, default=0) + 1}"
    os.rename(staging, generation)
    link_tmp = out / f".current-{os.getpid()}-{time.time_ns()}"
    os.symlink(generation.name, link_tmp)
    os.replace(link_tmp, out / CURRENT_LINK)  # the atomic step
    _prune_old_generations(out, keep={generation.name})
    return generation


def _prune_old_generations(out: Path, keep: set[str], retain: int = 2) -> None:
    """Keep the newest `retain` generations (a running server may still map the previous one)."""
    gens = sorted((p for p in out.glob("gen-*") if p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))
    for old in gens[:-retain]:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def resolve_generation(path: str | os.PathLike) -> Path:
    """An index directory (with `current`) or a generation directory -> the generation to load."""
    p = Path(path)
    if (p / CURRENT_LINK).exists():
        return (p / CURRENT_LINK).resolve()
    if (p / META_FILE).exists():
        return p
    raise IndexLoadError(f"no n-gram index at {p} (expected {CURRENT_LINK}/ or {META_FILE}); build one with `make index`")


def _remove_abandoned_builds(out: Path) -> None:
    """Staging folders of builds whose process is gone (killed mid-build): never published, removed.
    A build still running (its process alive) keeps its folder. Liveness is this machine's process
    table: an index directory shared with builds on another host or PID namespace is not supported."""
    for staging in out.glob(".building-*"):
        try:
            pid = int(staging.name.split("-")[1])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def load_index(path: str | os.PathLike, expected_fingerprint: str | None = None) -> NgramIndex:
    """Load and validate an index, memory-mapping its arrays. See the module docstring. Whatever is
    wrong with it (its files unreadable, its metadata missing fields) is an IndexLoadError."""
    try:
        return _load_index(path, expected_fingerprint)
    except IndexLoadError:
        raise
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise IndexLoadError(f"the index at {path} cannot be read ({type(e).__name__}: {e}); rebuild it") from e


def _load_index(path: str | os.PathLike, expected_fingerprint: str | None) -> NgramIndex:
    gen = resolve_generation(path)
    try:
        meta = msgpack.unpackb((gen / META_FILE).read_bytes())
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise IndexLoadError(f"index metadata at {gen} is unreadable ({e}); rebuild the index") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise IndexLoadError(f"{gen} is not a Sailfish n-gram index")
    if meta.get("version") != FORMAT_VERSION:
        raise IndexLoadError(f"index format version {meta.get('version')!r} at {gen}; this Sailfish reads {FORMAT_VERSION}: rebuild it")
    for name in _DATA_FILES:
        record = meta["files"].get(name)
        actual = _file_record(gen / name) if (gen / name).exists() else None
        if actual is None or record is None:
            raise IndexLoadError(f"index file {name} missing in {gen}; rebuild the index")
        if actual["bytes"] != record["bytes"]:
            raise IndexLoadError(f"index file {name} in {gen} is truncated or altered ({actual['bytes']} bytes, expected {record['bytes']}); rebuild the index")
        if actual["crc32"] != record["crc32"]:
            raise IndexLoadError(f"index file {name} in {gen} is corrupted (CRC mismatch); rebuild the index")
    _check_meta_fields(meta, gen)
    if expected_fingerprint is not None and meta["fingerprint"] != expected_fingerprint:
        raise IndexLoadError(
            f"index at {gen} was built for a different tokenizer (fingerprint {meta['fingerprint'][:12]}, "
            f"this model's is {expected_fingerprint[:12]}); rebuild it with this model's tokenizer"
        )
    trie = marisa_trie.Trie()
    try:
        trie.mmap(str(gen / TRIE_FILE))
    except Exception as e:  # marisa raises plain exceptions on malformed files
        raise IndexLoadError(f"n-gram trie in {gen} cannot be mapped ({e}); rebuild the index") from e
    counts = _memmap_or_empty(gen / COUNTS_FILE, np.uint32)
    if counts.shape[0] != len(trie):
        raise IndexLoadError(f"index at {gen} is inconsistent ({counts.shape[0]} counts for {len(trie)} keys)")
    corpus = _memmap_or_empty(gen / CORPUS_FILE, np.uint32)
    offsets = _memmap_or_empty(gen / OFFSETS_FILE, np.uint64)
    if any(v["turn_end"] > max(0, offsets.shape[0] - 1) for v in meta.get("sources", {}).values()):
        raise IndexLoadError(f"index metadata at {gen} names turns past its corpus; rebuild the index")
    return NgramIndex(path=gen, trie=trie, counts=counts, corpus=corpus, offsets=offsets, meta=meta)


def _check_meta_fields(meta: dict, gen: Path) -> None:
    """The metadata's fields that readers use have the shapes a build writes (the data files have CRCs;
    the metadata has none, so an edited or damaged one is caught here rather than in a reader)."""
    def refuse(what: str):
        raise IndexLoadError(f"index metadata at {gen} is malformed ({what}); rebuild the index")

    if not isinstance(meta.get("fingerprint"), str):
        refuse("no tokenizer fingerprint")
    params = meta.get("params")
    fields = BuildParams().as_dict()
    if not isinstance(params, dict) or set(params) != set(fields) or not all(
            type(params[k]) is int and params[k] > 0 for k in fields):
        refuse(f"build parameters {params!r:.80}, expected positive integers {sorted(fields)}")
    if not isinstance(meta.get("stats", {}), dict):
        refuse("stats is not a map")
    sources = meta.get("sources", {})
    if not isinstance(sources, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("signature"), str)
            and type(v.get("turn_start")) is int and type(v.get("turn_end")) is int
            and 0 <= v["turn_start"] <= v["turn_end"] for k, v in sources.items()):
        refuse("a source record without its signature and turn range")


def _memmap_or_empty(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r").view(np.ndarray)  # plain indexing is 10x faster
