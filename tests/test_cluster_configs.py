"""The cluster configs in ``cluster/``: the AWS launcher YAML passes Ray's own validation
(offline: schema and defaults, no cloud calls), the KubeRay manifests have the structure KubeRay
expects, and the sizes agree with each other and with pt-ray's config (one worker per GPU,
/dev/shm above the object store, CPUs per worker within a pod)."""

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pt_ray.api import resolve_config

pytestmark = pytest.mark.unit

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"
ROOT = CLUSTER.parent

_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (``44``, ``500m``, ``180Gi``) or a Docker size (``75g``) as a
    number (bytes for memory)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti|g)?", str(text))
    assert m, f"not a quantity: {text!r}"
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit == "m":
        return value / 1000
    if unit == "g":  # docker --shm-size: binary gigabytes
        return value * 2**30
    return value * _UNITS[unit]


def start_flag(commands: list[str], flag: str) -> str | None:
    for cmd in commands:
        for tok in shlex.split(cmd.replace(";", " ")):
            if tok.startswith(f"--{flag}="):
                return tok.split("=", 1)[1]
    return None


def run_option(options: list[str], name: str) -> str | None:
    for opt in options:
        if opt.startswith(f"--{name}="):
            return opt.split("=", 1)[1]
    return None


# --- Ray cluster launcher (AWS) -------------------------------------------------------------


@pytest.fixture(scope="module")
def aws():
    return yaml.safe_load((CLUSTER / "aws-gpu.yaml").read_text())


def test_launcher_yaml_passes_rays_validation(aws):
    from ray.autoscaler._private.util import prepare_config, validate_config

    # `ray up` does the same (commands.create_or_update_cluster) before it calls the cloud.
    prepared = prepare_config(copy.deepcopy(aws))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    types = prepared["available_node_types"]
    assert prepared["head_node_type"] in types
    assert types[prepared["head_node_type"]]["max_workers"] == 0
    # setup_commands were merged into the head's (Ray's defaults would add a boto3 install).
    assert "pip install -q -e ~/pt-ray" in prepared["head_setup_commands"]


