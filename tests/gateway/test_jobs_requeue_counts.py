"""A job whose request admission sheds is put back in the job queue by its runner: no client got that 503, so the
tier's rejections (``/status``, ``sluice_rejected_total``: the 503s answered) do not count it (README trial 13: a
runner that claimed jobs while their pool was full added a rejection at every try)."""

from __future__ import annotations

import threading

import pytest

from tests.gateway.jobs_support import MODEL, chat_body, sqlite_jobs
from tests.support.server import SluiceProcess, get_json, post_json, wait_for

pytestmark = pytest.mark.slow

# Two pools of one sim worker with one sequence slot each. The runner claims a job while "lite" has a free slot; the
# job's pool "main" is busy with a long answer, and the batch tier's 0.3 s deadline sheds the job's request there.
CONFIG = """
[model]
max_model_len_tokens = 2048

[worker]
backend = "sim"
max_num_seqs = 1
capacity_interval_s = 0.05

[sim]
time_scale = 20.0

[jobs]
{jobs}
idle_grace_s = 0.0

[[pools]]
name = "main"
model_name = "{model}"
backend = "sim"

[[pools]]
name = "lite"
model_name = "lite-model"
backend = "sim"

[[tiers]]
name = "standard"
priority = 2

[[tiers]]
name = "batch"
priority = 0
queue_timeout_s = 0.3

[admission]
early_rejection = false
"""


def test_a_job_shed_by_admission_and_requeued_is_not_counted_as_a_rejection(tmp_path):
    config = CONFIG.format(model=MODEL, jobs=sqlite_jobs(tmp_path / "jobs.sqlite3"))
    with SluiceProcess(config, tmp_path, min_ready_workers=2) as gateway:
        filler = threading.Thread(target=post_json, args=(gateway.base_url + "/v1/chat/completions",
                                                          chat_body("Tell a long story.", 60)))
        filler.start()
        wait_for(lambda: get_json(gateway.base_url + "/status")[1]["admission"]["tiers"]["standard"]["in_flight"],
                 30.0, "the long answer to hold main's slot")
        status, job, _ = post_json(gateway.base_url + "/v1/jobs", chat_body("Say hi.", 4))
        assert status == 202, job
        wait_for(lambda: gateway.log_events("job_requeued"), 30.0, "the runner to try the job while main is busy")
        filler.join(60.0)

        def finished():
            done = get_json(gateway.base_url + f"/v1/jobs/{job['id']}")[1]
            return done if done["status"] in ("succeeded", "failed") else None

        assert wait_for(finished, 60.0, "the job to run once main is free")["status"] == "succeeded"
        batch = get_json(gateway.base_url + "/status")[1]["admission"]["tiers"]["batch"]
        assert sum(batch["rejected"].values()) == 0, batch  # the job's sheds were requeues, not 503s answered
