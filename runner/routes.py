"""HTTP routes over run records. Run ids are validated; nothing outside the runs directory is read.

Every handler that touches files does it in a worker thread: ComfyUI's event loop answers the UI meanwhile.
"""
from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from aiohttp import web

from ..trainer.run.layout import SAMPLES_DIR, STOP_FILE
from . import paths
from .run_record import RECORDS, json_dumps, open_regular_file
from .runs import run_dir_for

EVENTS_PAGE = 10_000  # events per GET .../events answer unless the client asks for fewer (or up to MAX)
EVENTS_PAGE_MAX = 50_000
SAMPLE_MAX_BYTES = 64 << 20


def run_record(run_dir: Path) -> dict:
    return RECORDS.record(run_dir)


def _json(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="application/json")


async def _in_thread(function, *args):
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


def _lookup(run_id: str) -> Path:
    run_dir = run_dir_for(paths.runs_root(), run_id)
    if run_dir is None:
        raise web.HTTPNotFound(text="unknown run")
    return run_dir


def _query_int(request, name: str, default: int) -> int:
    try:
        return max(0, int(request.query.get(name, str(default))))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer")


async def list_runs(request):
    return _json(await _in_thread(lambda: json_dumps({"runs": RECORDS.listing(paths.runs_root())})))


async def get_run(request):
    run_id = request.match_info["run_id"]
    return _json(await _in_thread(lambda: json_dumps(run_record(_lookup(run_id)))))


async def get_events(request):
    """?since=N (event number, 0 first) &limit=M: a page of events; `next` is where the following page starts."""
    run_id = request.match_info["run_id"]
    since = _query_int(request, "since", 0)
    limit = min(_query_int(request, "limit", EVENTS_PAGE), EVENTS_PAGE_MAX)

    def page():
        events, total = RECORDS.events(_lookup(run_id), since, limit)
        return json_dumps({"since": since, "next": since + len(events) if events else max(since, total),
                           "total": total, "events": events})
    return _json(await _in_thread(page))


def _read_sample(run_dir: Path, name: str) -> bytes | None:
    """A PNG directly inside the run's samples folder: no symlink (the folder's or the file's), nothing else."""
    if ("/" in name or "\\" in name or "\0" in name or name.startswith(".") or not name.endswith(".png")
            or Path(name).name != name):
        return None
    folder = run_dir / SAMPLES_DIR
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode) or folder.resolve().parent != run_dir:
            return None
    except OSError:
        return None
    if os.open in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW"):  # no symlink swapped in after the checks
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            return None
        finally:
            os.close(dir_fd)
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            return None
    else:
        path = folder / name
        if path.resolve().parent != folder.resolve():
            return None
        f = open_regular_file(path)
        if f is None:
            return None
    with f:
        data = f.read(SAMPLE_MAX_BYTES + 1)
    return data if len(data) <= SAMPLE_MAX_BYTES else None


async def get_sample(request):
    """A preview image of the run (only PNG files directly inside its samples folder)."""
    run_id, name = request.match_info["run_id"], request.match_info["name"]
    data = await _in_thread(lambda: _read_sample(_lookup(run_id), name))
    if data is None:
        raise web.HTTPNotFound(text="unknown sample")
    return web.Response(body=data, content_type="image/png", headers={"Cache-Control": "max-age=3600"})


def _request_stop(run_id: str) -> tuple[dict, int]:
    run_dir = _lookup(run_id)
    state = run_record(run_dir)["state"]
    if state != "running":
        return {"id": run_dir.name, "state": state, "stop_requested": False}, 409
    # never through a symlink planted as STOP: that would truncate whatever file it points at
    try:
        fd = os.open(run_dir / STOP_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        return {"id": run_dir.name, "state": state, "stop_requested": False,
                "error": f"could not write {STOP_FILE}: {e.strerror}"}, 500
    with os.fdopen(fd, "w") as f:
        f.write("stop requested\n")
    return {"id": run_dir.name, "state": "running", "stop_requested": True}, 200


async def stop_run(request):
    body, status = await _in_thread(_request_stop, request.match_info["run_id"])
    return _json(json_dumps(body), status)


def _with_cache_store(action):
    from ..cache.store import CacheStore
    store = CacheStore(paths.cache_root())
    try:
        return json_dumps(action(store))
    finally:
        store.close()


async def cache_info(request):
    return _json(await _in_thread(_with_cache_store, lambda store: store.stats()))


async def cache_prune(request):
    return _json(await _in_thread(_with_cache_store, lambda store: {**store.prune(), "after": store.stats()}))


def register(routes):
    routes.get("/ingraph/cache")(cache_info)
    routes.post("/ingraph/cache/prune")(cache_prune)
    routes.get("/ingraph/runs")(list_runs)
    routes.get("/ingraph/runs/{run_id}")(get_run)
    routes.get("/ingraph/runs/{run_id}/events")(get_events)
    routes.post("/ingraph/runs/{run_id}/stop")(stop_run)
    routes.get("/ingraph/runs/{run_id}/samples/{name}")(get_sample)


try:
    from server import PromptServer
    if getattr(PromptServer, "instance", None) is not None:
        register(PromptServer.instance.routes)
except ImportError:  # imported outside a ComfyUI server (tests, tools)
    pass
