"""The on-disk index: atomic publication, validation on load, refusal of broken or foreign files."""
import os

import numpy as np
import pytest

import ngram.index_file as index_file
from ngram.index_file import BuildParams, IndexLoadError, load_index, write_index

TURNS = [np.array([1, 2, 3, 4, 5], dtype=np.uint32), np.array([1, 2, 6], dtype=np.uint32)]


def test_round_trip_memory_mapped(tmp_path):
    write_index(tmp_path, TURNS, "fp-a", BuildParams(key_tokens=8, anchor_tokens=2))
    idx = load_index(tmp_path, "fp-a")
    assert idx.params == BuildParams(key_tokens=8, anchor_tokens=2)
    assert [t.tolist() for t in idx.turns()] == [t.tolist() for t in TURNS]
    assert idx.meta["stats"]["tokens"] == 8
    # counts: the key starting "1 2" occurs at two positions but as two different keys
    assert int(idx.counts.sum()) == (5 - 1) + (3 - 1)


def test_other_tokenizer_is_refused(tmp_path):
    write_index(tmp_path, TURNS, "fp-a", BuildParams())
    with pytest.raises(IndexLoadError, match="different tokenizer"):
        load_index(tmp_path, "fp-b")


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "meta", "meta-fields", "unreadable"])
def test_broken_files_are_refused_with_a_message(tmp_path, damage, monkeypatch):
    gen = write_index(tmp_path, TURNS, "fp", BuildParams())
    trie = gen / index_file.TRIE_FILE
    if damage == "truncate":
        trie.write_bytes(trie.read_bytes()[:-7])
    elif damage == "flip":
        data = bytearray(trie.read_bytes())
        data[len(data) // 2] ^= 0xFF
        trie.write_bytes(bytes(data))
    elif damage == "delete":
        trie.unlink()
    elif damage == "meta":
        (gen / index_file.META_FILE).write_bytes(b"\x93garbage")
    elif damage == "meta-fields":  # well-formed, but without the table of its files
        import msgpack

        meta = msgpack.unpackb((gen / index_file.META_FILE).read_bytes())
        del meta["files"]
        (gen / index_file.META_FILE).write_bytes(msgpack.packb(meta))
    else:  # a data file this user cannot read (root reads through permissions: refused by hand here)
        real_open = open

        def guarded_open(file, *args, **kwargs):
            if str(file).endswith(index_file.COUNTS_FILE):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr("builtins.open", guarded_open)
    with pytest.raises(IndexLoadError, match="rebuild|not a Sailfish"):
        load_index(tmp_path, "fp")


@pytest.mark.parametrize("edit", [
    lambda m: m.pop("params"), lambda m: m["params"].update(extra=1), lambda m: m["params"].update(key_tokens="64"),
    lambda m: m["params"].update(anchor_tokens=0), lambda m: m.update(fingerprint=None), lambda m: m.update(stats=3),
    lambda m: m.update(sources=7), lambda m: m.update(sources={"a.jsonl": {"signature": "s"}}),
    lambda m: m.update(sources={"a.jsonl": {"signature": "s", "turn_start": 0, "turn_end": 99}})],
    ids=["no-params", "extra-param", "string-param", "zero-param", "no-fingerprint", "stats", "sources",
         "source-fields", "source-past-corpus"])
def test_metadata_of_the_wrong_shape_is_refused_on_load(tmp_path, edit):
    """The metadata has no CRC: a field a reader uses, missing or of the wrong shape, is refused when the
    index loads (it broke the server's start, /admin/reload-index, the watcher and every incremental
    build with a KeyError or TypeError deep in a reader)."""
    import msgpack

    gen = write_index(tmp_path, TURNS, "fp", BuildParams())
    meta = msgpack.unpackb((gen / index_file.META_FILE).read_bytes())
    edit(meta)
    (gen / index_file.META_FILE).write_bytes(msgpack.packb(meta))
    with pytest.raises(IndexLoadError, match="malformed|past its corpus"):
        load_index(tmp_path, "fp")


def test_missing_index_says_how_to_build_one(tmp_path):
    with pytest.raises(IndexLoadError, match="make index"):
        load_index(tmp_path / "nothing")


def test_empty_corpus_is_never_written(tmp_path):
    with pytest.raises(ValueError, match="empty index"):
        write_index(tmp_path, [], "fp", BuildParams())
    assert not (tmp_path / index_file.CURRENT_LINK).exists()


def test_crash_mid_build_leaves_the_previous_generation_in_service(tmp_path, monkeypatch):
    write_index(tmp_path, TURNS, "fp", BuildParams())

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(index_file, "_write_file_synced", crash)  # dies before publishing
    with pytest.raises(OSError):
        write_index(tmp_path, [np.array([7, 8, 9], dtype=np.uint32)], "fp", BuildParams())
    idx = load_index(tmp_path, "fp")
    assert [t.tolist() for t in idx.turns()] == [t.tolist() for t in TURNS]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".building")]


def test_rebuild_swaps_atomically_and_keeps_one_previous_generation(tmp_path):
    old = write_index(tmp_path, TURNS, "fp", BuildParams())
    mapped = load_index(tmp_path, "fp")  # a reader holding the old generation keeps working
    for i in range(3):
        new = write_index(tmp_path, [np.array([9, i, 9], dtype=np.uint32)], "fp", BuildParams())
    assert (tmp_path / "current").resolve() == new
    assert len(list(tmp_path.glob("gen-*"))) == 2
    assert not old.exists()
    assert len(mapped.trie) > 0


def test_a_build_killed_mid_way_leaves_nothing_behind_the_next_one(tmp_path):
    """A staging folder whose build process is gone (kill -9) is removed by the next build; one of a
    live process is kept."""
    dead = tmp_path / ".building-999999999-1"
    live = tmp_path / f".building-{os.getpid()}-2"
    for staging in (dead, live):
        staging.mkdir(parents=True)
        (staging / "part").write_bytes(b"x")
    write_index(tmp_path, TURNS, "fp", BuildParams())
    assert not dead.exists() and live.exists()
    assert load_index(tmp_path, "fp").num_turns == 2
