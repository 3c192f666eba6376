"""Start a real ComfyUI (``main.py --cpu``) with this pack and a models tree, and talk to it.

The host is found through ``SDVG_COMFYUI_DIR`` (the ComfyUI tree) and ``SDVG_COMFYUI_PYTHON`` (its venv's python).
The pack is loaded from outside the ComfyUI tree: a temp folder holds a symlink ``sdvg`` → this repository and
an ``extra_model_paths.yaml`` maps ``custom_nodes`` to it and the model folders to the given models dir.
A tiny stdlib websocket client (text + binary frames, no extensions) records what the server sends.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK_FOLDER = "sdvg"
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "image_reward", "loras")


def host_configs() -> list[tuple[str, Path, str]]:
    """Every configured ComfyUI host as (label, tree, python), each tested in turn:

    ``SDVG_COMFYUI_HOSTS="TREE=PYTHON;TREE=PYTHON"`` (e.g. v0.3.64 and v0.27.0) and/or the single pair
    ``SDVG_COMFYUI_DIR`` + ``SDVG_COMFYUI_PYTHON``. The label is the tree's ComfyUI version."""
    pairs = [item.split("=", 1) for item in os.environ.get("SDVG_COMFYUI_HOSTS", "").split(";") if "=" in item]
    comfy_dir, python = os.environ.get("SDVG_COMFYUI_DIR"), os.environ.get("SDVG_COMFYUI_PYTHON")
    if comfy_dir and python:
        pairs.append([comfy_dir, python])
    seen, hosts = set(), []
    for tree, py in pairs:
        tree_path = Path(tree.strip()).resolve()
        if tree_path not in seen:
            seen.add(tree_path)
            hosts.append((comfy_version(tree_path), tree_path, py.strip()))
    return hosts


def host_config() -> tuple[Path, str] | None:
    """The first configured host (the browser tests use one)."""
    hosts = host_configs()
    return (hosts[0][1], hosts[0][2]) if hosts else None


def comfy_version(tree: Path) -> str:
    try:
        text = (tree / "comfyui_version.py").read_text(encoding="utf-8")
    except OSError:
        return tree.name
    found = re.search(r"__version__\s*=\s*[\"']([^\"']+)", text)
    return f"comfyui-{found.group(1)}" if found else tree.name


