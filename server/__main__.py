"""`python -m server [--port 22343] [--model M] [--index DIR] [--no-draft] ...`: serve the OpenAI API.

Loads the model (the bundled Gemma 3 270M by default) and the default index, logs what it chose
(model, quantization, device, index, verify cost curve), then serves on 127.0.0.1:22343 under
uvicorn. `python -m server --help` lists every option (see server.settings).
"""
from __future__ import annotations

import logging
import signal
import socket
import sys

from server.settings import Settings


def _stop(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the server; Ctrl-C or SIGTERM at any point (loading included) stops it quietly with status 0:
    while loading, `_stop` turns the signal into KeyboardInterrupt, which ends here; while serving,
    uvicorn shuts down gracefully (see `_serve`)."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        return _serve(argv)
    except KeyboardInterrupt:
        logging.getLogger("sailfish").info("stopped")
        return 0


def _serve(argv: list[str] | None) -> int:
    settings = Settings.from_args(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("sailfish")

    from common.progress import phase

    with phase("starting Sailfish: importing torch and transformers", "a few seconds", say=log.info):
        import uvicorn

        from server.app import create_app
        from server.model_loading import ModelNotFoundError
        from server.serving import Service, load_engine

    try:
        sock = bound_socket(settings.host, settings.port)
    except OSError as e:
        log.error("cannot serve on %s port %d: %s", settings.host, settings.port, e.strerror or e)
        return 2
    if settings.trace_log and settings.trace_dir is not None:
        from common.paths import unwritable

        problem = unwritable(settings.trace_dir, directory=True)
        if problem:
            sock.close()
            log.error("cannot keep the trace log in --trace-dir: %s (--no-trace-log turns it off)", problem)
            return 2
    try:
        engine, note = load_engine(settings)
    except (ModelNotFoundError, ValueError) as e:
        sock.close()
        log.error("cannot load the model: %s", e)
        return 2
    service = Service(engine, settings, note)
    if service.trace_log is not None:
        log.info("trace log: %s (rotates at %d MB; --no-trace-log to turn off)",
                 service.trace_log.directory, settings.trace_rotate_mb)
    else:
        log.info("trace log: off")
    log.info("API key: %s", "required on /v1/*" if settings.api_key else "none (open on this interface)")
    import threading

    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=service.reload_index, daemon=True).start())
    if settings.draft and settings.watch_index > 0:
        service.reloader.watch(settings.watch_index)
    log.info("index reload: SIGHUP, POST /admin/reload-index%s",
             f", or automatically within {settings.watch_index:g} s of a rebuild" if settings.watch_index > 0 else "")
    log.info("serving %s on http://%s:%d/v1", engine.model_id, settings.host, sock.getsockname()[1])
    # While it serves, uvicorn handles SIGINT/SIGTERM itself (a graceful shutdown) and re-raises the
    # signal to the handler it found once done: a quiet one here, so that stopping is not a traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    freeze_start_up_objects(log)
    level = settings.log_level if settings.log_level != "info" else "warning"
    # The scheduler starts and stops here rather than in the app's lifespan (which tests and benches
    # serving the app on a thread use): a second Ctrl-C makes uvicorn cancel the lifespan task, whose
    # CancelledError it logs as a traceback.
    uvicorn_config = uvicorn.Config(create_app(service), log_level=level, lifespan="off")
    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Ctrl-C / SIGTERM: requests in flight stop at their next step (each client gets a 503 in
            # its API's error shape), so the shutdown does not wait for whole generations
            service.scheduler.cancel_all()
            super().handle_exit(sig, frame)

    service.scheduler.start()
    try:
        StoppingServer(uvicorn_config).run(sockets=[sock])
    finally:
        service.scheduler.cancel_all()
        service.scheduler.stop()
    log.info("stopped")
    return 0


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so that a port in use or a host that is not
    this machine's is said at once (not after loading), and port 0 names the port it got. uvicorn
    listens on it once serving starts: until then a client is refused, never left waiting. With
    SO_REUSEADDR (a restart need not wait out TIME_WAIT), two servers started at the same moment
    can both bind; the second then fails when uvicorn listens, after loading."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def freeze_start_up_objects(log: logging.Logger) -> None:
    """Move every object alive once loading is done (the model's, the tokenizer's and the index's
    Python objects) out of the cyclic collector's reach, as vLLM does after start-up; objects made
    later are collected as before. Why: a full collection walks them all while holding the GIL, and
    requests trigger one every so often. Measured with 4 drafted streams of the bundled model on 2
    cores (a gc.callbacks log): one full collection of 163 ms inside a 3.4 s phase, which every
    lane's forward waited for; with the freeze none over 2 ms in that phase."""
    import gc

    gc.collect()
    gc.freeze()
    log.info("%d start-up objects frozen out of the garbage collector", gc.get_freeze_count())


if __name__ == "__main__":
    sys.exit(main())
