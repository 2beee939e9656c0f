"""HTTP routes over run records. Run ids are validated; nothing outside the runs directory is read."""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

from ..trainer.events import read_events
from ..trainer.layout import EVENTS_FILE, PID_FILE, SAMPLES_DIR, STOP_FILE
from ..trainer.process_state import process_gone
from . import paths
from .runs import complete_checkpoints, read_owner, run_dir_for

TERMINAL = {"finished": "finished", "error": "failed"}


def _alive(run_dir: Path) -> bool:
    try:
        pid = int((run_dir / PID_FILE).read_text())
    except (OSError, ValueError):
        return False
    return not process_gone(pid)


def run_record(run_dir: Path, with_events: bool = False) -> dict:
    events = read_events(run_dir / EVENTS_FILE)
    last = events[-1] if events else None
    terminal = next((e for e in reversed(events) if e["type"] in TERMINAL), None)
    if terminal is not None:
        state = "stopped" if terminal.get("stopped") else TERMINAL[terminal["type"]]
    elif _alive(run_dir):
        state = "running"
    else:
        state = "interrupted" if events else "pending"
    last_step = next((e for e in reversed(events) if e["type"] == "step"), None)
    evals = [e for e in events if e["type"] == "eval"]
    best = min(evals, key=lambda e: (e["loss"], e["step"])) if evals else None
    record = {
        "id": run_dir.name, "node": read_owner(run_dir), "state": state, "last_event": last, "events": len(events),
        "step": last_step["step"] if last_step else 0, "total": last_step["total"] if last_step else None,
        "artifacts": {
            "adapter": terminal.get("adapter") if terminal else None,
            "checkpoints": complete_checkpoints(run_dir),
            "samples": [path for e in events if e["type"] == "sample" for path in e.get("images", [])],
        },
        "best_eval": {"step": best["step"], "loss": best["loss"]} if best else None,
    }
    return record


def _lookup(request) -> Path:
    run_dir = run_dir_for(paths.runs_root(), request.match_info["run_id"])
    if run_dir is None:
        raise web.HTTPNotFound(text="unknown run")
    return run_dir


async def list_runs(request):
    root = paths.runs_root()
    runs = [run_record(p) for p in sorted(root.iterdir(), reverse=True) if p.is_dir()] if root.is_dir() else []
    return web.json_response({"runs": runs})


async def get_run(request):
    return web.json_response(run_record(_lookup(request)))


async def get_events(request):
    run_dir = _lookup(request)
    try:
        since = max(0, int(request.query.get("since", "0")))
    except ValueError:
        raise web.HTTPBadRequest(text="since must be an integer")
    events = read_events(run_dir / EVENTS_FILE)
    return web.json_response({"since": since, "next": len(events), "events": events[since:]})


async def get_sample(request):
    """A preview image of the run (only PNG files directly inside its samples folder)."""
    run_dir = _lookup(request)
    name = request.match_info["name"]
    path = run_dir / SAMPLES_DIR / name
    if "/" in name or name.startswith(".") or not name.endswith(".png") or not path.is_file():
        raise web.HTTPNotFound(text="unknown sample")
    return web.FileResponse(path, headers={"Cache-Control": "max-age=3600"})


async def stop_run(request):
    run_dir = _lookup(request)
    record = run_record(run_dir)
    if record["state"] != "running":
        return web.json_response({"id": run_dir.name, "state": record["state"], "stop_requested": False}, status=409)
    (run_dir / STOP_FILE).write_text("stop requested\n")
    return web.json_response({"id": run_dir.name, "state": "running", "stop_requested": True})


async def cache_info(request):
    from ..cache.store import CacheStore
    store = CacheStore(paths.cache_root())
    try:
        return web.json_response(store.stats())
    finally:
        store.close()


async def cache_prune(request):
    from ..cache.store import CacheStore
    store = CacheStore(paths.cache_root())
    try:
        result = store.prune()
        return web.json_response({**result, "after": store.stats()})
    finally:
        store.close()


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
