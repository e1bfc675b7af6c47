"""Hot reload of the n-gram index: a rebuilt index goes into service without a restart.

Contract: `IndexReloader(engine, settings).reload()` loads the index directory's current generation
and, when it is new and valid, swaps the engine's drafter for one over it; it returns a
`ReloadResult`: RELOADED, UNCHANGED (already in service, or drafting off) or REFUSED, and a message
for people. A broken index, or one built for another tokenizer, is refused with the loader's message
and the index in service stays. Three triggers call it: POST /admin/reload-index (guarded by
the API key like /v1/*), SIGHUP, and a watcher thread that checks the index's `current` link every
`--watch-index` seconds (0: off) and does not retry a generation refused once (each build publishes a
new one). `note` is what the latest reload put in service, whoever triggered it (/health's "drafting").

In-flight requests are never altered: a request's draft session holds the drafter it started with,
and the swap is one attribute assignment, so new requests see the new index and running ones finish
on the old (whose files stay mapped; the builder keeps the previous generation on disk). Drafting is
lossless either way, so outputs cannot differ. The online overlay carries over to the new drafter.
"""
from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from common.paths import default_index_dir
from common.tokenizer import tokenizer_fingerprint
from server.tool_schema import make_drafter
from ngram.index_file import IndexLoadError, load_index, resolve_generation

log = logging.getLogger("sailfish.reload")


ReloadStatus = enum.Enum("ReloadStatus", "RELOADED UNCHANGED REFUSED")


@dataclass(frozen=True)
class ReloadResult:
    status: ReloadStatus
    message: str  # for people: what the HTTP answer and the log say


class IndexReloader:
    def __init__(self, engine, settings):
        self.engine = engine
        self.settings = settings
        self.directory = Path(settings.index) if settings.index else default_index_dir()
        self.fingerprint = tokenizer_fingerprint(engine.tokenizer)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.note: str | None = None       # what the last reload put in service (/health's "drafting")
        self._refused: Path | None = None  # a generation refused once: the watcher does not retry it

    def in_service(self) -> Path | None:
        """The index generation the engine's drafter serves; None when it has no index (drafting
        off, or from the live context alone)."""
        index = getattr(self.engine._drafter, "index", None)
        return Path(index.path) if index is not None else None

    def reload(self) -> ReloadResult:
        if not self.settings.draft:
            return ReloadResult(ReloadStatus.UNCHANGED, "drafting is off (--no-draft): there is no index to reload")
        with self._lock:
            generation = None
            try:
                generation = resolve_generation(self.directory)
                if generation == self.in_service():
                    return ReloadResult(ReloadStatus.UNCHANGED, f"unchanged: {generation.name} is already in service")
                index = load_index(generation, self.fingerprint)
            except IndexLoadError as e:
                log.warning("index reload refused: %s", e)
                self._refused = generation
                return ReloadResult(ReloadStatus.REFUSED, f"refused: {e}; the index in service stays")
            old = self.engine._drafter
            drafter = make_drafter(index, self.settings.drafter, self.engine.tokenizer)
            if old is not None and getattr(old, "overlay", None) is not None:
                drafter.overlay = old.overlay
            self.engine.set_drafter(drafter)
            message = f"index {generation.name} in service: {index.num_turns} turns, {len(index.trie)} keys"
            log.info("%s", message)
            self.note = message
            return ReloadResult(ReloadStatus.RELOADED, message)

    def watch(self, every_s: float) -> None:
        """Poll the index's `current` link in a daemon thread and reload when it moves. A generation
        refused once is not read again (each build publishes a new one): no warning every poll."""
        def loop():
            while not self._stop.wait(every_s):
                try:
                    generation = resolve_generation(self.directory)
                except IndexLoadError:
                    continue
                if generation != self.in_service() and generation != self._refused:
                    try:
                        self.reload()  # a refusal records the generation it refused
                    except Exception:   # the watcher outlives whatever one generation does to it
                        log.exception("index reload of %s failed; the index in service stays", generation.name)
                        self._refused = generation
        threading.Thread(target=loop, name="index-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
