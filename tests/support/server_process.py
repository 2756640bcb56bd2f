"""`mla-func serve` run as a user runs it: a subprocess on 127.0.0.1, on the CPU path, talked to over HTTP."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from support.cli_process import ENV, mla_func_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[str, float]:
        """/metrics' samples: 'name{labels}' -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        assert match is not None, status
        return int(match.group(1)) * 1024

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM, then the exit status and what it wrote on stderr."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout)
        return code, self.log.read_text()


def start_server(*args: str, timeout: float = 120, device: str = "cpu") -> ServerProcess:
    """`mla-func serve ARGS --device DEVICE --port <free>`, once /health answers 200 (on the CPU path, GPUs
    hidden, unless `device` names CUDA)."""
    port = free_port()
    command = mla_func_command()
    log = Path(tempfile.mkstemp(prefix="mla-func-serve-", suffix=".log")[1])
    env = {**(ENV if device == "cpu" else os.environ), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([*command, "serve", *args, "--device", device, "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{log.read_text()}")


def stopped_cleanly(server: ServerProcess) -> None:
    """Stop the server with SIGTERM; it must end by that signal (uvicorn raises it again once its shutdown
    is done, as a process stopped by it does) having aborted nothing and with no KV block held."""
    code, log = server.stop()
    os.unlink(server.log)
    assert code == -signal.SIGTERM, log
    assert "shutdown: 0 requests aborted, 0 KV blocks in use" in log, log


def engine_pid(server) -> int:
    """The engine process's id, as the server's log gives it; checked to be the server's child."""
    found = re.search(r"engine ready in process (\d+)", server.log.read_text())
    assert found is not None, server.log.read_text()
    pid = int(found.group(1))
    assert _stat(pid)[1] == server.process.pid
    return pid


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent's id) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def wait_for(condition, within: float = 30) -> bool:
    """Whether `condition()` holds within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def gone(pid: int, within: float) -> bool:
    """Whether process `pid` ends (or is a zombie waiting to be reaped) within `within` seconds."""

    def ended() -> bool:
        try:
            return _stat(pid)[0] == "Z"
        except FileNotFoundError:
            return True

    return wait_for(ended, within)


PROMPTS = ("The capital of France is", "Return the number of")
CHAT = [{"role": "user", "content": "add two numbers"}]


def children(pid: int) -> list[int]:
    """The ids of the processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def greedy_answers(server) -> dict:
    """Greedy answers of a few kinds from `server` (the demo's model): two completions, one streamed, a chat's
    reply, and two prompts added together."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    plain = [client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
             for prompt in PROMPTS]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12, temperature=0)
    # Requests added together: under data-parallel attention they go to the ranks in turn.
    together = client.completions.create(model="demo", prompt=list(PROMPTS), max_tokens=12, temperature=0)
    return dict(plain=plain, streamed=streamed, chat=chat.choices[0].message.content,
                together=[choice.text for choice in sorted(together.choices, key=lambda c: c.index)])
