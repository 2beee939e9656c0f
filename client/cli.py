"""The `run` command: queue, show a progress bar from websocket events, print artifacts, exit code."""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
from pathlib import Path

from .api import ComfyClient, PromptRejected

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TIMEOUT, EXIT_UNREACHABLE = 0, 1, 2, 3, 4, 5


def node_titles(workflow: dict) -> dict[str, str]:
    """Each node's name as the user sees it in the graph: its title, else its type."""
    return {str(node_id): (node.get("_meta") or {}).get("title") or node.get("class_type", "?")
            for node_id, node in workflow.items() if isinstance(node, dict)}


class TerminalProgress:
    def __init__(self, stream=sys.stderr, titles: dict[str, str] | None = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.titles = titles or {}
        self._drawn = 0  # length of the progress line a terminal shows now
        self.artifacts: list[str] = []

    def named(self, node_id) -> str:
        title = self.titles.get(str(node_id))
        return f'"{title}" (node {node_id})' if title else f"node {node_id}"

    def __call__(self, message: dict):
        kind, data = message.get("type"), message.get("data") or {}
        if kind == "executing" and data.get("node"):
            self._line(f"{self.named(data['node'])} running")
        elif kind == "ingraph.event":
            self._event(data.get("event", {}), data.get("run_id", ""))
        elif kind == "executed":
            for key in ("images", "text"):
                for item in (data.get("output") or {}).get(key, []) or []:
                    if isinstance(item, dict) and item.get("filename"):
                        self.artifacts.append(f"{item.get('type', 'output')}/{item.get('subfolder', '')}/{item['filename']}".replace("//", "/"))

    def _event(self, event: dict, run_id: str):
        kind = event.get("type")
        if kind == "started":
            self._line(f"run {run_id}: {event.get('total')} steps, {event.get('trainable_params')} trainable parameters")
            if event.get("run_dir"):
                self.artifacts.append(f"run folder (loss chart, samples, events): {event['run_dir']}")
        elif kind == "step":
            step, total = event["step"], event["total"]
            width = 30
            bar = "#" * int(width * step / max(total, 1))
            text = (f"[{bar:<{width}}] {step}/{total} loss {event['loss']:.4f} lr {event['lr']:.2e} "
                    f"{event['samples_per_s']:.1f} samples/s eta {event['eta_s']:.0f}s")
            if self.tty:  # over the last line, padded to its length (a shorter line left its end behind: "0ss")
                self.stream.write("\r" + text.ljust(self._drawn) + ("\n" if step == total else ""))
                self._drawn = 0 if step == total else len(text)
                self.stream.flush()
            elif step == total or step % max(1, total // 20) == 0:
                self._line(text)
        elif kind == "eval":
            self._line(f"eval at step {event['step']}: loss {event['loss']:.4f}")
        elif kind == "checkpoint":
            self._line(f"checkpoint at step {event['step']}: {event['path']}")
        elif kind == "finished":
            if event.get("adapter"):
                self.artifacts.append(event["adapter"])
        elif kind == "error":
            self._line(f"trainer error: {event.get('message')}")

    def _line(self, text: str):
        if self._drawn:  # below the progress line, not on it
            self.stream.write("\n")
            self._drawn = 0
        self.stream.write(text + "\n")
        self.stream.flush()


def run_command(opts) -> int:
    try:
        workflow = json.loads(Path(opts.workflow).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: cannot read workflow {opts.workflow}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not isinstance(workflow, dict) or "nodes" in workflow:
        print(f"error: {opts.workflow} is not an API-format workflow (in ComfyUI: Workflow > Export (API))",
              file=sys.stderr)
        return EXIT_USAGE
    client = ComfyClient(opts.server)
    progress = TerminalProgress(titles=node_titles(workflow))
    try:
        prompt_id = client.queue(workflow)
        print(f"queued {prompt_id} on {opts.server}", file=sys.stderr)
        outcome = client.follow(prompt_id, timeout=opts.timeout, on_message=progress)
    except PromptRejected as exc:
        print(f"error: the server rejected the workflow: {json.dumps(exc.body, indent=1)[:4000]}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, urllib.error.URLError) as exc:
        print(f"error: cannot reach ComfyUI at {opts.server}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        client.close()
    for artifact in progress.artifacts:
        print(artifact)
    if outcome.ok:
        return EXIT_OK
    if outcome.status == "execution_interrupted":
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if outcome.status == "timeout":
        print(f"timed out after {opts.timeout} s (the prompt may still be running)", file=sys.stderr)
        return EXIT_TIMEOUT
    err = outcome.error or {}
    print(f"failed in {progress.named(err.get('node_id'))}, a {err.get('node_type')}: {err.get('exception_message')}",
          file=sys.stderr)
    return EXIT_FAILED


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ingraph-client", description="Run ComfyUI workflows headless.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="queue an API-format workflow and follow it to the end")
    run.add_argument("workflow", help="API-format workflow JSON (Workflow > Export (API) in ComfyUI)")
    run.add_argument("--server", default="127.0.0.1:8188", help="ComfyUI address, HOST:PORT")
    run.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to follow the prompt")
    opts = parser.parse_args(argv)
    return run_command(opts)
