"""Worker cold start on the CPU: loading the default GGUF with ``model.weights = "auto"``, first (empty cache) and
second (converted weights cached), each in a fresh process; the time includes importing torch.

JSON to bench/results/cold_start.json. Run: ``.venv/bin/python -m bench.cold_start_bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from bench.common import write_result

_CHILD = """
import json, time
start = time.perf_counter()
import torch
from shared.config import default_model_path
from worker.model import load_model
imported = time.perf_counter()
model = load_model(default_model_path(), torch.float32, "cpu", weights_mode="auto")
done = time.perf_counter()
print(json.dumps({"weights": model.weights_mode, "import_s": round(imported - start, 3),
                  "load_model_s": round(done - imported, 3), "total_s": round(done - start, 3)}))
"""


def _start(cache_home: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, "XDG_CACHE_HOME": cache_home},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> dict:
    with tempfile.TemporaryDirectory() as cache_home:
        result = {"first_start": _start(cache_home), "second_start": _start(cache_home), "target_second_s": "<= 3"}
    write_result("cold_start", result)
    return result


if __name__ == "__main__":
    main()