SKIP_REASON = (
    "real ComfyUI host not configured: set SDVG_COMFYUI_HOSTS=\"TREE=PYTHON;TREE=PYTHON\" or SDVG_COMFYUI_DIR (ComfyUI "
    "tree) and SDVG_COMFYUI_PYTHON (its python), e.g. built by shared/tools/comfyui-host.sh"
)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class WebSocket:
    """Minimal RFC 6455 client: enough for ComfyUI's /ws (unfragmented text and binary frames)."""

    def __init__(self, host: str, port: int, path: str, timeout: float = 60.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("websocket handshake failed")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(head.decode(errors="replace"))

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("websocket closed")
            buf += chunk
        return buf

    def recv(self):
        while True:
            b1, b2 = self._read(2)
            opcode, length = b1 & 0x0F, b2 & 0x7F
            if length == 126:
                length = struct.unpack(">H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b2 & 0x80 else None
            payload = self._read(length)
            if mask:
                payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
            if opcode == 1:
                return payload.decode("utf-8")
            if opcode == 2:
                return payload
            if opcode == 8:
                raise ConnectionError("websocket closed by server")
            if opcode == 9:
                self._send(10, payload)

    def _send(self, opcode: int, payload: bytes) -> None:
        header = bytes([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 65536:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))

    def send_text(self, text: str) -> None:
        self._send(1, text.encode("utf-8"))

    def close(self) -> None:
        try:
            self._send(8, b"")
        except OSError:
            pass
        self.sock.close()


@dataclass
class RunLog:
    prompt_id: str
    messages: list = field(default_factory=list)  # ("json", type, data) | ("binary", event_type, metadata)

    def types(self) -> list[str]:
        return [m[1] for m in self.messages if m[0] == "json"]

    def of(self, kind: str) -> list[dict]:
        return [m[2] for m in self.messages if m[0] == "json" and m[1] == kind]

    def previews(self) -> list[dict]:
        return [m[2] for m in self.messages if m[0] == "binary" and m[1] == 4]


class ComfyServer:
    def __init__(self, models_dir: Path, *, extra_args: tuple[str, ...] = (), host: tuple[Path, str] | None = None,
                 extra_nodes: tuple[Path, ...] = ()):
        cfg = host or host_config()
        if cfg is None:
            raise RuntimeError(SKIP_REASON)
        self.comfy_dir, self.python = cfg
        self.models_dir = Path(models_dir)
        self.tmp = Path(tempfile.mkdtemp(prefix="sdvg-comfy-"))
        self.port = _free_port()
        self.extra_args = extra_args
        self.extra_nodes = tuple(Path(p) for p in extra_nodes)  # other custom node packs beside ours (ComfyUI-GGUF)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.tmp / "server.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> ComfyServer:
        nodes_dir = self.tmp / "custom_nodes"
        nodes_dir.mkdir()
        (nodes_dir / PACK_FOLDER).symlink_to(REPO, target_is_directory=True)
        for extra in self.extra_nodes:
            (nodes_dir / extra.name).symlink_to(extra, target_is_directory=True)
        lines = ["sdvg_test:", f"    base_path: {self.models_dir}", f"    custom_nodes: {nodes_dir}"]
        lines += [f"    {name}: {self.models_dir / name}" for name in MODEL_FOLDERS]
        (self.tmp / "extra_model_paths.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
        for sub in ("user", "out", "temp"):
            (self.tmp / sub).mkdir()
        cmd = [
            self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
            "--extra-model-paths-config", str(self.tmp / "extra_model_paths.yaml"), "--disable-api-nodes",
            "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_FOLDER, *(p.name for p in self.extra_nodes),
            "--output-directory", str(self.tmp / "out"), "--temp-directory", str(self.tmp / "temp"),
            "--user-directory", str(self.tmp / "user"), "--database-url", "sqlite:///:memory:", *self.extra_args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited:\n{self.server_log()[-4000:]}")
            try:
                urllib.request.urlopen(self.base + "/system_stats", timeout=1)
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("ComfyUI did not answer in time:\n" + self.server_log()[-4000:])

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            urllib.request.urlopen(self.base + "/system_stats", timeout=5)
            return True
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if getattr(self, "log", None):
            self.log.close()

    def server_log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def get(self, path: str):
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return json.loads(raw) if raw else None

    def run(self, prompt: dict, *, interrupt_when=None, timeout: float = 300.0) -> RunLog:
        """Queue ``prompt`` and record every message until the prompt is done. ``interrupt_when(log)`` → True
        sends POST /interrupt for this prompt (once)."""
        client_id = str(uuid.uuid4())
        ws = WebSocket("127.0.0.1", self.port, f"/ws?clientId={client_id}", timeout=timeout)
        ws.send_text(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}))
        reply = self.post("/prompt", {"prompt": prompt, "client_id": client_id})
        log = RunLog(reply["prompt_id"])
        interrupted = False
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                msg = ws.recv()
                if isinstance(msg, bytes):
                    event = struct.unpack(">I", msg[:4])[0]
                    meta = None
                    if event == 4:
                        n = struct.unpack(">I", msg[4:8])[0]
                        meta = json.loads(msg[8 : 8 + n])
                        meta["bytes"] = len(msg) - 8 - n
                    log.messages.append(("binary", event, meta))
                else:
                    data = json.loads(msg)
                    log.messages.append(("json", data["type"], data.get("data")))
                    d = data.get("data") or {}
                    if data["type"] == "executing" and d.get("node") is None and d.get("prompt_id") == log.prompt_id:
                        return log
                if interrupt_when is not None and not interrupted and interrupt_when(log):
                    self.post("/interrupt", {"prompt_id": log.prompt_id})
                    interrupted = True
            raise TimeoutError(f"prompt {log.prompt_id} did not finish; types seen: {log.types()[-20:]}")
        finally:
            ws.close()
