"""A small synchronous client for ComfyUI's API: queue a prompt, follow its websocket messages."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Callable

TERMINAL = ("execution_success", "execution_error", "execution_interrupted")


class PromptRejected(RuntimeError):
    """POST /prompt refused the workflow (validation errors per node)."""

    def __init__(self, status: int, body: dict):
        self.status, self.body = status, body
        super().__init__(f"prompt rejected ({status}): {json.dumps(body)[:2000]}")


@dataclass
class Outcome:
    prompt_id: str
    status: str  # execution_success | execution_error | execution_interrupted | timeout
    messages: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "execution_success"

    def of_type(self, kind: str) -> list[dict]:
        return [m["data"] for m in self.messages if m.get("type") == kind]

    @property
    def error(self) -> dict | None:
        errors = self.of_type("execution_error")
        return errors[-1] if errors else None


class ComfyClient:
    def __init__(self, server: str = "127.0.0.1:8188", client_id: str | None = None):
        self.base = server if server.startswith("http") else f"http://{server}"
        self.client_id = client_id or uuid.uuid4().hex
        self._ws = None

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 30.0):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return json.loads(raw) if raw and resp.headers.get_content_type() == "application/json" else raw

    def get(self, path: str, timeout: float = 30.0):
        return self._request("GET", path, timeout=timeout)

    def post(self, path: str, body: dict | None = None, timeout: float = 30.0):
        return self._request("POST", path, body if body is not None else {}, timeout=timeout)

    def ready(self) -> bool:
        try:
            self.get("/system_stats", timeout=2)
            return True
        except (OSError, urllib.error.URLError):
            return False

    def connect(self):
        import websocket  # websocket-client
        if self._ws is None:
            url = self.base.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}"
            self._ws = websocket.create_connection(url, timeout=30)
        return self

    def close(self):
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def queue(self, prompt: dict) -> str:
        self.connect()
        try:
            reply = self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = {"error": body.decode("utf-8", "replace")}
            raise PromptRejected(exc.code, parsed) from None
        if reply.get("node_errors"):
            # ComfyUI still runs the outputs that are valid; the graph as a whole is not
            raise PromptRejected(200, reply)
        return reply["prompt_id"]

    def interrupt(self):
        self.post("/interrupt", {})

    def follow(self, prompt_id: str, timeout: float = 600.0,
               on_message: Callable[[dict], None] | None = None) -> Outcome:
        """Reads websocket messages until the prompt ends (or `timeout` seconds pass)."""
        import websocket
        self.connect()
        outcome = Outcome(prompt_id, "timeout")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._ws.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
            try:
                raw = self._ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            if isinstance(raw, bytes):  # binary preview frames
                continue
            message = json.loads(raw)
            data = message.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            outcome.messages.append(message)
            if on_message:
                on_message(message)
            if message.get("type") in TERMINAL:
                outcome.status = message["type"]
                break
        return outcome

    def wait_for_step(self, prompt_id: str, at_least: int = 0, timeout: float = 240.0) -> tuple[dict, int]:
        """Follows the prompt's websocket messages until a training step numbered `at_least` or more: (that
        ingraph.event message's data, the first step number seen). RuntimeError if the prompt ends first, or after
        `timeout` seconds."""
        import websocket
        self.connect()
        deadline, first = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            self._ws.settimeout(5)
            try:
                raw = self._ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            if isinstance(raw, bytes):
                continue
            message = json.loads(raw)
            data = message.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if message.get("type") == "ingraph.event" and data["event"]["type"] == "step":
                first = data["event"]["step"] if first is None else first
                if data["event"]["step"] >= at_least:
                    return data, first
            if message.get("type") in TERMINAL:
                raise RuntimeError(f"the prompt ended before training step {at_least}: {json.dumps(message)[:2000]}")
        raise RuntimeError(f"no training step {at_least} within {timeout} s")

    def run(self, prompt: dict, timeout: float = 600.0, on_message=None) -> Outcome:
        return self.follow(self.queue(prompt), timeout, on_message)
