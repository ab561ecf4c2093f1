"""Production Temporal settings, run for real against the dev server.

A Temporal namespace other than `default`, made by the self-hosted overlay's own setup step (with
its retention); every process configured only through a Temporal config profile file; the Slurm
batch script run on this machine with two ranks (a stand-in `srun` starts its tasks); mutual TLS
through a local TLS-terminating proxy in front of the dev server (which has no TLS of its own),
with certificates from a profile file and from the TEMPORAL_TLS_*_DATA variables a Kubernetes
Secret provides.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import signal
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from timeslice.cli.server import EmbeddedServer, temporal_binary
from timeslice.cli.services import stop_service
from timeslice.protocol.group import SEARCH_ATTRIBUTES

from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
TIMESLICE = str(VENV_BIN / "timeslice")
FAST = {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05, "state_bytes": 1024}
# Variables that would otherwise override the profile under test.
TEMPORAL_ENV = (
    "TEMPORAL_ADDRESS",
    "TEMPORAL_NAMESPACE",
    "TEMPORAL_API_KEY",
    "TEMPORAL_PROFILE",
    "TEMPORAL_CONFIG_FILE",
    "TEMPORAL_TLS",
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def setup_script() -> tuple[str, dict[str, str]]:
    """The self-hosted overlay's namespace step: its shell script and its own variables."""
    rendered = subprocess.run(
        [
            str(VENV_BIN / "kubectl"),
            "kustomize",
            str(ROOT / "deploy/kubernetes/overlays/self-hosted"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    (job,) = [
        d
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] == "Job" and d["metadata"]["name"] == "timeslice-setup"
    ]
    (init,) = job["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["/bin/sh", "-c"]
    return init["args"][0], {e["name"]: e["value"] for e in init["env"]}


@dataclass
class Prod:
    """A non-default namespace on the session's dev server, reached through a profile file."""

    server: EmbeddedServer
    namespace: str
    retention: str  # the overlay's TEMPORAL_NAMESPACE_RETENTION
    env: dict[str, str]  # TEMPORAL_CONFIG_FILE + TEMPORAL_PROFILE, nothing else of Temporal's
    setup_outputs: list[str]  # what `timeslice setup` printed, run twice


def start(args: list[str], ready: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [TIMESLICE, *args], stdout=subprocess.PIPE, stderr=log.open("wb"), text=True, env=env
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if ready not in line:
        proc.kill()
        pytest.fail(f"`timeslice {' '.join(args)}` did not start: {line!r}\n{log.read_text()}")
    return proc


@pytest.fixture(scope="module")
def prod(server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prod]:
    """The namespace made by the self-hosted overlay's setup step, then `timeslice setup`."""
    tmp = tmp_path_factory.mktemp("prod")
    namespace = f"timeslice-prod-{uuid.uuid4().hex[:8]}"
    script, own_env = setup_script()
    script_env = clean_env(
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        TEMPORAL_ADDRESS=server.address,
        TEMPORAL_NAMESPACE=namespace,
        **own_env,
    )
    for _ in range(2):  # the second run finds the namespace and leaves it as it is
        made = run(["/bin/sh", "-c", script], script_env)
        assert made.returncode == 0, made.stderr
    profile_file = tmp / "temporal.toml"
    profile_file.write_text(
        f'[profile.prod]\naddress = "{server.address}"\nnamespace = "{namespace}"\n'
    )
    env = clean_env(TEMPORAL_CONFIG_FILE=str(profile_file), TEMPORAL_PROFILE="prod")

    def setup() -> str | None:  # a new namespace takes a moment to reach every service
        out = run([TIMESLICE, "setup"], env)
        return out.stdout.strip() if out.returncode == 0 else None

    outputs = [wait_for(setup, timeout=30, what="`timeslice setup` in the new namespace")]
    outputs.append(wait_for(setup, timeout=30, what="`timeslice setup` again"))
    yield Prod(server, namespace, own_env["TEMPORAL_NAMESPACE_RETENTION"], env, outputs)


def test_setup_creates_a_namespace_with_retention_and_registers_the_search_attributes(
    prod: Prod,
) -> None:
    described = run(
        [
            temporal_binary(),
            "operator",
            "namespace",
            "describe",
            "-n",
            prod.namespace,
            "-o",
            "json",
        ],
        clean_env(TEMPORAL_ADDRESS=prod.server.address),
    )
    assert described.returncode == 0, described.stderr
    retention = json.loads(described.stdout)["config"]["workflowExecutionRetentionTtl"]
    assert retention == f"{int(prod.retention.removesuffix('h')) * 3600}s"
    # The new namespace had none of the attributes the dev server made in `default`.
    first, again = prod.setup_outputs
    assert first.splitlines()[0] == f"namespace {prod.namespace!r}:"
    for name, kind in SEARCH_ATTRIBUTES.items():
        assert f"search attribute {name} ({kind}): registered now" in first
        assert f"search attribute {name} ({kind}): already registered" in again
    # No control worker serves the new namespace yet: setup says what to start.
    assert "control workers on task queue 'timeslice': none polling yet" in first


@pytest.fixture(scope="module")
def prod_worker(prod: Prod, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prod]:
    """A control worker configured by the profile alone."""
    log = tmp_path_factory.mktemp("prod-worker") / "worker.log"
    proc = start(["worker"], "control worker on task queue", prod.env, log)
    yield prod
    stop_service(proc)


SRUN = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    # Stand-in for Slurm's srun on one machine: --ntasks copies of the command, each with its
    # SLURM_PROCID / SLURM_LOCALID, SIGTERM passed on to them (as srun does).
    ntasks=1
    while [[ $1 == -* ]]; do
        case $1 in --ntasks=*) ntasks=${1#*=} ;; esac
        shift
    done
    pids=()
    for ((i = 0; i < ntasks; i++)); do
        SLURM_PROCID=$i SLURM_LOCALID=$i SLURMD_NODENAME=slurm-node-1 "$@" &
        pids+=($!)
    done
    trap 'kill -TERM "${pids[@]}" 2> /dev/null' TERM
    wait "${pids[@]}"
    wait "${pids[@]}"
    """
)


def sbatch_env(prod: Prod, tmp_path: Path, job: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "srun").chmod(0o755)
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job_config(job)))
    return {
        **prod.env,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "TIMESLICE_JOB_ID": job,
        "TIMESLICE_JOB_CONFIG": str(config),
        "TIMESLICE_WORKLOAD": "simulated",
        "TIMESLICE_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "TIMESLICE_BIN": TIMESLICE,
        "TEMPORAL_BIN": temporal_binary(),
        "TIMESLICE_POLL_S": "0.5",
    }


def job_config(job: str) -> dict[str, object]:
    return {
        "workload": "simulated",
        "workload_options": FAST,
        "sampler_group": f"g-{job}",
        "epochs": 2,
    }


def workflow_status(prod: Prod, job: str, namespace: str) -> str | None:
    described = run(
        [temporal_binary(), "workflow", "describe", "-w", f"rl-job-{job}", "-o", "json"],
        clean_env(TEMPORAL_ADDRESS=prod.server.address, TEMPORAL_NAMESPACE=namespace),
    )
    if described.returncode != 0:
        return None
    return json.loads(described.stdout)["workflowExecutionInfo"]["status"]


def run_sbatch(env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess:
    """Run the batch script in a session of its own, so a hung run leaves no task behind."""
    started = time.monotonic()
    args = ["bash", str(ROOT / "deploy/slurm/rl-job.sbatch")]
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"rl-job.sbatch ran past {timeout} s:\n{stdout}\n{stderr}")
    out = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    job = env["TIMESLICE_JOB_ID"]
    for rank in (0, 1):
        assert f"job {job} rank {rank}: workload simulated" in out.stdout, out.stdout
    agent = env.get("TIMESLICE_NODE_AGENT", "1") == "1"
    assert ("node agent on task queue 'timeslice-node-slurm-node-1'" in out.stdout) is agent
    assert out.stdout.count("stopping ...") == 2 + agent, "every task stopped at the end"
    assert time.monotonic() - started < 120
    # Each rank wrote its own part of every checkpoint (the last one after epoch 2).
    saved = sorted((Path(env["TIMESLICE_CHECKPOINT_DIR"]) / job).iterdir())
    assert saved and saved[-1].name == "epoch-000002"
    for checkpoint in saved:
        assert sorted(p.name for p in checkpoint.iterdir()) == ["rank-0", "rank-1"]
    return out


def test_sbatch_script_runs_a_two_rank_job_through_the_profile(
    prod_worker: Prod, tmp_path: Path
) -> None:
    job = f"slurm-{uuid.uuid4().hex[:8]}"
    # sbatch sets SLURM_CPUS_PER_TASK from --cpus-per-task: each rank gets --threads from it.
    out = run_sbatch({**sbatch_env(prod_worker, tmp_path, job), "SLURM_CPUS_PER_TASK": "1"})
    assert f"job {job} completed after 2 epochs" in out.stdout, out.stdout
    # The job ran in the profile's namespace, not in `default`.
    assert workflow_status(prod_worker, job, prod_worker.namespace) == (
        "WORKFLOW_EXECUTION_STATUS_COMPLETED"
    )
    assert workflow_status(prod_worker, job, "default") is None


def test_resubmitted_sbatch_script_serves_the_running_job_until_it_ends(
    prod_worker: Prod, tmp_path: Path
) -> None:
    """After a time limit the job's workflow still runs, waiting for ranks: a new allocation's
    ranks serve it and the script waits for its end instead of starting it again."""
    job = f"resume-{uuid.uuid4().hex[:8]}"
    # The agents run as a system service here (deploy/systemd).
    env = {**sbatch_env(prod_worker, tmp_path, job), "TIMESLICE_NODE_AGENT": "0"}
    started = run(
        [
            TIMESLICE,
            "job",
            "start",
            "--config",
            env["TIMESLICE_JOB_CONFIG"],
            "--job-id",
            job,
            "--ranks",
            "2",
        ],
        prod_worker.env,
    )
    assert started.returncode == 0, started.stderr
    out = run_sbatch(env)
    assert f"job {job} is already running: these 2 ranks serve it" in out.stdout
    assert f"[{job}] epoch 2/2" in out.stdout, "the progress it shows at the end"
    assert workflow_status(prod_worker, job, prod_worker.namespace) == (
        "WORKFLOW_EXECUTION_STATUS_COMPLETED"
    )


# --- mutual TLS ---------------------------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(folder: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("timeslice test CA"))
        .issuer_name(name("timeslice test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    write("ca", ca, ca_key)

    def leaf(cn: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName] | None) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        write(cn, builder.sign(ca_key, hashes.SHA256()), key)

    leaf("temporal.test", ExtendedKeyUsageOID.SERVER_AUTH, [x509.DNSName("temporal.test")])
    leaf("timeslice-client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    return Pki(
        ca=folder / "ca.pem",
        server_cert=folder / "temporal.test.pem",
        server_key=folder / "temporal.test.key",
        client_cert=folder / "timeslice-client.pem",
        client_key=folder / "timeslice-client.key",
    )


class TlsProxy:
    """Terminates TLS (client certificate required) and passes the bytes on to the dev server."""

    def __init__(self, pki: Pki, upstream: str) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
        self.context.load_cert_chain(pki.server_cert, pki.server_key)
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.set_alpn_protocols(["h2"])
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.clients: list[str] = []  # the common name of each verified client certificate
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.address = ""

    def __enter__(self) -> TlsProxy:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        )
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()
        server.close()
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(server.wait_closed())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peercert") or {}
        subject = dict(item for rdn in peer.get("subject", ()) for item in rdn)
        self.clients.append(subject.get("commonName", ""))
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@pytest.fixture(scope="module")
def mtls(prod: Prod, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TlsProxy, Pki]]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    with TlsProxy(pki, prod.server.address) as proxy:
        yield proxy, pki


def test_mtls_from_a_profile_file_reaches_temporal_through_tls_only(
    prod: Prod, mtls: tuple[TlsProxy, Pki], tmp_path: Path
) -> None:
    proxy, pki = mtls
    profiles = tmp_path / "temporal.toml"
    profiles.write_text(
        textwrap.dedent(
            f"""\
            [profile.mtls]
            address = "{proxy.address}"
            namespace = "{prod.namespace}"
            [profile.mtls.tls]
            server_name = "temporal.test"
            server_ca_cert_path = "{pki.ca}"
            client_cert_path = "{pki.client_cert}"
            client_key_path = "{pki.client_key}"

            [profile.no-client-cert]
            address = "{proxy.address}"
            namespace = "{prod.namespace}"
            [profile.no-client-cert.tls]
            server_name = "temporal.test"
            server_ca_cert_path = "{pki.ca}"
            """
        )
    )
    env = clean_env(TEMPORAL_CONFIG_FILE=str(profiles))
    seen = len(proxy.clients)
    ok = run([TIMESLICE, "setup", "--profile", "mtls"], env)
    assert ok.returncode == 0, ok.stderr
    assert all(f"search attribute {name} " in ok.stdout for name in SEARCH_ATTRIBUTES)
    assert "MISSING" not in ok.stdout, ok.stdout
    assert "timeslice-client" in proxy.clients[seen:]

    refused = run([TIMESLICE, "setup", "--profile", "no-client-cert"], env)
    assert refused.returncode != 0
    assert "cannot reach Temporal" in refused.stderr, refused.stderr


def test_mtls_from_the_variables_a_kubernetes_secret_provides(
    prod: Prod, mtls: tuple[TlsProxy, Pki]
) -> None:
    """What the overlays do: TEMPORAL_* from the ConfigMap, certificates from the Secret."""
    proxy, pki = mtls
    env = clean_env(
        TEMPORAL_ADDRESS=proxy.address,
        TEMPORAL_NAMESPACE=prod.namespace,
        TEMPORAL_TLS="true",
        TEMPORAL_TLS_SERVER_NAME="temporal.test",
        TEMPORAL_TLS_SERVER_CA_CERT_DATA=pki.ca.read_text(),
        TEMPORAL_TLS_CLIENT_CERT_DATA=pki.client_cert.read_text(),
        TEMPORAL_TLS_CLIENT_KEY_DATA=pki.client_key.read_text(),
    )
    seen = len(proxy.clients)
    # The Timeslice process and the temporal CLI of the self-hosted setup step, alike.
    ok = run([TIMESLICE, "setup"], env)
    assert ok.returncode == 0, ok.stderr
    described = run(
        [temporal_binary(), "operator", "namespace", "describe", "-n", prod.namespace], env
    )
    assert described.returncode == 0, described.stderr
    assert proxy.clients[seen:].count("timeslice-client") >= 2
