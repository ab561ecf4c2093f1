"""deploy/, checked offline: the Dockerfile, every Kubernetes overlay, the Slurm scripts and the
systemd units.

The overlays are rendered by `kubectl kustomize` and validated against the Kubernetes schemas
(kubernetes-validate); the Dockerfile is linted by hadolint and the shell scripts by shellcheck
(all from the `dev` extra's wheels). Every command a manifest or unit runs is parsed by the real
`timeslice` argument parser, so a renamed flag breaks this test, not a deployment.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from temporalio.envconfig import ClientConfig
from timeslice.cli.main import _parser
from timeslice.jobs import parse_job_config
from timeslice.protocol.group import job_task_queue, node_task_queue
from timeslice.transport.connection import connect_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
VENV_BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
IMAGE_UID = 10001
# The oldest Kubernetes the manifests support (the StatefulSet pod-index label is 1.28+, on by
# default from 1.28) and the newest whose schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "Job"}

OVERLAYS = sorted(p.parent for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
EXAMPLES = sorted(p.parent for p in (KUBE / "examples").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [KUBE / "base", *OVERLAYS, *EXAMPLES]


def tool(name: str) -> str:
    """A linter or kubectl from this environment's scripts (the dev extra's wheels)."""
    path = VENV_BIN / name
    if path.exists():
        return str(path)
    pytest.fail(f"{name} is not installed here: `make test` installs it (pyproject's dev extra)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def render(kustomization: Path) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [tool("kubectl"), "kustomize", str(kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, f"kubectl kustomize {rel(kustomization)} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def kinds(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in kinds(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def component(doc: dict[str, Any]) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def expand(container: dict[str, Any], docs: tuple[dict[str, Any], ...]) -> list[str]:
    """The container's command line as the kubelet runs it: $(VAR) replaced from its env.

    Values from the downward API get a realistic stand-in; a $(VAR) the container does not
    define fails the test (Kubernetes would pass it on literally)."""
    values: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            stand_in = {
                "spec.nodeName": "gpu-node-1.cluster.internal",
                "metadata.labels['apps.kubernetes.io/pod-index']": "1",
            }
            assert path in stand_in, f"no stand-in for fieldRef {path}"
            values[var["name"]] = stand_in[path]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            values[var["name"]] = one(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            pytest.fail(f"unexpected env source {source}")
    words = [*container.get("command", []), *container.get("args", [])]
    out = []
    for word in words:
        for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", word):
            assert name in values, f"{container['name']}: $({name}) is not in its env"
            word = word.replace(f"$({name})", values[name])
        out.append(word)
    return out


def timeslice_args(container: dict[str, Any], docs: tuple[dict[str, Any], ...]) -> Any:
    """Parse the container's command with the real CLI parser (the image's entry point)."""
    words = expand(container, docs)
    assert "command" not in container, f"{container['name']}: run through the entry point"
    return _parser().parse_args(words)


# --- Kubernetes ---------------------------------------------------------------------------


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=rel)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_kustomization_renders_and_validates_against_the_schemas(
    kustomization: Path, version: str
) -> None:
    docs = render(kustomization)
    assert workloads(docs), f"{rel(kustomization)} renders no workload"
    failures = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {err.message}")
    assert not failures, f"{rel(kustomization)} against Kubernetes {version}:\n" + "\n".join(
        failures
    )


def test_the_overlays_and_examples_are_all_there() -> None:
    assert {p.name for p in OVERLAYS} == {"self-hosted", "self-hosted-mtls", "temporal-cloud"}
    assert {p.name for p in EXAMPLES} == {"rl-job"}


@pytest.mark.parametrize("kustomization", [*OVERLAYS, *EXAMPLES], ids=rel)
def test_every_pod_runs_with_least_privilege(kustomization: Path) -> None:
    docs = render(kustomization)
    assert not [d for d in docs if d["kind"] in {"Role", "ClusterRole", "RoleBinding"}]
    for work in workloads(docs):
        pod = work["spec"]["template"]["spec"]
        name = f"{work['kind']}/{work['metadata']['name']}"
        agent = component(work) == "node-agent"
        assert pod.get("automountServiceAccountToken") is False, name
        assert not pod.get("hostNetwork") and not pod.get("hostIPC"), name
        # Only the node agent shares the host's PID namespace (cuda-checkpoint needs it).
        assert bool(pod.get("hostPID")) is agent, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        if not agent:
            assert pod["securityContext"]["runAsNonRoot"] is True, name
            assert pod["securityContext"]["runAsUser"] == IMAGE_UID, name
        for c in containers(pod):
            where = f"{name} container {c['name']}"
            sc = c["securityContext"]
            assert not sc.get("privileged"), where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc["capabilities"].get("add", []) == (["SYS_PTRACE"] if agent else []), where
            requests = c["resources"]["requests"]
            assert {"cpu", "memory"} <= requests.keys(), f"{where}: requests {requests}"
            assert "memory" in c["resources"]["limits"], where


@pytest.mark.parametrize("kustomization", [*OVERLAYS, *EXAMPLES], ids=rel)
def test_every_container_reads_the_temporal_settings_and_runs_a_real_command(
    kustomization: Path,
) -> None:
    docs = render(kustomization)
    for work in workloads(docs):
        for c in containers(work["spec"]["template"]["spec"]):
            where = f"{work['metadata']['name']} container {c['name']}"
            sources = c["envFrom"]
            assert {"configMapRef": {"name": "timeslice-temporal"}} in sources, where
            assert {
                "secretRef": {"name": "timeslice-temporal-auth", "optional": True}
            } in sources, where
            assert re.fullmatch(rf"timeslice:{re.escape(VERSION)}-(cpu|cuda)", c["image"]), (
                f"{where}: {c['image']} is not an image the Dockerfile builds"
            )
            if "command" not in c:
                timeslice_args(c, docs)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=rel)
def test_overlay_points_every_process_at_one_temporal_namespace(overlay: Path) -> None:
    docs = render(overlay)
    settings = one(docs, "ConfigMap", "timeslice-temporal")["data"]
    config = connect_config(settings["TEMPORAL_ADDRESS"], settings["TEMPORAL_NAMESPACE"])
    assert config["namespace"] != "default", "production runs in a namespace of its own"
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
        one(docs, "Namespace", "timeslice")["metadata"]["name"]
    }
    if overlay.name != "self-hosted":
        assert settings["TEMPORAL_TLS"] == "true"
    accounts = {d["metadata"]["name"] for d in kinds(docs, "ServiceAccount")}
    for work in workloads(docs):
        assert work["spec"]["template"]["spec"]["serviceAccountName"] in accounts


@pytest.mark.parametrize("overlay", OVERLAYS, ids=rel)
def test_node_agent_serves_the_queue_named_after_its_node(overlay: Path) -> None:
    docs = render(overlay)
    agent = one(docs, "DaemonSet", "timeslice-node-agent")
    pod = agent["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    args = timeslice_args(c, docs)
    assert args.command == "agent"
    assert node_task_queue(args.node) == "timeslice-node-gpu-node-1.cluster.internal"
    # GPU nodes only, and no GPU taken from the jobs it serves.
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert not any("nvidia.com" in k for k in c["resources"].get("requests", {}))
    assert not any("nvidia.com" in k for k in c["resources"].get("limits", {}))
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert c["image"].endswith("-cuda"), "cuda-checkpoint needs the cuda extra"
    assert_probes_hit_the_metrics_port(c, args)


def assert_probes_hit_the_metrics_port(container: dict[str, Any], args: Any) -> None:
    port = int(args.metrics_port)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == port
    assert {"livenessProbe", "startupProbe"} <= container.keys()
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in container:
            get = container[probe]["httpGet"]
            assert (get["path"], get["port"]) == ("/metrics", "metrics"), probe


@pytest.mark.parametrize("overlay", OVERLAYS, ids=rel)
def test_control_worker_is_probed_scraped_and_kept_through_drains(overlay: Path) -> None:
    docs = render(overlay)
    worker = one(docs, "Deployment", "timeslice-control-worker")
    (c,) = worker["spec"]["template"]["spec"]["containers"]
    args = timeslice_args(c, docs)
    assert args.command == "worker"
    assert_probes_hit_the_metrics_port(c, args)
    assert "readinessProbe" in c
    pods = worker["spec"]["template"]["metadata"]
    assert pods["annotations"]["prometheus.io/scrape"] == "true"
    assert int(pods["annotations"]["prometheus.io/port"]) == int(args.metrics_port)
    selector = worker["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pods["labels"].items()
    pdb = one(docs, "PodDisruptionBudget", "timeslice-control-worker")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert pdb["spec"]["minAvailable"] < worker["spec"]["replicas"]
    service = one(docs, "Service", "timeslice-control-worker-metrics")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    setup = one(docs, "Job", "timeslice-setup")
    (main,) = setup["spec"]["template"]["spec"]["containers"]
    assert timeslice_args(main, docs).command == "setup"


def test_self_hosted_setup_creates_the_namespace_with_a_retention() -> None:
    docs = render(KUBE / "overlays" / "self-hosted")
    pod = one(docs, "Job", "timeslice-setup")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    script = init["args"][0]
    assert "temporal operator namespace create" in script
    assert "--retention" in script
    env = {e["name"]: e["value"] for e in init["env"]}
    assert re.fullmatch(r"\d+h", env["TEMPORAL_NAMESPACE_RETENTION"])
    # Temporal Cloud namespaces are made in Cloud: no such step there.
    cloud = render(KUBE / "overlays" / "temporal-cloud")
    assert "initContainers" not in one(cloud, "Job", "timeslice-setup")["spec"]["template"]["spec"]


def test_rl_job_example_runs_one_rank_per_pod_with_its_job_id_and_a_gpu() -> None:
    docs = render(KUBE / "examples" / "rl-job")
    ranks = one(docs, "StatefulSet", "rl-job")
    (settings,) = kinds(docs, "ConfigMap")
    job_config = json.loads(settings["data"]["job.json"])
    job_id = settings["data"]["TIMESLICE_JOB_ID"]
    config = parse_job_config({**job_config, "job_id": job_id})
    assert ranks["spec"]["replicas"] == config.ranks
    (c,) = ranks["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert "configMapKeyRef" in env["TIMESLICE_JOB_ID"]["valueFrom"]
    args = timeslice_args(c, docs)
    assert (args.command, args.job_command) == ("job", "worker")
    assert args.job_ids == [job_id] and args.workload == config.workload
    assert job_task_queue(args.job_ids[0], args.rank) == f"timeslice-job-{job_id}-1"
    assert str(args.checkpoint_dir) in {m["mountPath"] for m in c["volumeMounts"]}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["image"].endswith("-cuda")
    assert_probes_hit_the_metrics_port(c, args)
    start = one(docs, "Job", "rl-job-start")
    (s,) = start["spec"]["template"]["spec"]["containers"]
    start_args = timeslice_args(s, docs)
    assert (start_args.job_command, start_args.job_id) == ("start", job_id)
    assert str(start_args.config.parent) in {m["mountPath"] for m in s["volumeMounts"]}


# --- Container image ----------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"


def test_dockerfile_passes_hadolint() -> None:
    out = subprocess.run(
        [tool("hadolint"), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_what_it_should() -> None:
    bad = "FROM python:latest\nRUN pip install temporalio\nRUN cd /tmp && echo hi\n"
    out = subprocess.run(
        [tool("hadolint"), "--no-color", "-"],
        input=bad,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert {"DL3007", "DL3013", "DL3003"} <= set(re.findall(r"DL\d{4}", out.stdout))


def test_dockerfile_builds_the_package_from_the_repository_as_a_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base, "the base image is a build argument with a default"
    # Pinned: an exact Python release (or a digest), never a moving tag.
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base[1])
    assert len(re.findall(r"^FROM \$\{PYTHON_IMAGE\}", text, re.M)) == 2, "two stages"
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", text, re.M))
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs | {"pyproject.toml"} <= copied
    first_copy = re.search(r"^COPY pyproject.toml (.*) \./$", text, re.M)
    assert first_copy and PYPROJECT["project"]["readme"] in first_copy[1].split()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for path in package_dirs:
        assert f"!{path}/" in ignore, f".dockerignore keeps {path}/ out of the build context"
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users == [f"{IMAGE_UID}:{IMAGE_UID}"], "the last stage runs as the fixed non-root UID"
    assert re.search(rf"useradd .*--uid {IMAGE_UID}", text)
    extras = PYPROJECT["project"]["optional-dependencies"]
    variants = dict(re.findall(r'^\s+(\w+)\) extras="([\w,]+)" ;; \\$', text, re.M))
    assert set(variants) == {"cpu", "cuda"}
    for names in variants.values():
        assert set(names.split(",")) <= extras.keys()
    assert {"torch", "cuda"} <= set(variants["cuda"].split(","))
    assert "torch" not in variants["cpu"].split(",")
    assert re.search(r'^ENTRYPOINT \["timeslice"\]$', text, re.M)


# --- Slurm, systemd, Temporal settings ----------------------------------------------------

SHELL_SCRIPTS = sorted([*DEPLOY.glob("slurm/*.sh"), *DEPLOY.glob("slurm/*.sbatch")])


def test_slurm_scripts_are_there() -> None:
    assert {p.name for p in SHELL_SCRIPTS} == {"rl-job.sbatch", "timeslice-task.sh"}


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=rel)
def test_slurm_script_parses_and_passes_shellcheck(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{rel(script)} is not executable"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    lint = subprocess.run(
        [tool("shellcheck"), "--shell=bash", "--severity=style", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_sbatch_directives_come_before_the_first_command() -> None:
    lines = (DEPLOY / "slurm" / "rl-job.sbatch").read_text().splitlines()
    first_command = next(
        i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#")
    )
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_command
    assert any("--gpus-per-task" in lines[i] for i in directives)


UNITS = sorted(DEPLOY.glob("systemd/*.service"))


def unit_values(unit: Path, key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", unit.read_text(), re.M)


def test_systemd_units_are_there() -> None:
    assert {u.name for u in UNITS} == {"timeslice-worker.service", "timeslice-agent.service"}


@pytest.mark.parametrize("unit", UNITS, ids=rel)
def test_systemd_unit_verifies_and_runs_a_real_command(unit: Path, tmp_path: Path) -> None:
    (exec_start,) = unit_values(unit, "ExecStart")
    binary, *words = shlex.split(exec_start)
    assert binary == "/opt/timeslice/venv/bin/timeslice", "the install path deploy/README.md uses"
    args = _parser().parse_args([w.replace("%l", "gpu-node-1") for w in words])
    assert args.command in {"worker", "agent"}
    assert args.metrics_port
    if args.command == "agent":
        assert words[words.index("--node") + 1] == "%l", "the queue comes from the host name"
        assert unit_values(unit, "CapabilityBoundingSet") == ["CAP_SYS_PTRACE"]
    else:
        assert unit_values(unit, "CapabilityBoundingSet") == [""]
        assert unit_values(unit, "User") == ["timeslice"]
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing: .ci/run installs Debian's systemd")
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    # Verified where this environment's `timeslice` stands in for the install path.
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace(binary, str(VENV_BIN / "timeslice")))
    out = subprocess.run(
        [analyze, "verify", "--man=no", str(local)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_example_temporal_profiles_load_with_the_sdk() -> None:
    path = DEPLOY / "temporal" / "temporal.toml"
    profiles = ClientConfig.load(config_source=path).profiles
    assert {"prod", "cloud"} <= profiles.keys()
    for name, profile in profiles.items():
        assert profile.address and profile.namespace not in (None, "default"), name
    assert profiles["prod"].tls and profiles["prod"].tls.client_cert
    assert profiles["cloud"].api_key
    env_file = (DEPLOY / "systemd" / "timeslice.env").read_text()
    assert "TEMPORAL_CONFIG_FILE=/etc/timeslice/temporal.toml" in env_file
