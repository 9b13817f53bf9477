"""The one launcher of real Sluice processes for tests, benches and load tests.

:class:`SluiceProcess` runs ``python -m sluice.cli serve`` (or ``worker``) with a config file written to its work
folder, on a free loopback port, with the caller's ``SLUICE_*`` variables dropped (a test sets its own through
``env``). It waits for readiness (``/readyz`` with enough ready workers, ``/healthz``, or nothing), stops with SIGTERM
then SIGKILL of the process group, and can be killed hard and started again on the same config and port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0

T = TypeVar("T")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    """GET ``url``; return (status, decoded JSON body, or None for an error status without a JSON body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw) if raw else None
        except ValueError:
            return exc.code, None


def post_json(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, Any, dict[str, str]]:
    """POST ``body`` as JSON to ``url``; return (status, decoded JSON body, response headers), an error status
    included (its body is an OpenAI error object)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return this process's environment without ``SLUICE_*`` variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(extra or {})
    return env


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """Poll ``predicate`` until it returns a truthy value and return it.

    Raises:
        AssertionError: it stayed falsy for ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class ProcessExited(RuntimeError):
    """The launched process exited, or did not become ready in time; the message carries its log tail."""


class SluiceProcess:
    """One ``sluice serve`` (or ``sluice worker``) process with its config, port and log; restartable.

    Args:
        config_text: TOML written to ``<workdir>/config.toml`` (``--config``); None for no ``--config`` (the
            process reads ``config.toml`` of the repository root).
        workdir: folder of the config and the logs (default: a temporary folder removed by :meth:`close`).
        args: extra command-line arguments.
        env: ``SLUICE_*`` overrides and other variables on top of the cleaned environment.
        port: the port (default: a free one); ``serve`` gets ``--port``, ``worker`` ``--listen 127.0.0.1:PORT``.
        command: ``serve`` or ``worker``.
        ready: what :meth:`start` waits for: ``readyz`` (200 and ``min_ready_workers`` ready workers),
            ``healthz`` (200), or ``none``.
        min_ready_workers: ready workers ``readyz`` readiness needs.
        start_timeout_s: seconds to become ready.
        port_arg: pass the port on the command line (False: the caller passes it some other way, e.g. ``env``).
        log_path: the log file (default: ``<workdir>/<command>-<port>-<start>.log``, one per start).
        inherit_sluice_env: keep the caller's ``SLUICE_*`` variables (benches that the user tunes through them).
        code_root: the checkout whose code runs: the working directory ``python -m sluice.cli`` imports from
            (default: this one; ``bench.gateway_ab`` runs an older checkout beside it).
    """

    def __init__(self, config_text: str | None = "", workdir: Path | None = None, *, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, port: int | None = None,
                 command: Literal["serve", "worker"] = "serve",
                 ready: Literal["readyz", "healthz", "none"] = "readyz", min_ready_workers: int = 1,
                 start_timeout_s: float = START_TIMEOUT_S, port_arg: bool = True, log_path: Path | None = None,
                 inherit_sluice_env: bool = False, code_root: Path = REPO_ROOT) -> None:
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix=f"sluice-{command}-")
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp.name)
        self.config_text = config_text
        self.args = list(args)
        self.env = dict(env or {})
        self.port = port if port is not None else free_port()
        self.command = command
        self.ready = ready
        self.min_ready_workers = min_ready_workers
        self.start_timeout_s = start_timeout_s
        self.port_arg = port_arg
        self.fixed_log_path = log_path
        self.inherit_sluice_env = inherit_sluice_env
        self.code_root = code_root
        self.process: subprocess.Popen | None = None
        self.num_starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "config.toml"

    @property
    def log_path(self) -> Path:
        """The log of the current (latest) start."""
        if self.fixed_log_path is not None:
            return self.fixed_log_path
        return self.workdir / f"{self.command}-{self.port}-{self.num_starts}.log"

    def argv(self) -> list[str]:
        """Return the command line of the process."""
        argv = [sys.executable, "-m", "sluice.cli", self.command]
        if self.config_text is not None:
            argv += ["--config", str(self.config_path)]
        if self.port_arg:
            argv += ["--port", str(self.port)] if self.command == "serve" else ["--listen", f"127.0.0.1:{self.port}"]
        return argv + self.args

    def start(self, wait: bool = True) -> SluiceProcess:
        """Start the process (again, after :meth:`stop` or :meth:`kill9`); wait for readiness unless ``wait`` is
        False. Returns self."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.config_text is not None:
            self.config_path.write_text(self.config_text)
        self.num_starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env} if self.inherit_sluice_env else clean_env(self.env)
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(self.argv(), cwd=self.code_root, env=env, stdout=log_file,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float | None = None, poll_interval_s: float = 0.2) -> None:
        """Wait until the process is ready (see ``ready``).

        Raises:
            ProcessExited: it exited, or was not ready after ``timeout_s`` (default ``start_timeout_s``).
        """
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while self.ready != "none":
            self.check_alive()
            try:
                status, body = get_json(f"{self.base_url}/{self.ready}", timeout_s=2.0)
                if status == 200 and (self.ready == "healthz"
                                      or (body or {}).get("ready_workers", 0) >= self.min_ready_workers):
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise ProcessExited(f"sluice {self.command} not ready after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(poll_interval_s)

    def check_alive(self) -> bool:
        """Return True while the process runs.

        Raises:
            ProcessExited: it exited (the message carries its exit status and log tail).
        """
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise ProcessExited(f"sluice {self.command} exited with {code}:\n{self.log_tail()}")
        return True

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, kill_group: bool = False) -> None:
        """SIGTERM the process and wait for it; SIGKILL its process group after ``timeout_s``. With
        ``kill_group``, SIGKILL whatever of its process group is left afterwards too."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.process.wait()
        if kill_group:
            self._kill_group()

    def kill9(self) -> None:
        """SIGKILL the process alone, then whatever of its process group is left (local workers die with it)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        time.sleep(0.3)
        self._kill_group()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Stop the process and remove the temporary work folder, if this object made one."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> SluiceProcess:
        if self.process is None:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_text(self) -> str:
        """Return the log of the current start ('' when there is none yet)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_text()[-num_chars:]

    def log_events(self, event: str) -> list[dict]:
        """Return the structlog JSON lines named ``event`` from every start of this process."""
        found = []
        paths = [self.fixed_log_path] if self.fixed_log_path else self.workdir.glob(f"{self.command}-{self.port}-*.log")
        for path in sorted(paths):
            for line in path.read_text(errors="replace").splitlines():
                if f'"{event}"' in line:
                    try:
                        found.append(json.loads(line))
                    except ValueError:
                        pass
        return found

    def status(self) -> dict:
        """Return the gateway's ``/status``.

        Raises:
            AssertionError: ``/status`` did not answer 200.
        """
        code, body = get_json(self.base_url + "/status")
        if code != 200:
            raise AssertionError(f"/status answered {code}")
        return body
