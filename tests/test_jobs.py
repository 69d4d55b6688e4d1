"""``jobs/train.py``: where a job's output goes, and a real ``ray job submit`` to a ``ray start``
head that this test starts and stops itself (never ``ray stop``, never the session cluster)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The `ray` CLI of the interpreter running the tests (not resolved: .venv/bin/python is a link).
RAY = Path(sys.executable).parent / "ray"
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def load_entry():
    spec = importlib.util.spec_from_file_location("jobs_train", REPO / "jobs" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- output folder (no processes)


@pytest.mark.unit
def test_output_defaults_outside_the_jobs_temporary_working_dir(tmp_path, monkeypatch):
    entry = load_entry()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}  # what Ray's job supervisor sets
    base = tmp_path / "base"

    # PT_RAY_OUTPUT is a base folder; the run goes in <name> (the default job's is "default").
    assert entry.output_dir([], {"PT_RAY_OUTPUT": str(base)}) == base / "default"
    assert entry.output_dir(["--set", "name=n1"], {"PT_RAY_OUTPUT": str(base)}) == base / "n1"
    # Without it: an absolute output_dir of the config, else ~/pt-ray-runs.
    assert entry.output_dir(["--set", f"output_dir={base}"], {}) == base / "default"
    assert entry.output_dir([], {}) == tmp_path / "home" / "pt-ray-runs" / "default"
    # --output wins; a relative one is kept out of a job's cwd (deleted after the job).
    assert entry.output_dir(["--output", str(base / "x")], job) == base / "x"
    assert entry.output_dir(["--output", "rel"], {**job, "PT_RAY_OUTPUT": str(base)}) == (
        base / "rel"
    )
    monkeypatch.chdir(tmp_path)
    assert entry.output_dir(["--output=rel"], {}) == tmp_path / "rel"
    # --resume RUN_DIR names the run's own folder, found as --output is.
    assert entry.output_dir(["--resume", str(base / "x")], job) == base / "x"
    assert entry.output_dir(["--resume", "rel"], {**job, "PT_RAY_OUTPUT": str(base)}) == (
        base / "rel")
    assert entry.output_dir(["--resume=rel"], {}) == tmp_path / "rel"


@pytest.mark.unit
def test_resume_in_a_job_names_the_absolute_run_folder(tmp_path, monkeypatch, capsys):
    entry = load_entry()
    monkeypatch.setenv("PT_RAY_OUTPUT", str(tmp_path / "runs"))
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    # A relative RUN_DIR in a job is the run under the base folder; none is there: one line.
    assert entry.main(["--resume", "stopped"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"pt-ray: error: resume: '{tmp_path / 'runs' / 'stopped' / 'config.yaml'}' "
                   "not found; pass the folder of a run pt-ray started (it holds config.yaml "
                   "and ray/)")
    # A sweep's --resume is a flag: it names no folder.
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}", "PT_RAY_OUTPUT": str(tmp_path / "b")}
    assert entry.output_dir(["--resume", "--output", "s"], job, "-sweep") == tmp_path / "b" / "s"
    assert entry.output_dir(["--resume"], job, "-sweep") == tmp_path / "b" / "default-sweep"


@pytest.mark.unit
def test_config_error_exits_2_before_anything_starts(tmp_path, monkeypatch, capsys):
    entry = load_entry()
    monkeypatch.setenv("PT_RAY_OUTPUT", str(tmp_path / "runs"))

    assert entry.main(["--set", "epochs=0"]) == 2
    assert entry.main(["--set", "pipeline.pipline_length=2"]) == 2

    err = capsys.readouterr().err
    assert "epochs=0" in err and "greater than 0" in err
    assert "did you mean pipeline.pipeline_length?" in err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- a head of our own


def free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def process_info(pid: int) -> tuple[int, str, str] | None:
    """(session id, command line, cwd) of one of our own processes, or None."""
    proc = Path(f"/proc/{pid}")
    try:
        if proc.stat().st_uid != os.getuid():
            return None
        sid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3])
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        return sid, cmdline, os.readlink(proc / "cwd")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Head:
    """A ``ray start --head --block`` subprocess in its own session and temp dir."""

    proc: subprocess.Popen
    temp_dir: str
    url: str
    log: Path
    start_s: float = 0.0
    stray: list[str] = field(default_factory=list)

    def processes(self) -> dict[int, str]:
        """Our processes that belong to this head: in its session (everything ``ray start``
        spawned: gcs, raylet, dashboard, agents, workers) or naming its temp dir in the command
        line or cwd (a job's driver runs in its own session, in the unpacked working dir)."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            info = process_info(int(entry))
            if info is None:
                continue
            sid, cmdline, cwd = info
            if sid == self.proc.pid or self.temp_dir in cmdline or cwd.startswith(self.temp_dir):
                found[int(entry)] = cmdline[:160]
        return found

    def stop(self) -> None:
        """SIGTERM ``ray start --block`` (it drains and stops what it started), then SIGKILL by
        PID whatever of this head is still there after a grace period, recording it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)  # the node drains for up to 30 s
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 15
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid, cmdline in left.items():
            self.stray.append(f"{pid} {cmdline}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def http_json(url: str, timeout: float = 5, token: str | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                timeout=timeout) as resp:
        return json.loads(resp.read())


def cli_env() -> dict[str, str]:
    """This environment without any RAY_* variable (no RAY_ADDRESS of another cluster), with
    auth and usage stats off and this venv's ``python`` and ``ray`` first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ENV, PATH=f"{RAY.parent}{os.pathsep}{env.get('PATH', '')}")
    return env


@pytest.fixture
def ray_head():
    yield from _ray_head()


@pytest.fixture
def ray_head_for_two():
    """A head with room for two runs of two 1-CPU workers at once (CPUs are logical here)."""
    yield from _ray_head(num_cpus=4)


def _ray_head(token: str | None = None, num_cpus: int = 2):
    """Start a head of ``num_cpus`` CPUs (with token authentication when given ``token``),
    yield it, stop it."""
    # A short dir of our own: Ray's unix socket paths under it must stay below 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ptj-", dir="/tmp")
    gcs, dash, client, agent, agent_grpc, env_agent, metrics, node, obj = free_ports(9)
    log = Path(temp_dir) / "head.log"
    cmd = [
        str(RAY), "start", "--head", "--block",
        f"--port={gcs}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
        "--include-dashboard=true", f"--num-cpus={num_cpus}",
        f"--object-store-memory={300 * 2**20}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
        # Explicit ports: the defaults (10001, 52365, ...) may be held by another engineer's head.
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={node}",
        f"--object-manager-port={obj}",
    ]
    # SIGTERM otherwise drains the node for up to 30 s: Train's autoscaling-coordinator actor
    # outlives the job and keeps a worker leased, so the node never turns idle.
    env = {**cli_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           **({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {})}
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=temp_dir, start_new_session=True)
    head = Head(proc, temp_dir, f"http://127.0.0.1:{dash}", log)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                http_json(f"{head.url}/api/version", token=token)
                http_json(f"{head.url}/api/jobs/", token=token)  # the job API answers
                head.start_s = time.monotonic() - t0
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the job API never answered:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield head
    finally:
        head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def working_dir_copy(dest: Path) -> Path:
    """Only what a job needs: pt_ray/ and jobs/ (no .venv, .git, runs, bench/out)."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pt_ray", "jobs"):
        shutil.copytree(REPO / name, dest / name, ignore=skip)
    return dest


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ray_job_submit_trains_on_the_head_and_writes_the_summary(ray_head, tmp_path):
    out, env_out = tmp_path / "out", tmp_path / "env-out"
    submission_id = f"pt-ray-job-{uuid.uuid4().hex[:8]}"
    runtime_env = {"env_vars": {
        **RAY_ENV,
        "PT_RAY_OUTPUT": str(env_out),
        # Ray Train's placement-group cleaner queries the state API without an address; with
        # another cluster on the host (the session's ray_cluster, a colleague's) it fails with
        # "Found multiple active Ray instances" unless told which dashboard to ask.
        "RAY_API_SERVER_ADDRESS": ray_head.url,
    }}
    repo = working_dir_copy(tmp_path / "repo")

    def submit(submission_id: str, *args: str) -> tuple[int, str]:
        cmd = [
            str(RAY), "job", "submit", "--address", ray_head.url,
            "--submission-id", submission_id, "--working-dir", str(repo),
            "--runtime-env-json", json.dumps(runtime_env),
            "--", "python", "jobs/train.py", *args,
        ]
        proc = subprocess.run(cmd, env=cli_env(), cwd=tmp_path, capture_output=True, text=True,
                              timeout=420)
        return proc.returncode, proc.stdout + proc.stderr

    # A bad config fails the job (exit 2 of the entry point) before anything trains.
    bad_id = f"{submission_id}-bad"
    code, logs = submit(bad_id, "--set", "epochs=0", "--output", str(out))
    assert code != 0 and "epochs=0: Input should be greater than 0" in logs, logs[-3000:]
    job = http_json(f"{ray_head.url}/api/jobs/{bad_id}")
    assert job["status"] == "FAILED" and "exit code 2" in job["message"], job
    assert not out.exists()

    t0 = time.monotonic()
    code, logs = submit(submission_id, "--set", "epochs=2", "--set", "data.num_samples=256",
                        "--output", str(out))
    job_s = time.monotonic() - t0
    assert code == 0, logs[-6000:]
    assert http_json(f"{ray_head.url}/api/jobs/{submission_id}")["status"] == "SUCCEEDED"
    assert "Found multiple active Ray instances" not in logs

    # The job ran the pt_ray shipped in its working dir (unpacked under the head's temp dir),
    # not the copy installed in the venv.
    shipped = [ln.split(" from ", 1)[1] for ln in logs.splitlines()
               if ln.startswith("pt-ray job: pt_ray from ")]
    assert shipped and shipped[0].startswith(ray_head.temp_dir), logs[-3000:]
    # The last summary line names the absolute --output path (it wins over PT_RAY_OUTPUT).
    summary_lines = [ln for ln in logs.splitlines() if ln.startswith("summary: ")]
    assert summary_lines, logs[-3000:]
    summary_path = Path(summary_lines[-1].removeprefix("summary: "))
    assert summary_path == out / "summary.json" and summary_path.is_file()
    assert not env_out.exists()

    summary = json.loads(summary_path.read_text())
    assert summary["engine"] == "ray" and summary["metric_name"] == "accuracy"
    timeline = summary["timeline"]
    assert [r["epoch"] for r in timeline] == [0, 1]
    assert all(r["pipeline_length"] in (1, 2) for r in timeline)
    assert all(0.0 <= r["eval_metric"] <= 1.0 for r in timeline)
    assert summary["final_eval_metric"] == timeline[-1]["eval_metric"]
    assert summary["config"]["epochs"] == 2 and summary["config"]["data"]["num_samples"] == 256

    # The driver attached to this head (RAY_ADDRESS from the supervisor) instead of starting an
    # embedded cluster: the run's controller actor lives in this head's GCS.
    actors = http_json(f"{ray_head.url}/api/v0/actors?limit=1000&detail=false")
    names = {a.get("name") for a in actors["data"]["result"]["result"]}
    assert any(n and summary["run_id"] in n for n in names), names

    t1 = time.monotonic()
    ray_head.stop()
    stop_s = time.monotonic() - t1
    assert ray_head.proc.returncode is not None
    assert not ray_head.stray, f"left behind by ray start --block: {ray_head.stray}"
    print(f"head start {ray_head.start_s:.1f} s, job {job_s:.1f} s, head stop {stop_s:.1f} s")


def job_status(head: Head, submission_id: str) -> dict:
    return http_json(f"{head.url}/api/jobs/{submission_id}")


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_two_submitted_jobs_with_the_cache_on_each_end_on_their_reference_and_leave_no_actor(
        ray_head_for_two, tmp_path):
    """Two ``ray job submit`` jobs on one head at once, cache on, seeds 0 and 1: each ends on
    the reference trainer's parameters for its own seed (the other seed's are far off, so a
    run that read the other's cache rows or obeyed the other's controller would fail), each
    run's controller and cache owner are named with its run id and started by its own driver,
    and once both jobs end no actor either driver started is alive.

    Two drivers, not two threads of one (test_many_jobs.py): each job is its own Ray job with
    its own driver process and job id, as jobs on a shared cluster are. Actor names are
    cluster-wide, so a name without the run id would collide across drivers or be found by
    the other run; and an actor that outlives its driver (detached and not killed) stays on
    the cluster after its job, which one driver's ``ray.shutdown`` at the end of a test hides.

    It passes on today's code (run ids are unique, the run kills its controller and cache
    owners when it ends, and they are owned by the driver besides). It fails when they are
    not: with the controller detached and not killed, both controllers are left ALIVE.
    """
    from pt_ray.models.base import iter_layers
    from pt_ray.runtime.reference import build_reference
    from pt_ray.service.settings import run_settings
    from test_ray_engine import max_difference, tiny_config

    head = ray_head_for_two
    repo = working_dir_copy(tmp_path / "repo")
    config = tmp_path / "tiny.yaml"
    spec = tiny_config(tmp_path).model_dump(mode="json", exclude_unset=True)
    del spec["output_dir"]
    config.write_text(json.dumps(spec))  # JSON is YAML
    runtime_env = {"env_vars": {**RAY_ENV, "RAY_API_SERVER_ADDRESS": head.url}}
    tag = uuid.uuid4().hex[:8]
    jobs = {f"pt-ray-{name}-{tag}": (name, seed, tmp_path / name)
            for name, seed in (("job-a", 0), ("job-b", 1))}

    t0 = time.monotonic()
    for job_id, (name, seed, out) in jobs.items():
        submitted = subprocess.run(
            [str(RAY), "job", "submit", "--no-wait", "--address", head.url, "--submission-id",
             job_id, "--working-dir", str(repo), "--runtime-env-json", json.dumps(runtime_env),
             "--", "python", "jobs/train.py", "--config", str(config), "--set", f"name={name}",
             "--set", f"seed={seed}", "--set", "cache.mode=on", "--output", str(out)],
            env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert submitted.returncode == 0, (submitted.stdout + submitted.stderr)[-3000:]
    deadline = time.monotonic() + 420
    while (pending := [j for j in jobs if job_status(head, j)["status"]
                       in ("PENDING", "RUNNING")]) and time.monotonic() < deadline:
        time.sleep(1.0)
    both_s = time.monotonic() - t0
    status = {j: job_status(head, j) for j in jobs}
    assert not pending, f"still running after {both_s:.0f} s: {status}"
    for job_id, job in status.items():
        logs = http_json(f"{head.url}/api/jobs/{job_id}/logs")["logs"]
        assert job["status"] == "SUCCEEDED", f"{job}\n{logs[-4000:]}"
        assert "Found multiple active Ray instances" not in logs
    # Both drivers ran at once (each job started before the other ended).
    (a, b) = status.values()
    assert a["start_time"] < b["end_time"] and b["start_time"] < a["end_time"], status

    references = {}
    for name, seed, _ in jobs.values():
        cfg = tiny_config(tmp_path / f"{name}-ref", name=name, engine="reference", seed=seed)
        trainer = build_reference(run_settings(cfg).reference)
        trainer.fit()
        references[name] = {layer: {k: v.clone() for k, v in m.state_dict().items()}
                            for layer, m in iter_layers(trainer.adapter)}

    runs = {}  # run id -> the Ray job id of the driver that ran it
    for job_id, (name, seed, out) in jobs.items():
        summary = json.loads((out / "summary.json").read_text())
        assert summary["config"]["seed"] == seed and summary["config"]["cache"]["mode"] == "on"
        # The freeze deepened and the cache served the frozen prefix by the last epoch.
        assert [r["num_frozen"] for r in summary["timeline"]] == [0, 2, 3], summary["timeline"]
        assert summary["timeline"][-1]["cache_hit_rate"] == 1.0, summary["timeline"]
        assert summary["restarts"] == 0
        other = next(n for n in references if n != name)
        assert max_difference(summary["checkpoint"], references[name]) <= 1e-4, name
        # The tolerance tells the seeds apart: the other seed's run ends elsewhere.
        assert max_difference(summary["checkpoint"], references[other]) > 1e-2, name
        runs[summary["run_id"]] = status[job_id]["job_id"]
    assert len(runs) == 2 and len(set(runs.values())) == 2, runs

    def actors() -> list[dict]:
        listed = http_json(f"{head.url}/api/v0/actors?limit=10000&detail=true", timeout=30)
        return listed["data"]["result"]["result"]

    # Each run's controller and cache owner are its own: named with its run id and started by
    # its own driver (so no actor is the two runs').
    listed = actors()
    for run_id, driver in runs.items():
        named = {x["name"]: x["job_id"] for x in listed if run_id in (x.get("name") or "")}
        assert {n.split(":")[0] for n in named} == {"pt-ray-controller", "pt-ray-cache"}, named
        assert set(named.values()) == {driver}, named

    # Nothing either driver started is left once its job has ended (pt-ray's actors, Ray
    # Train's controller and workers), but Ray Train's AutoscalingCoordinator: detached by
    # design, one for the whole cluster, started by whichever job trained first.
    deadline = time.monotonic() + 60
    while (left := [f"{x['class_name']} {x.get('name')} {x['state']}" for x in actors()
                    if x["job_id"] in runs.values() and x["state"] != "DEAD"
                    and x.get("name") != "AutoscalingCoordinator"]) and (
            time.monotonic() < deadline):
        time.sleep(1.0)
    assert not left, f"not DEAD after both jobs ended: {left}"
    print(f"two jobs at once: {both_s:.1f} s until both ended; head start "
          f"{head.start_s:.1f} s")


@pytest.fixture
def ray_head_with_token():
    token = uuid.uuid4().hex + uuid.uuid4().hex
    for head in _ray_head(token):
        yield head, token


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_head_with_token_auth_takes_jobs_with_the_token_and_refuses_them_without(
        ray_head_with_token, tmp_path):
    head, token = ray_head_with_token
    repo = working_dir_copy(tmp_path / "repo")
    out = tmp_path / "out"

    def submit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
        cmd = [str(RAY), "job", "submit", "--address", head.url, "--working-dir", str(repo),
               "--runtime-env-json", json.dumps({"env_vars": {
                   "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
                   "RAY_API_SERVER_ADDRESS": head.url}}),
               "--", "python", "jobs/train.py", *args]
        return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=420)

    # Without the token: the Jobs API refuses the request, and no job exists afterwards.
    with pytest.raises(urllib.error.HTTPError) as refused:
        http_json(f"{head.url}/api/jobs/")
    assert refused.value.code in (401, 403)
    for env in (cli_env(), {**cli_env(), "RAY_AUTH_MODE": "token"},
                {**cli_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"}):
        denied = submit(env, "--set", "epochs=1", "--output", str(out))
        said = (denied.stdout + denied.stderr).lower()
        assert denied.returncode != 0, said[-2000:]
        assert any(word in said for word in ("401", "403", "unauthorized", "token")), said[-2000:]
    assert http_json(f"{head.url}/api/jobs/", token=token) == []
    assert not out.exists()

    # With it (as cluster/README.md says: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in the shell),
    # the job runs pt-ray on the head and writes its summary.
    done = submit({**cli_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
                  "--set", "epochs=1", "--set", "data.num_samples=128", "--output", str(out))
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["epoch"] for r in summary["timeline"]] == [0]
    jobs = http_json(f"{head.url}/api/jobs/", token=token)
    assert [j["status"] for j in jobs] == ["SUCCEEDED"]


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ray_job_stop_mid_transition_leaves_nothing_running_and_the_job_resumes(ray_head,
                                                                               tmp_path):
    from pt_ray.runtime.checkpoint import damage

    out, marker = tmp_path / "out", tmp_path / "stalled"
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({
        "name": "stopped-job", "epochs": 3, "seed": 0,
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 4, "width": 32,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "synthetic_image", "num_samples": 128, "image_size": 8,
                 "batch_size": 16},
        "freeze": {"policy": "schedule", "alpha": 0.5, "max_frozen": 3, "warmup_epochs": 1},
        "pipeline": {"num_workers": 2, "policy": "paper"}, "cache": {"mode": "on"}}))
    repo = working_dir_copy(tmp_path / "repo")
    env = {**RAY_ENV, "RAY_API_SERVER_ADDRESS": ray_head.url,
           # Rank 0 holds at the start of the transition into epoch 2 (2 -> 3 blocks frozen).
           "PT_RAY_FAULT": f"stall:2:0:0:{marker}"}
    job_id = f"pt-ray-stop-{uuid.uuid4().hex[:8]}"

    def ray_cli(*args: str, timeout: float = 420) -> subprocess.CompletedProcess:
        return subprocess.run([str(RAY), *args], env=cli_env(), cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout)

    def alive() -> list[str]:
        actors = http_json(f"{ray_head.url}/api/v0/actors?limit=1000&detail=true")
        return [f"{a.get('class_name')} {a.get('name')}" for a in actors["data"]["result"]["result"]
                if a.get("state") == "ALIVE" and (
                    (a.get("name") or "").startswith(("pt-ray-controller:", "pt-ray-cache:"))
                    or a.get("class_name") in ("RayTrainWorker", "TrainController"))]

    started = ray_cli("job", "submit", "--no-wait", "--address", ray_head.url, "--submission-id",
                      job_id, "--working-dir", str(repo), "--runtime-env-json",
                      json.dumps({"env_vars": env}), "--", "python", "jobs/train.py",
                      "--config", str(config), "--output", str(out))
    assert started.returncode == 0, started.stderr[-3000:]
    deadline = time.monotonic() + 300
    while not marker.exists():
        status = http_json(f"{ray_head.url}/api/jobs/{job_id}")["status"]
        assert status in ("PENDING", "RUNNING") and time.monotonic() < deadline, status
        time.sleep(0.5)
    # The check after the stop sees the run's actors while they live.
    running = alive()
    assert any(a.startswith("ControllerActor") for a in running), running
    assert sum(a.startswith("RayTrainWorker") for a in running) == 2, running
    stopped = ray_cli("job", "stop", "--address", ray_head.url, job_id, timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert http_json(f"{ray_head.url}/api/jobs/{job_id}")["status"] == "STOPPED"

    deadline = time.monotonic() + 90
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not left, f"alive after ray job stop: {left}"
    checkpoints = [p for p in (out / "ray").glob("*/checkpoint_*") if p.is_dir()]
    assert checkpoints and all(damage(p) is None for p in checkpoints)
    assert not (out / "summary.json").exists()

    # The run continues from its newest complete checkpoint in a new job.
    resumed = ray_cli("job", "submit", "--address", ray_head.url, "--working-dir", str(repo),
                      "--runtime-env-json", json.dumps({"env_vars": {
                          **RAY_ENV, "RAY_API_SERVER_ADDRESS": ray_head.url}}),
                      "--", "python", "jobs/train.py", "--resume", str(out))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["epoch"] for r in summary["timeline"]] == [0, 1, 2]
    assert [r["num_frozen"] for r in summary["timeline"]] == [0, 2, 3]