def test_launcher_validation_catches_a_bad_field(aws):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    bad = copy.deepcopy(aws)
    bad["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))


def test_launcher_yaml_sizes(aws):
    types = aws["available_node_types"]
    head = types[aws["head_node_type"]]
    workers = [t for name, t in types.items() if name != aws["head_node_type"]]
    assert len(workers) == 1
    gpu = workers[0]
    assert gpu["resources"]["GPU"] >= 1 and gpu["min_workers"] == gpu["max_workers"] >= 1
    assert "InstanceType" in head["node_config"] and "InstanceType" in gpu["node_config"]
    # No training worker on the head.
    assert start_flag(aws["head_start_ray_commands"], "num-cpus") == "0"
    # /dev/shm above the object store on every node.
    docker = aws["docker"]
    assert docker["image"].startswith("rayproject/ray:2.60") and docker["image"].endswith("-gpu")
    for options, commands in ((docker["head_run_options"], aws["head_start_ray_commands"]),
                              (docker["worker_run_options"], aws["worker_start_ray_commands"])):
        shm = quantity(run_option(options, "shm-size"))
        store = float(start_flag(commands, "object-store-memory"))
        assert shm > store, (shm, store)
    assert "--gpus all" in docker["worker_run_options"]
    env = " ".join(docker["run_options"])
    assert "-e RAY_AUTH_MODE=token" in env and "PT_RAY_OUTPUT=/mnt/pt-ray/runs" in env
    assert "-v /mnt/pt-ray:/mnt/pt-ray" in env
    # The token travels from the launcher's own file, Ray's default path, into every container.
    assert aws["file_mounts"] == {"~/pt-ray": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    assert "--dashboard-host=0.0.0.0" in " ".join(aws["head_start_ray_commands"])


def test_launcher_docker_command_composes(aws):
    from ray.autoscaler._private.docker import docker_start_cmds

    docker = aws["docker"]
    cmd = docker_start_cmds("ubuntu", docker["image"], {}, docker["container_name"],
                            docker["run_options"] + docker["worker_run_options"],
                            aws["cluster_name"], "/home/ray", "docker")
    assert cmd.startswith("docker run --rm --name pt_ray -d -it")
    assert "--gpus all --shm-size=75g --net=host rayproject/ray:2.60.0-py311-gpu bash" in cmd


def test_cluster_job_config_resolves():
    cfg = resolve_config(CLUSTER / "configs" / "vit-b16-cifar100.yaml",
                         ["pipeline.num_workers=8", "pipeline.cpus_per_worker=11"])
    assert cfg.model.name == "vit_base_patch16_224" and cfg.model.depth is None
    assert cfg.data.image_size == 224 and cfg.epochs == 10


# --- KubeRay --------------------------------------------------------------------------------


# Every container takes its token from this Secret; no file in the repository holds one.
TOKEN_FROM_SECRET = {"secretKeyRef": {"name": "pt-ray-auth", "key": "auth_token"}}


def test_no_cluster_file_holds_a_token_or_opens_the_dashboard_without_auth():
    for path in sorted(p for p in CLUSTER.rglob("*") if p.is_file()):
        text = path.read_text()
        # A token is never written down: only the Secret, the environment or Ray's own file.
        assert not re.search(r"RAY_AUTH_TOKEN\s*[:=]\s*['\"]?[0-9a-f]{16,}", text), path
        assert "RAY_AUTH_MODE=disabled" not in text and "value: disabled" not in text, path
        if "0.0.0.0" in text:
            assert "RAY_AUTH_MODE=token" in text or "value: token" in text, path


def load(name: str) -> dict:
    docs = list(yaml.safe_load_all((CLUSTER / "kuberay" / name).read_text()))
    assert len(docs) == 1
    return docs[0]


def check_cluster_spec(spec: dict) -> dict:
    """Structure of a RayCluster spec; returns sizes for cross-checks."""
    assert spec["rayVersion"].startswith("2.60")
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert head["rayStartParams"]["num-cpus"] == "0"
    (hc,) = head["template"]["spec"]["containers"]
    ports = {p["containerPort"]: p["name"] for p in hc["ports"]}
    assert ports == {6379: "gcs-server", 8265: "dashboard", 10001: "client"}
    sizes = {"gpus": 0, "pods": []}
    groups = [("head", head, hc)]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and group["replicas"] >= 1
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        (wc,) = group["template"]["spec"]["containers"]
        limits, requests = wc["resources"]["limits"], wc["resources"]["requests"]
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus >= 1 and requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        sizes["gpus"] += gpus * group["replicas"]
        sizes["pods"].append((gpus, quantity(limits["cpu"])))
        tolerations = group["template"]["spec"].get("tolerations", [])
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
        groups.append((group["groupName"], group, wc))
    for name, group, container in groups:
        pod = group["template"]["spec"]
        assert container["image"] == hc["image"], name
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env["RAY_AUTH_MODE"] == "token", name
        assert env["RAY_AUTH_TOKEN"] == TOKEN_FROM_SECRET, name
        assert env["PT_RAY_OUTPUT"].startswith("/mnt/pt-ray/"), name
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory", name
        store = float(group["rayStartParams"]["object-store-memory"])
        # /dev/shm holds the store, and tmpfs pages count against the pod's memory limit.
        assert quantity(shm["sizeLimit"]) > store, name
        assert quantity(container["resources"]["limits"]["memory"]) > quantity(shm["sizeLimit"])
        runs = volumes[mounts["/mnt/pt-ray"]]
        assert runs["persistentVolumeClaim"]["claimName"] == load("pvc.yaml")["metadata"]["name"]
    return sizes


def test_raycluster_manifest():
    rc = load("raycluster.yaml")
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert rc["metadata"]["name"]
    sizes = check_cluster_spec(rc["spec"])
    assert sizes["gpus"] == 8


def test_rayjob_manifest_runs_jobs_train_sized_for_its_cluster():
    job = load("rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "python" and argv[1].endswith("jobs/train.py")
    assert (ROOT / "jobs" / "train.py").is_file()
    assert spec["shutdownAfterJobFinishes"] is True
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert env["RAY_AUTH_MODE"] == "token" and env["PT_RAY_OUTPUT"] == "/mnt/pt-ray/runs"
    submitter = spec["submitterPodTemplate"]["spec"]["containers"][0]
    sub_env = {e["name"]: e.get("value", e.get("valueFrom")) for e in submitter["env"]}
    assert sub_env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN_FROM_SECRET}
    sizes = check_cluster_spec(spec["rayClusterSpec"])
    # The same cluster as raycluster.yaml.
    assert spec["rayClusterSpec"] == load("raycluster.yaml")["spec"]

    # The entrypoint's arguments resolve, with a config shipped in the image.
    config = argv[argv.index("--config") + 1]
    assert config.startswith("/home/ray/pt-ray/")
    local = ROOT / config.removeprefix("/home/ray/pt-ray/")
    assert local.is_file()
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = resolve_config(local, overrides)
    # One worker per GPU, and each pod's CPUs cover its workers' share.
    assert cfg.pipeline.num_workers == sizes["gpus"]
    for gpus, cpus in sizes["pods"]:
        assert gpus * cfg.pipeline.cpus_per_worker <= cpus
        assert gpus % cfg.pipeline.pipeline_length == 0  # pipelines start within a pod
        assert cfg.data.num_workers < cfg.pipeline.cpus_per_worker


def test_dockerfile_installs_the_project_and_ships_the_job_config():
    text = (CLUSTER / "Dockerfile").read_text()
    assert "rayproject/ray:2.60.0-py311-gpu" in text
    assert "pip install --no-cache-dir -e ." in text
    for path in ("pyproject.toml", "pt_ray", "jobs", "cluster/configs"):
        assert f" {path} " in text or f" {path}\n" in text or f"{path} ./" in text, path
