"""MLflow tracking (``logging.mlflow``): one MLflow run per pt-ray run with the config as
parameters, every epoch's and step's metrics, the timeline, the report and the model; a worker
restart and a resume continue that same run and are recorded."""

from __future__ import annotations

import _thread
import json
import sys
import threading
import time

import pytest

from pt_ray.api import fit
from pt_ray.core.config import ConfigError, build_config
from pt_ray.reporting.tracking import RUN_FILE, flatten, tracking_uri
from pt_ray.runtime.faults import FAULT_ENV

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

TINY = {"engine": "reference", "epochs": 2,
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 16,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "digits", "batch_size": 64},
        "logging": {"mlflow": True, "every_steps": 5}}


def the_run(run_dir):
    """The one MLflow run the pt-ray run in ``run_dir`` logged to, and its client."""
    record = json.loads((run_dir / RUN_FILE).read_text())
    client = MlflowClient(record["tracking_uri"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [record["run_id"]]
    return client, runs[0]


def epochs_of(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.unit
def test_flatten_and_the_local_store():
    assert flatten({"freeze": {"alpha": 0.5, "policy": "settled"}, "epochs": 3}) == {
        "freeze.alpha": "0.5", "freeze.policy": "settled", "epochs": "3"}
    cfg = build_config({**TINY, "name": "x"})
    assert tracking_uri(cfg.logging, __import__("pathlib").Path("/runs/x")) == \
        "sqlite:////runs/x/mlflow/mlflow.db"
    remote = build_config({**TINY, "name": "x", "logging": {"mlflow": "http://mlflow:5000"}})
    assert tracking_uri(remote.logging, __import__("pathlib").Path("/runs/x")) == "http://mlflow:5000"


@pytest.mark.unit
def test_without_mlflow_installed_the_run_stops_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ConfigError, match=r"logging.mlflow is set but MLflow is not installed; "
                                          r"pip install 'pt-ray\[mlflow\]'"):
        fit({**TINY, "name": "nomlflow", "output_dir": str(tmp_path)})
    assert not (tmp_path / "nomlflow" / "summary.json").exists()


@pytest.mark.proc  # report.png is drawn in a process of its own, which the run waits for
@pytest.mark.timeout(120)
def test_a_run_logs_its_config_metrics_timeline_report_and_model(tmp_path):
    result = fit({**TINY, "name": "tracked", "output_dir": str(tmp_path)})
    client, run = the_run(result.run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["freeze.policy"] == "settled" and run.data.params["epochs"] == "2"
    assert epochs_of(client, run.info.run_id, "eval_metric") == [0, 1]
    assert run.data.metrics["final_accuracy"] == pytest.approx(result.final_eval_metric)
    assert len(client.get_metric_history(run.info.run_id, "step/loss")) >= 2
    assert run.data.metrics["restarts"] == 0
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"timeline.json", "report.png", "summary.json", "model"} <= names
    model = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/README.md", "model/model.safetensors"} <= model


def ray_config(tmp_path, name: str) -> dict:
    from test_ray_engine import tiny_config

    cfg = tiny_config(tmp_path, name=name).model_dump(mode="json")
    cfg["logging"] = {**cfg["logging"], "mlflow": True, "every_steps": 2}
    return cfg


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_worker_restart_stays_in_one_mlflow_run_and_is_recorded(ray_cluster, tmp_path):
    marker = tmp_path / "fired"
    result = fit(ray_config(tmp_path, "mlflow-restart"),
                 worker_env={FAULT_ENV: f"step:1:3:1:{marker}"})
    assert marker.exists() and result.restarts == 1
    client, run = the_run(result.run_dir)
    assert run.info.status == "FINISHED" and run.data.metrics["restarts"] == 1
    assert epochs_of(client, run.info.run_id, "num_frozen") == [0, 1, 2]
    assert "model" in {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_resumed_run_continues_its_mlflow_run_and_records_the_resume(ray_cluster, tmp_path):
    marker = tmp_path / "stalled"

    def interrupt() -> None:
        while not marker.exists():
            time.sleep(0.1)
        time.sleep(1.0)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        fit(ray_config(tmp_path, "mlflow-resume"), worker_env={FAULT_ENV: f"stall:2:0:0:{marker}"})
    run_dir = tmp_path / "mlflow-resume"
    client, stopped = the_run(run_dir)
    assert stopped.info.status == "FAILED"
    resumed = fit(resume_from=run_dir)
    client, run = the_run(resumed.run_dir)
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    assert run.data.metrics["resumes"] == 1
    assert run.data.tags["pt_ray.resumed_from.1"].startswith(str(run_dir))
    assert epochs_of(client, run.info.run_id, "eval_metric") == [0, 1, 2]
