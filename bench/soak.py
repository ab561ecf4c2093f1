"""Soak with faults: contenders and RL jobs share one GPU group while faults strike at random.

    .venv/bin/python bench/soak.py --duration 60 --seed 1 --contenders 4 --rl-jobs 2 --out DIR

One embedded Temporal server (SQLite file under DIR), one control worker, ``--contenders`` client
processes that acquire / hold / release the group ``soak`` in a loop, and ``--rl-jobs`` RL jobs
(`RLJobWorkflow`, one `timeslice job worker` process each, the `simulated` phases with a ledger:
bench/soak_workload.py) all use the one group for ``--duration`` seconds. Meanwhile, at seeded
random times, the soak injects faults, cycling through every kind before repeating one:

- ``kill_holder``: kill -9 of a contender whose log says it holds the group; restarted at once
- ``kill_waiter``: kill -9 of a contender waiting in ``acquire``; restarted at once
- ``kill_rl_job``: kill -9 of an RL job's process; restarted as a user would (same command)
- ``kill_worker``: kill -9 of the control worker; restarted
- ``restart_server``: the Temporal server stopped and started again on the same database
- ``pause_waiter``: SIGSTOP of a contender waiting in ``acquire``, for longer than the group's
  grant confirmation time-out (``--ttl``), then SIGCONT: its grant may reach it late, after the
  group took it for dead and granted the next waiter
- ``forge_grant``: kill -9 of an RL job's process (restarted) and, once its workflow waits for
  the lease of its new prepare, a ``timeslice_grant`` signal to that workflow naming the request
  and the holder's token (what `timeslice status` shows), every other one with a ``fault``: a
  caller inside the namespace pretending to be the group
- ``worker_down_in_prepare``: kill -9 of an RL job's process, restarted with a slow model load
  (its prepare, under the job workflow's lease, takes ``--rl-ttl`` + 8 s); once the load has
  begun, kill -9 of the control worker, restarted ``--rl-ttl`` + 2 s later: the group then finds
  the job's lease expired and grants the next waiter while the load may still run

A contender kill is classified by what the victim's own log says it was doing when it died (a
holder may release just before the signal lands); a kind that missed is owed to a later slot.
Then contenders are told to stop, the RL jobs get `stop` (finish the epoch, checkpoint), and
everything is checked from the processes' own logs:

- **overlaps**: no two holds of the group overlap, on the system-wide monotonic clock. A
  contender's hold runs from ``acquire`` returning to its release call, cut at its lease's local
  validity (``Lease.valid_until``, which ends before the group's own expiry) if that ran out
  first; a holder killed holding holds until it was reaped (its lease lives on at the group until
  its TTL, but nobody uses it). An RL job's holds are its GPU phases (sample, train) as the
  workload logged them, a phase cut by a kill ending when its process was reaped.
- **lost**: every ``acquire`` a contender issued ended in exactly one of granted, timed out
  (``AcquireTimeoutError``) or another typed error, or died with its process; one still pending
  in a live process when the soak ended is lost. **Granted twice**: a fencing token seen by two
  requests (an RL job carries one lease across its own consecutive phases: same job, same token).
- **RL epochs exactly once**: each job's final checkpoint holds the ledger 0..N-1 for the N epochs
  its result reports, its records are contiguous, and every training step in every process was
  applied to the state of exactly the epochs before it (no epoch applied twice or skipped, across
  kills and rewinds).

It prints a summary and writes ``DIR/soak.json``; the exit status is 0 only if every check held.
Hand-off = a contender's release call → the next contender's ``acquire`` returning, for
consecutive fencing tokens where the next one was already waiting, under whatever faults struck.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
GROUP = "soak"
# TIMESLICE_SOAK_LOG_LEVEL=DEBUG: every process logs what the client library does, for digging.
VERBOSE = ["-v"] if os.environ.get("TIMESLICE_SOAK_LOG_LEVEL") == "DEBUG" else []
# Lease records the group keeps; polled every ``--progress-every`` s, they cover minutes.
FAULT_KINDS = (
    "kill_holder",
    "kill_waiter",
    "kill_rl_job",
    "kill_worker",
    "restart_server",
    "pause_waiter",
    "forge_grant",
    "worker_down_in_prepare",
)
# Kinds that need RL jobs to strike.
RL_FAULT_KINDS = ("kill_rl_job", "forge_grant", "worker_down_in_prepare")
WORKLOAD = "soak_workload:create"
SLOW_PREPARE = "slow-prepare-"  # bench/soak_workload.py reads it
# What each RL phase holds for: short, so a 60-s soak still runs dozens of epochs per job.
RL_PHASES = {"sample_s": 0.2, "reward_s": 0.3, "train_s": 0.1}


# ---------------------------------------------------------------- the contender process


def run_contender(args: argparse.Namespace) -> None:
    """One contender: acquire, hold a random while, release, pause; log every step."""
    from timeslice import (
        AcquireTimeoutError,
        LeaseRevokedError,
        TimesliceError,
        TimeSliceOrchestratorClient,
    )

    # What the client library says (retries, lost renewals) lands in this process's stderr file.
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("timeslice").setLevel(os.environ.get("TIMESLICE_SOAK_LOG_LEVEL", "INFO"))
    rng = random.Random(f"{args.seed}:{args.job_id}")
    stop = Path(args.stop_file)
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - line-buffered: a kill -9 loses nothing

    def emit(event: str, **fields: Any) -> None:
        record = {"job": args.job_id, "pid": os.getpid(), "event": event,
                  "t": time.monotonic(), "wall": time.time(), **fields}  # fmt: skip
        log.write(json.dumps(record) + "\n")

    # Restarted right after a fault, the server or the control worker may still be coming
    # back: keep trying, as a supervisor restarting a user's process would.
    deadline = time.monotonic() + 120
    while True:
        client = TimeSliceOrchestratorClient(
            target=args.address, job_id=args.job_id, lease_ttl=args.ttl
        )
        try:
            client.connect()
            break
        except Exception as err:  # any failure to connect is retried until the deadline
            emit("connect_error", kind=type(err).__name__, error=str(err))
            with contextlib.suppress(Exception):
                client.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    emit("ready")
    if args.wait_go:
        sys.stdin.readline()  # the soak's start line: every contender asks from the same moment
    seq = 0
    while not stop.exists():
        seq += 1
        emit("ask", seq=seq)
        try:
            lease = client.acquire(args.group, timeout=args.acquire_timeout)
        except AcquireTimeoutError as err:
            emit("timeout", seq=seq, error=str(err))
            continue
        except TimesliceError as err:
            emit("error", seq=seq, kind=type(err).__name__, error=str(err))
            time.sleep(0.5)  # e.g. no control worker for a moment: ask again shortly
            continue
        emit("acquired", seq=seq, token=lease.token, request_id=lease.request_id)
        end = time.monotonic() + rng.uniform(args.hold_min, args.hold_max)
        lost = False
        # Stands in for a GPU phase that uses the device only while the lease is valid: it
        # wakes when the hold is done or the lease's local validity runs out, whichever first
        # (renewals on the client's own thread push validity on meanwhile).
        while (now := time.monotonic()) < end:
            if not lease.valid:
                lost = True
                break
            time.sleep(max(0.0, min(end, lease.valid_until) - now))
        emit("releasing", seq=seq, token=lease.token, lost=lost, valid_until=lease.valid_until)
        try:
            client.release(lease)
            emit("released", seq=seq, token=lease.token)
        except LeaseRevokedError as err:
            emit("revoked", seq=seq, token=lease.token, error=str(err))
        except TimesliceError as err:
            emit("release_error", seq=seq, token=lease.token, kind=type(err).__name__,
                 error=str(err))  # fmt: skip
        time.sleep(rng.uniform(0.0, args.pause_max))  # the job's CPU work between GPU phases
    emit("done")
    client.close()
    emit("closed")
    log.close()
    sys.stdout.flush()
    # Skip interpreter teardown: the Temporal SDK's native threads can crash a finished
    # process there (temporalio/sdk-python#300), which would read as a contender crash.
    os._exit(0)


# ---------------------------------------------------------------- logs


def read_jsonl(path: Path | None) -> list[dict[str, Any]]:
    """Every complete line of a JSON-lines log (a kill -9 can leave a partial last line)."""
    if path is None or not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


class Tail:
    """The last record of a log, read incrementally (the soak polls it every few ms)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self.last: dict[str, Any] | None = None
        self.count: Counter[str] = Counter()

    def poll(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return self.last
        with self.path.open() as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # "" after a complete line
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                self.last = record
                self.count[record["event"]] += 1
        return self.last


# ---------------------------------------------------------------- processes


@dataclass
class Incarnation:
    """One process of a role (a contender, an RL job's process, the control worker)."""

    role: str  # "contender", "rl", "worker"
    name: str
    number: int
    proc: subprocess.Popen[Any]
    started: float
    log: Path | None = None
    tail: Tail | None = None
    killed_at: float | None = None  # monotonic, once reaped after our kill -9
    killed_wall: float | None = None
    ended_at: float | None = None  # monotonic, when it was seen gone (killed or not)
    exit_code: int | None = None
    #: (start, end) wall-clock times it was stopped by ``pause_waiter``
    paused_wall: list[tuple[float, float]] = field(default_factory=list)

    @property
    def job(self) -> str:
        """The job id it runs as: a restarted contender is a new job (as a client's default
        job id is unique per process); an RL job's processes all serve the one job."""
        return f"{self.name}.{self.number}" if self.role == "contender" else self.name

    @property
    def label(self) -> str:
        """How reports name it: a contender by its job id, another process as job#number."""
        return self.job if self.role == "contender" else f"{self.name}#{self.number}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Fault:
    kind: str
    planned: str
    t: float
    wall: float
    target: str
    detail: str = ""
    took_s: float = 0.0


@dataclass
class Settings:
    address: str
    out: Path
    logs: Path
    seed: int
    contenders: int
    rl_jobs: int
    ttl: float
    rl_ttl: float
    acquire_timeout: float
    hold_min: float
    hold_max: float
    pause_max: float
    stop_file: Path
    checkpoints: Path
    #: The kinds this soak injects (--faults, less the RL kinds without RL jobs).
    fault_kinds: tuple[str, ...] = FAULT_KINDS


@dataclass
class Soak:
    settings: Settings
    stack: Any  # timeslice.cli.stack.Stack: the server, the control worker, the RL processes
    procs: list[Incarnation] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    crashes: list[dict[str, Any]] = field(default_factory=list)
    server_down: list[tuple[float, float]] = field(default_factory=list)

    # -------------------------------------------------------------- starting

    def live(self, role: str, name: str | None = None) -> list[Incarnation]:
        return [
            p
            for p in self.procs
            if p.role == role and (name is None or p.name == name) and p.ended_at is None
        ]

    def _number(self, role: str, name: str) -> int:
        return sum(1 for p in self.procs if p.role == role and p.name == name)

    def start_contender(self, name: str, *, gated: bool = False) -> Incarnation:
        """Start a contender; ``gated``: it connects, then waits for :meth:`go` to ask."""
        s = self.settings
        number = self._number("contender", name)
        log = s.logs / f"contender-{name}-{number}.jsonl"
        cmd = [
            sys.executable, __file__, "--role", "contender", "--address", s.address,
            "--group", GROUP, "--job-id", f"{name}.{number}",
            "--log", str(log), "--seed", str(s.seed), "--ttl", str(s.ttl),
            "--acquire-timeout", str(s.acquire_timeout), "--hold-min", str(s.hold_min),
            "--hold-max", str(s.hold_max), "--pause-max", str(s.pause_max),
            "--stop-file", str(s.stop_file), *(["--wait-go"] if gated else []),
        ]  # fmt: skip
        stderr = (s.logs / f"contender-{name}-{number}.stderr").open("wb")
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
        )
        stderr.close()
        inc = Incarnation("contender", name, number, proc, time.monotonic(), log, Tail(log))
        self.procs.append(inc)
        return inc

    def go(self) -> None:
        """The start line for the gated contenders."""
        for inc in self.live("contender"):
            if inc.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    inc.proc.stdin.write(b"go\n")
                    inc.proc.stdin.close()

    def start_worker(self) -> Incarnation:
        number = self._number("worker", "control")
        proc = self.stack.control_worker(log="control-worker.log")
        inc = Incarnation("worker", "control", number, proc, time.monotonic())
        self.procs.append(inc)
        return inc

    def start_rl_processes(self, *jobs: str) -> list[Incarnation]:
        """Start a process for each of ``jobs`` at once; back when each serves."""
        from timeslice.cli.stack import JobWorker

        s = self.settings
        numbers = [self._number("rl", job) for job in jobs]
        procs = self.stack.job_workers(
            *(
                # --keep-serving: the soak tells a crash by an exit, and ends them itself
                JobWorker((job,), WORKLOAD,
                          ("--checkpoint-dir", str(s.checkpoints), "--keep-serving"),
                          log=f"rl-{job}.worker.log")
                for job in jobs
            )
        )  # fmt: skip
        started = []
        for job, number, proc in zip(jobs, numbers, procs, strict=True):
            log = s.logs / f"rl-{proc.pid}.jsonl"  # named by the workload after its process
            started.append(Incarnation("rl", job, number, proc, time.monotonic(), log, Tail(log)))
        self.procs += started
        return started

    def start_rl_process(self, job: str) -> Incarnation:
        return self.start_rl_processes(job)[0]

    # -------------------------------------------------------------- faults

    def kill(self, inc: Incarnation) -> float:
        """kill -9 and reap: once this returns the process cannot touch anything any more."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(inc.proc.pid, signal.SIGKILL)
        inc.proc.wait()
        inc.killed_at = inc.ended_at = time.monotonic()
        inc.killed_wall = time.time()
        inc.exit_code = inc.proc.returncode
        return inc.killed_at

    def _candidates(self, want: str) -> list[Incarnation]:
        found = []
        for inc in self.live("contender"):
            assert inc.tail is not None
            last = inc.tail.poll()
            if last is None:
                continue
            holding = last["event"] == "acquired"
            # Asked a moment ago at least: its request has reached the group and waits there.
            waiting = last["event"] == "ask" and time.monotonic() - last["t"] > 0.2
            if (want == "kill_holder" and holding) or (want == "kill_waiter" and waiting):
                found.append(inc)
        return found

    def kill_contender(self, planned: str, rng: random.Random, patience: float) -> Fault | None:
        deadline = time.monotonic() + patience
        while not (found := self._candidates(planned)):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)  # polling the victims' logs for a moment to strike in
        victim = rng.choice(found)
        t0 = time.monotonic()
        killed_at = self.kill(victim)
        # What the victim was doing when it died, from its own log: the last word.
        records = read_jsonl(victim.log)
        last = records[-1]["event"] if records else "starting"
        kind = {"acquired": "kill_holder", "ask": "kill_waiter"}.get(last, "kill_contender_idle")
        detail = f"last logged {last!r}"
        if kind == "kill_holder":
            token = records[-1].get("token")
            detail += f" (token {token}, held {killed_at - records[-1]['t']:.2f} s)"
        self.start_contender(victim.name)
        return Fault(kind, planned, t0, time.time(), f"{victim.label}", detail,
                     time.monotonic() - t0)  # fmt: skip

    def kill_rl_job(self, rng: random.Random) -> Fault | None:
        live = self.live("rl")
        if not live:
            return None
        victim = rng.choice(live)
        t0 = time.monotonic()
        self.kill(victim)
        records = read_jsonl(victim.log)
        phases = [r for r in records if r["event"] in ("phase_start", "phase_end")]
        doing = "between GPU phases"
        if phases and phases[-1]["event"] == "phase_start":
            last = phases[-1]
            doing = f"in {last['phase']}" + (
                f" of epoch {last['epoch']}" if last["epoch"] >= 0 else ""
            )
        self.start_rl_process(victim.name)
        return Fault("kill_rl_job", "kill_rl_job", t0, time.time(),
                     f"{victim.label}", doing, time.monotonic() - t0)  # fmt: skip

    def kill_worker(self) -> Fault:
        (victim,) = self.live("worker")
        t0 = time.monotonic()
        self.kill(victim)
        self.start_worker()
        return Fault("kill_worker", "kill_worker", t0, time.time(), victim.label,
                     "restarted", time.monotonic() - t0)  # fmt: skip

    def restart_server(self) -> Fault:
        t0 = time.monotonic()
        self.stack.server.stop()
        down = time.monotonic()
        self.stack.server.start()  # same port, same SQLite file
        self.server_down.append((down, time.monotonic()))
        return Fault("restart_server", "restart_server", t0, time.time(), self.stack.address,
                     f"down {time.monotonic() - down:.1f} s", time.monotonic() - t0)  # fmt: skip

    def pause_waiter(self, rng: random.Random, patience: float) -> Fault | None:
        deadline = time.monotonic() + patience
        while not (found := self._candidates("kill_waiter")):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)  # polling the victims' logs for a moment to strike in
        victim = rng.choice(found)
        # Past the group's grant confirmation time-out: a grant made meanwhile is ended as
        # dead and the next waiter granted; the victim may still find it when it resumes.
        pause = self.settings.ttl + 2.0
        t0 = time.monotonic()
        stopped = time.time()
        try:
            os.kill(victim.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return None
        time.sleep(pause)  # the fault is the pause itself
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.proc.pid, signal.SIGCONT)
        victim.paused_wall.append((stopped, time.time()))
        return Fault("pause_waiter", "pause_waiter", t0, stopped, victim.label,
                     f"stopped {pause:.1f} s while asking", time.monotonic() - t0)  # fmt: skip

    def forge_grant(self, rng: random.Random) -> Fault | None:
        """Forge a grant while an RL job's *workflow* waits for a lease (its prepare: phases'
        leases are the process's, whose grants come by activity); the job is made to prepare
        again by a kill of its process first."""
        live = self.live("rl")
        if not live:
            return None
        victim = rng.choice(live)
        t0 = time.monotonic()
        self.kill(victim)
        self.start_rl_process(victim.name)
        forged = forge_rl_grant(
            self.settings.address,
            victim.name,
            # The job is taken for dead after its heartbeat time-out, then rewinds.
            patience=60.0,
            with_fault=sum(f.kind == "forge_grant" for f in self.faults) % 2 == 1,
        )
        if forged is None:
            return Fault("kill_rl_job", "forge_grant", t0, time.time(), victim.label,
                         "killed; it did not wait for its prepare lease in time to forge",
                         time.monotonic() - t0)  # fmt: skip
        return Fault("forge_grant", "forge_grant", t0, time.time(), victim.name, forged,
                     time.monotonic() - t0)  # fmt: skip

    def worker_down_in_prepare(self, rng: random.Random) -> Fault | None:
        live = self.live("rl")
        if not live:
            return None
        victim = rng.choice(live)
        outage = self.settings.rl_ttl + 2.0
        marker = self.settings.logs / f"{SLOW_PREPARE}{victim.name}"
        marker.write_text(str(outage + 6.0))
        try:
            t0 = time.monotonic()
            self.kill(victim)
            restarted = self.start_rl_process(victim.name)
            # It is taken for dead after its heartbeat time-out, then rewinds and prepares.
            deadline = time.monotonic() + 60
            while not any(r["event"] == "slow_prepare" for r in read_jsonl(restarted.log)):
                if time.monotonic() > deadline or not restarted.alive:
                    return Fault("kill_rl_job", "worker_down_in_prepare", t0, time.time(),
                                 victim.label, "killed; its new process did not start a slow "
                                 "prepare within 60 s", time.monotonic() - t0)  # fmt: skip
                time.sleep(0.05)  # polling its log for the load to begin
            (worker,) = self.live("worker")
            self.kill(worker)
            time.sleep(outage)  # the fault is the outage itself
            self.start_worker()
        finally:
            marker.unlink(missing_ok=True)
        return Fault("worker_down_in_prepare", "worker_down_in_prepare", t0, time.time(),
                     f"{restarted.label} and {worker.label}",
                     f"control worker down {outage:.1f} s during the job's prepare",
                     time.monotonic() - t0)  # fmt: skip

    def inject(self, planned: str, rng: random.Random, patience: float) -> Fault | None:
        if planned == "worker_down_in_prepare":
            return self.worker_down_in_prepare(rng)
        if planned in ("kill_holder", "kill_waiter"):
            return self.kill_contender(planned, rng, patience)
        if planned == "pause_waiter":
            return self.pause_waiter(rng, patience)
        if planned == "forge_grant":
            return self.forge_grant(rng)
        if planned == "kill_rl_job":
            return self.kill_rl_job(rng)
        if planned == "kill_worker":
            return self.kill_worker()
        return self.restart_server()

    # -------------------------------------------------------------- supervision

    def check_crashes(self) -> None:
        """A process that exits on its own mid-soak is a failure: record it, start another."""
        for inc in list(self.procs):
            if inc.ended_at is not None or inc.alive:
                continue
            inc.ended_at = time.monotonic()
            inc.exit_code = inc.proc.returncode
            tail = ""
            if inc.role == "contender":
                err = self.settings.logs / f"contender-{inc.name}-{inc.number}.stderr"
                tail = err.read_text(errors="replace")[-2000:] if err.exists() else ""
            self.crashes.append({"process": f"{inc.role} {inc.label}",
                                 "exit_code": inc.exit_code, "stderr_tail": tail})  # fmt: skip
            print(f"  !! {inc.role} {inc.label} exited with {inc.exit_code}", flush=True)
            if inc.role == "contender":
                self.start_contender(inc.name)
            elif inc.role == "rl":
                self.start_rl_process(inc.name)
            else:
                self.start_worker()


# ---------------------------------------------------------------- Temporal calls


def _temporal(address: str, coro_fn: Any) -> Any:
    """Run one coroutine against the server (a fresh connection: the server restarts)."""
    from timeslice.transport.connection import connect, connect_config

    async def go() -> Any:
        return await coro_fn(await connect(connect_config(address)))

    return asyncio.run(go())


def forge_rl_grant(address: str, job: str, *, patience: float, with_fault: bool) -> str | None:
    """Once ``job``'s workflow waits for a prepare lease behind a holder, signal it a forged
    grant naming that request and the holder's token, as `timeslice status` shows them.
    Returns what was forged, or None if the job did not wait so within ``patience``."""
    from timeslice.protocol.group import GRANT_SIGNAL, GroupQuery, GroupStatus, group_workflow_id
    from timeslice.protocol.rl_job import JobQuery, RLJobProgress, rl_job_workflow_id

    async def go(client: Any) -> str | None:
        group = client.get_workflow_handle(group_workflow_id(GROUP))
        rl_job = client.get_workflow_handle(rl_job_workflow_id(job))
        deadline = time.monotonic() + patience
        while True:
            with contextlib.suppress(Exception):  # the worker or server may be coming back
                progress = await rl_job.query(JobQuery.PROGRESS, result_type=RLJobProgress)
                if progress.phase == f"waiting for {GROUP} (prepare)":
                    status = await group.query(GroupQuery.STATUS, result_type=GroupStatus)
                    waiting = [w for w in status.queue if w.job_id == job]
                    if waiting and status.holder is not None:
                        break
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)  # until the job's workflow waits behind a holder
        request_id, token = waiting[0].request_id, status.holder.token
        notice: dict[str, Any] = {
            "group_id": GROUP,
            "request_id": request_id,
            "job_id": job,
            "reply_workflow_id": rl_job_workflow_id(job),
            "token": token,
            "ttl_s": 60.0,
            "waited_s": 0.0,
        }
        if with_fault:
            notice["fault"] = "forged: this job is faulted"
        await rl_job.signal(GRANT_SIGNAL, notice)
        return f"request {request_id} with token {token}" + (" and a fault" if with_fault else "")

    try:
        return _temporal(address, go)
    except Exception as err:  # the server restarting: a later slot tries again
        print(f"  (forge_grant missed: {err})", flush=True)
        return None


def start_rl_jobs(address: str, jobs: list[str], ttl: float, seed: int) -> None:
    from timeslice.jobs import parse_job_config, start_rl_job

    async def go(client: Any) -> None:
        for i, job in enumerate(jobs):
            config = {
                "job_id": job,
                "workload": WORKLOAD,
                "workload_options": RL_PHASES,
                "sampler_group": GROUP,
                "epochs": 1_000_000,  # ended by the `stop` signal when the soak ends
                "seed": seed * 100 + i,
                "lease_ttl_s": ttl,
                # A killed job process is taken for dead after this long (then rewound).
                "heartbeat_timeout_s": 5,
                "checkpoint_every": 3,
                "continue_as_new_every": 20,
                # Every fault may fail an epoch (a rewind); only a job that never gets going
                # again should fail.
                "max_failures": 100,
            }
            await start_rl_job(client, parse_job_config(config))

    _temporal(address, go)


def stop_rl_jobs(address: str, jobs: list[str], deadline: float) -> dict[str, Any]:
    """Signal `stop` to every job and wait for their results (RLJobResult, or the error)."""
    from timeslice.protocol.rl_job import JobSignal, RLJobResult, rl_job_workflow_id

    async def go(client: Any) -> dict[str, Any]:
        handles = [
            client.get_workflow_handle(rl_job_workflow_id(job), result_type=RLJobResult)
            for job in jobs
        ]
        results: dict[str, Any] = {}
        for job, handle in zip(jobs, handles, strict=True):
            try:
                await handle.signal(JobSignal.STOP)
            except Exception as err:  # already ended (failed): its result below says how
                print(f"  cannot stop {job}: {err}", flush=True)
        for job, handle in zip(jobs, handles, strict=True):
            try:
                remaining = max(1.0, deadline - time.monotonic())
                results[job] = await asyncio.wait_for(handle.result(), remaining)
            except Exception as err:  # a job that fails or hangs is reported, not raised
                results[job] = err
        return results

    return _temporal(address, go)


class LeaseHistory:
    """The group's own lease records (job, token, start, end, outcome), gathered from its
    status while the soak runs: the group keeps only its latest ``MAX_HISTORY_KEEP``."""

    def __init__(self, address: str, every_s: float) -> None:
        self.address = address
        self.every_s = every_s
        self.records: dict[int, Any] = {}  # token -> LeaseRecord
        self.polls = 0
        self.failed_polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-history", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):  # a sampling cadence, not a synchronisation
            self.poll()

    def poll(self) -> Any:
        """One status query (a fresh client: the server restarts under it); None if it failed."""
        from timeslice import TimeSliceOrchestratorClient

        try:
            with TimeSliceOrchestratorClient(target=self.address) as client:
                status = client.group_status(GROUP)
        except Exception:  # a fault under way: the next poll catches up
            self.failed_polls += 1
            return None
        for record in status.history:
            self.records[record.token] = record
        self.polls += 1
        return status

    def stop(self) -> Any:
        """Stop polling; the group's final status (None if the group would not answer)."""
        self._stop.set()
        self._thread.join(timeout=120)
        for _ in range(3):
            status = self.poll()
            if status is not None:
                return status
        return None


# ---------------------------------------------------------------- checks


@dataclass
class Hold:
    holder: str  # "contender c0#1", "rl j0#0"
    job: str
    start: float
    end: float
    token: int | None
    how: str  # released, lost (cut at local validity), killed, phase, phase-killed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def contender_holds(soak: Soak) -> tuple[list[Hold], dict[str, Any]]:
    """Holds, and the request ledger (outcomes, lost, granted twice) of every contender."""
    holds: list[Hold] = []
    outcomes: Counter[str] = Counter()
    lost: list[str] = []
    twice: list[str] = []
    errors: Counter[str] = Counter()
    for inc in soak.procs:
        if inc.role != "contender":
            continue
        who = f"contender {inc.label}"
        pending: dict[int, dict[str, Any]] = {}
        resolved: set[int] = set()
        open_hold: dict[str, Any] | None = None
        for r in read_jsonl(inc.log):
            event = r["event"]
            if event == "ask":
                pending[r["seq"]] = r
            elif event in ("acquired", "timeout", "error"):
                if r["seq"] in resolved:
                    twice.append(f"{who} request {r['seq']} answered twice ({event})")
                resolved.add(r["seq"])
                pending.pop(r["seq"], None)
                outcomes["granted" if event == "acquired" else event] += 1
                if event == "error":
                    errors[r["kind"]] += 1
                if event == "acquired":
                    open_hold = r
            elif event == "releasing":
                assert open_hold is not None and open_hold["token"] == r["token"], (who, r)
                end = min(r["t"], r["valid_until"])
                how = "lost" if r["lost"] or r["valid_until"] < r["t"] else "released"
                holds.append(Hold(who, inc.job, open_hold["t"], end, r["token"], how))
                open_hold = None
            elif event in ("revoked", "release_error"):
                outcomes[event] += 1
        if open_hold is not None:
            # It died holding: it used the group until it was reaped, no longer.
            end = inc.killed_at if inc.killed_at is not None else inc.ended_at
            holds.append(Hold(who, inc.job, open_hold["t"], end or open_hold["t"],
                              open_hold["token"], "killed"))  # fmt: skip
        for seq in pending:
            if inc.killed_at is not None:
                outcomes["died_with_process"] += 1
            else:
                lost.append(f"{who} request {seq} never answered (process alive)")
    tokens = Counter(h.token for h in holds)
    twice += [f"token {t} granted to {n} contender requests" for t, n in tokens.items() if n > 1]
    ledger = {
        "outcomes": dict(outcomes),
        "errors_by_type": dict(errors),
        "lost": lost,
        "granted_twice": twice,
    }
    return holds, ledger


def check_grants(
    soak: Soak, leases: dict[int, Any], holds: list[Hold]
) -> tuple[list[str], Counter[str], list[str]]:
    """The group's lease records against the contenders' logs.

    A grant no contender logged taking is fine if its process was dead, dying or giving up
    (the cancel of a timed-out request races the grant); it is *lost* if the process was alive
    and still waiting in that very request for the group's whole confirmation time-out after
    the grant (a waiting process takes its grant in milliseconds). Returns (lost, unclaimed by
    cause, tokens the group gave a job other than the one that used them)."""
    ack_s = soak.settings.ttl
    by_job = {inc.job: inc for inc in soak.procs if inc.role == "contender"}
    taken = {h.token: h.job for h in holds if h.token is not None}
    misattributed = [
        f"token {token}: used by {job}, granted by the group to {leases[token].job_id}"
        for token, job in taken.items()
        if token in leases and leases[token].job_id != job
    ]
    lost: list[str] = []
    unclaimed: Counter[str] = Counter()
    for token, record in sorted(leases.items()):
        inc = by_job.get(record.job_id)
        if inc is None or token in taken:
            continue  # an RL job's lease, or one a contender used
        start, end = record.start.timestamp(), record.end.timestamp()
        waiting = open_request_at(inc, start)
        if waiting is None:
            unclaimed["after its process gave up or died"] += 1
            continue
        # Paused (pause_waiter) at any moment of the grant's confirmation time: the process
        # did not run for all of it, so a grant it missed is the pause's doing, not lost.
        pauses = inc.paused_wall
        if any(stopped < start + ack_s and start <= resumed for stopped, resumed in pauses):
            unclaimed["its process was paused within the confirmation time"] += 1
            continue
        gave_up = waiting if waiting > 0 else float("inf")
        alive_until = inc.killed_wall if inc.killed_wall is not None else float("inf")
        span = min(end, gave_up, alive_until) - start
        if span < ack_s - 0.25:
            unclaimed["raced its process's death or give-up"] += 1
            continue
        unclaimed["never taken by its live, waiting process"] += 1
        lost.append(
            f"token {token} granted to {record.job_id} at {record.start:%H:%M:%S.%f}, which "
            f"was alive and waiting for {span:.1f} s after it and never took it "
            f"(the group ended it {record.outcome})"
        )
    return lost, unclaimed, misattributed


def open_request_at(inc: Incarnation, wall: float) -> float | None:
    """If the contender had a request outstanding at ``wall``: when it ended (wall clock; 0
    if it never did), else None."""
    asked: dict[int, float] = {}
    for r in read_jsonl(inc.log):
        if r["event"] == "ask":
            asked[r["seq"]] = r["wall"]
        elif r["event"] in ("acquired", "timeout", "error"):
            began = asked.pop(r["seq"], None)
            if began is not None and began <= wall <= r["wall"]:
                return r["wall"]
    if any(began <= wall for began in asked.values()):
        return 0.0
    return None


def rl_holds(soak: Soak) -> tuple[list[Hold], dict[str, list[dict[str, Any]]]]:
    """Each RL job's GPU phases as its workload logged them, and its apply / load records."""
    holds: list[Hold] = []
    ledger: dict[str, list[dict[str, Any]]] = {}
    for inc in soak.procs:
        if inc.role != "rl":
            continue
        who = f"rl {inc.label}"
        open_phase: dict[str, Any] | None = None
        for r in read_jsonl(inc.log):
            if r["event"] == "phase_start":
                open_phase = r
            elif r["event"] == "phase_end" and open_phase is not None:
                holds.append(Hold(who, inc.job, open_phase["t"], r["t"], None, "phase"))
                open_phase = None
            elif r["event"] in ("apply", "load", "setup", "save"):
                ledger.setdefault(inc.name, []).append({**r, "process": who})
        if open_phase is not None:
            end = inc.killed_at if inc.killed_at is not None else inc.ended_at
            holds.append(Hold(who, inc.job, open_phase["t"], end or open_phase["t"], None,
                              "phase-killed"))  # fmt: skip
    return holds, ledger


def overlaps(holds: list[Hold]) -> list[str]:
    """Every pair of holds that overlap in time (a sweep: each hold against the latest end)."""
    found = []
    ordered = sorted(holds, key=lambda h: (h.start, h.end))
    reach: Hold | None = None
    for h in ordered:
        if reach is not None and h.start < reach.end:
            found.append(
                f"{reach.holder} [{reach.how}, token {reach.token}] until {reach.end:.3f} and "
                f"{h.holder} [{h.how}, token {h.token}] from {h.start:.3f}: "
                f"{(min(reach.end, h.end) - h.start) * 1000:.1f} ms"
            )
        if reach is None or h.end > reach.end:
            reach = h
    return found


def handoffs_ms(soak: Soak) -> list[tuple[float, float]]:
    """(release call, ms to the next grant returned), for consecutive tokens where the next
    holder was already asking (monotonic clock)."""
    grants: dict[int, tuple[float, float]] = {}  # token -> (asked, acquired)
    releases: dict[int, float] = {}
    for inc in soak.procs:
        if inc.role != "contender":
            continue
        asked: dict[int, float] = {}
        for r in read_jsonl(inc.log):
            if r["event"] == "ask":
                asked[r["seq"]] = r["t"]
            elif r["event"] == "acquired":
                grants[r["token"]] = (asked[r["seq"]], r["t"])
            elif r["event"] == "releasing":
                releases[r["token"]] = r["t"]
    return [
        (released, (grants[token + 1][1] - released) * 1000)
        for token, released in releases.items()
        if token + 1 in grants and grants[token + 1][0] < released
    ]


def slowest_handoffs(soak: Soak, handoffs: list[tuple[float, float]]) -> list[str]:
    """The five slowest hand-offs, each with the fault injected last before its release."""
    described = []
    for released, ms in sorted(handoffs, key=lambda h: -h[1])[:5]:
        before = [f for f in soak.faults if f.t <= released]
        cause = (
            f"{released - before[-1].t:.1f} s after {before[-1].kind}" if before else "no fault yet"
        )
        described.append(f"{ms:.0f} ms ({cause})")
    return described


def check_rl(
    results: dict[str, Any], ledger: dict[str, list[dict[str, Any]]]
) -> tuple[dict[str, Any], list[str]]:
    """Every epoch applied exactly once, from the results, the checkpoints and the logs."""
    report: dict[str, Any] = {}
    problems: list[str] = []
    for job, result in results.items():
        if isinstance(result, BaseException):
            problems.append(f"RL job {job} did not complete: {type(result).__name__}: {result}")
            report[job] = {"error": str(result)}
            continue
        n = result.epochs_done
        entry: dict[str, Any] = {
            "epochs": n,
            "rewinds": result.rewinds,
            "redone_epochs": result.redone_epochs,
            "train_steps_applied": sum(1 for r in ledger.get(job, []) if r["event"] == "apply"),
        }
        report[job] = entry
        if n < 1:
            problems.append(f"RL job {job} made no progress")
        ckpt = result.last_checkpoint
        if ckpt is None or ckpt.epochs_done != n:
            problems.append(f"RL job {job}: final checkpoint {ckpt} is not after its {n} epochs")
        else:
            ledger_file = Path(ckpt.path) / "rank-0" / "soak-ledger.json"
            applied = json.loads(ledger_file.read_text())["applied"]
            entry["checkpoint_ledger_ok"] = applied == list(range(n))
            if applied != list(range(n)):
                problems.append(
                    f"RL job {job}: the final state's ledger is not 0..{n - 1}: "
                    f"{len(applied)} steps, first wrong at "
                    f"{next((i for i, e in enumerate(applied) if e != i), len(applied))}"
                )
        epochs = [r.epoch for r in result.records]
        if epochs != list(range(n - len(epochs), n)):
            problems.append(f"RL job {job}: records not contiguous up to {n - 1}: {epochs}")
        applies = [r for r in ledger.get(job, []) if r["event"] == "apply"]
        bad = [r for r in applies if r["steps_before"] != r["epoch"]]
        entry["misapplied_steps"] = len(bad)
        for r in bad[:5]:
            problems.append(
                f"RL job {job}: {r['process']} trained epoch {r['epoch']} on a state of "
                f"{r['steps_before']} applied epochs"
            )
    return report, problems


def rl_tokens(results: dict[str, Any]) -> list[tuple[str, int]]:
    """(job, token) of the GPU phases the jobs' results still hold (recent epochs)."""
    return [
        (job, hold.token)
        for job, result in results.items()
        if not isinstance(result, BaseException)
        for record in result.records
        for hold in record.holds
        if hold.group_id == GROUP and hold.token is not None
    ]


# ---------------------------------------------------------------- the driver


def plan_faults(
    rng: random.Random, kinds: list[str], start: float, end: float, every: float
) -> list[tuple[float, str]]:
    """Fault times spread over [start, end] (one per slot, jittered); kinds in rounds, each
    round every kind once in a random order, so a short soak still sees every kind."""
    count = max(len(kinds), round((end - start) / every))
    width = (end - start) / count
    order: list[str] = []
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    return [(start + (i + rng.uniform(0.2, 0.8)) * width, order[i]) for i in range(count)]


def run(args: argparse.Namespace) -> int:
    from timeslice.cli.stack import Stack

    out: Path = args.out
    logs = out / "logs"
    if logs.exists() and any(logs.iterdir()):
        raise SystemExit(f"error: {out} already holds a soak's logs; pick another --out")
    logs.mkdir(parents=True, exist_ok=True)
    # The job processes load the soak's workload by module name, and it logs where we read.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ["TIMESLICE_SOAK_LOG_DIR"] = str(logs)
    kinds = [
        k for k in FAULT_KINDS if k in args.faults and (k not in RL_FAULT_KINDS or args.rl_jobs)
    ]
    rng = random.Random(args.seed)
    started_wall = datetime.now(UTC)
    t_begin = time.monotonic()
    # Server log, control worker's and job processes' logs in logs/; the database beside them.
    stack = Stack(logs, db=out / "temporal.db", cli_args=VERBOSE).start()
    settings = Settings(
        address=stack.address, out=out, logs=logs, seed=args.seed, contenders=args.contenders,
        rl_jobs=args.rl_jobs, ttl=args.ttl, rl_ttl=args.rl_ttl,
        acquire_timeout=args.acquire_timeout, hold_min=args.hold_min, hold_max=args.hold_max,
        pause_max=args.pause_max, stop_file=logs / "stop", checkpoints=out / "checkpoints",
        fault_kinds=tuple(kinds),
    )  # fmt: skip
    soak = Soak(settings, stack)
    status: Any = None
    results: dict[str, Any] = {}
    hung: list[str] = []
    try:
        from concurrent.futures import ThreadPoolExecutor

        from timeslice import TimeSliceOrchestratorClient

        # Every process starts at once (each takes seconds to import and connect on a loaded
        # machine); the contenders wait for the start line, sent once the group is set up.
        jobs = [f"j{i}" for i in range(args.rl_jobs)]
        for i in range(args.contenders):
            soak.start_contender(f"c{i}", gated=True)
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(soak.start_worker)]
            if jobs:
                starting.append(pool.submit(soak.start_rl_processes, *jobs))
            for future in starting:
                future.result()

        from timeslice.protocol.group import MAX_HISTORY_KEEP

        with TimeSliceOrchestratorClient(target=stack.address) as client:
            # A killed waiter is found when its grant goes unconfirmed: bounded by this.
            client.create_group(
                GROUP,
                default_ttl_s=args.ttl,
                grant_ack_timeout_s=args.ttl,
                history_keep=MAX_HISTORY_KEEP,  # the most a group carries
            )
        history = LeaseHistory(stack.address, args.progress_every)
        history.start()
        start_rl_jobs(stack.address, jobs, args.rl_ttl, args.seed)
        ready_by = time.monotonic() + 120
        while not all(
            inc.tail is not None and inc.tail.poll() is not None and inc.tail.count["ready"]
            for inc in soak.live("contender")
        ):
            soak.check_crashes()
            if time.monotonic() > ready_by:
                raise SystemExit("error: the contenders did not get ready within 120 s")
            time.sleep(0.05)  # waiting for processes to start up
        soak.go()
        t0 = time.monotonic()
        setup_s = t0 - t_begin
        print(
            f"soak: {args.contenders} contenders, {args.rl_jobs} RL jobs on group {GROUP!r} at "
            f"{stack.address}, {args.duration:g} s, seed {args.seed} (set up in {setup_s:.1f} s)",
            flush=True,
        )
        # Faults start once work is under way and stop early enough for the last to settle.
        warmup = min(5.0, args.duration / 10)
        settle = min(12.0, args.duration / 5)
        plan = plan_faults(rng, kinds, warmup, args.duration - settle, args.fault_every)
        owed: list[str] = []
        next_progress = args.progress_every

        def idle_until(at: float) -> None:
            """Watch the processes (crashes, progress lines) until ``at`` s into the soak."""
            nonlocal next_progress
            while True:
                now = time.monotonic() - t0
                soak.check_crashes()
                # Also when the schedule is behind (a fault that took longer than its slot):
                # the progress line still comes every --progress-every seconds.
                if now >= next_progress:
                    progress(soak, now)
                    while next_progress <= now:  # one line, also after a long fault
                        next_progress += args.progress_every
                if now >= at:
                    return
                time.sleep(min(0.1, at - now))  # the fault schedule's clock

        def strike(planned: str) -> Fault | None:
            fault = soak.inject(planned, rng, patience=min(10.0, args.fault_every))
            if fault is not None:
                soak.faults.append(fault)
                print(f"  [{time.monotonic() - t0:6.1f} s] {fault.kind}: {fault.target} "
                      f"{fault.detail}", flush=True)  # fmt: skip
            return fault

        for at, kind in plan:
            idle_until(at)
            # A kind that missed its slot (no holder, no waiter right then) is owed first.
            planned = owed.pop(0) if owed else kind
            if planned != kind:
                owed.append(kind)
            fault = strike(planned)
            if fault is None or fault.kind != planned:
                owed.insert(0, planned)
        end = args.duration
        if args.every_kind_within:
            # On a loaded machine a kind can miss every slot (no holder or waiter to be found
            # while a restarted server or worker catches up): keep owing it a slot every
            # --fault-every seconds, for up to --every-kind-within more seconds, then settle.
            give_up = time.monotonic() - t0 + args.every_kind_within
            while missing := [k for k in kinds if all(f.kind != k for f in soak.faults)]:
                at = time.monotonic() - t0 + args.fault_every
                if at > give_up:
                    break
                idle_until(at)
                strike(missing[0])
            end = max(end, time.monotonic() - t0 + settle)
        idle_until(end)
        t_end = time.monotonic()
        print("  stopping: contenders finish their request, RL jobs their epoch ...", flush=True)
        settings.stop_file.touch()
        drain_by = time.monotonic() + args.drain_timeout
        results = stop_rl_jobs(stack.address, jobs, drain_by)
        for inc in soak.live("contender"):
            try:
                inc.proc.wait(timeout=max(1.0, drain_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Still inside a request after the drain time-out: that request is lost.
                hung.append(f"contender {inc.label}")
                inc.proc.kill()
                inc.proc.wait()
            inc.ended_at = time.monotonic()
            inc.exit_code = inc.proc.returncode
            if inc.exit_code != 0 and f"contender {inc.label}" not in hung:
                soak.crashes.append({"process": f"contender {inc.label}",
                                     "exit_code": inc.exit_code, "stderr_tail": ""})  # fmt: skip
        status = history.stop()
    finally:
        for inc in soak.procs:
            if inc.ended_at is None:
                stack.stop(inc.proc)
                inc.ended_at = time.monotonic()
        stack.close()
    drain_s = time.monotonic() - t_end
    report = analyse(soak, results, status, history.records, hung)
    report.update(
        {
            "date": started_wall.strftime("%Y-%m-%d"),
            "started": started_wall.isoformat(timespec="seconds"),
            "machine": machine(),
            "command": " ".join([Path(sys.executable).name, "bench/soak.py", *sys.argv[1:]]),
            "config": {
                "duration_s": args.duration, "seed": args.seed, "contenders": args.contenders,
                "rl_jobs": args.rl_jobs, "contender_ttl_s": args.ttl, "rl_lease_ttl_s": args.rl_ttl,
                "grant_ack_timeout_s": args.ttl, "acquire_timeout_s": args.acquire_timeout,
                "hold_s": [args.hold_min, args.hold_max], "pause_max_s": args.pause_max,
                "fault_every_s": args.fault_every, "fault_kinds": kinds,
                "rl_phases_s": RL_PHASES,
            },
            "setup_s": round(setup_s, 1),
            "soak_s": round(t_end - t0, 1),
            "drain_s": round(drain_s, 1),
            "faults_owed": owed,
            "server_down_s": round(sum(up - down for down, up in soak.server_down), 1),
        }
    )  # fmt: skip
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    print(f"written: {out / 'soak.json'} (logs under {logs})")
    return 0 if report["passed"] else 1


def progress(soak: Soak, now: float) -> None:
    """One line: what the logs say so far (train steps count redone epochs too)."""
    holds = phases = 0
    steps: Counter[str] = Counter()
    for inc in soak.procs:
        if inc.tail is None:
            continue
        inc.tail.poll()
        if inc.role == "contender":
            holds += inc.tail.count["releasing"]
        else:
            phases += inc.tail.count["phase_end"]
            steps[inc.name] += inc.tail.count["apply"]
    faults = Counter(f.kind for f in soak.faults)
    by_kind = ", ".join(f"{k} {v}" for k, v in sorted(faults.items()))
    print(
        f"  [{now:6.1f} s] contender holds {holds}, RL GPU phases {phases}, train steps "
        f"{' '.join(f'{k}={v}' for k, v in sorted(steps.items())) or '-'}; faults "
        f"{sum(faults.values())} ({by_kind or '-'}); crashes {len(soak.crashes)}",
        flush=True,
    )


def analyse(
    soak: Soak,
    results: dict[str, Any],
    status: Any,
    leases: dict[int, Any],
    hung: list[str],
) -> dict[str, Any]:
    c_holds, requests = contender_holds(soak)
    grants_lost, unclaimed, misattributed = check_grants(soak, leases, c_holds)
    requests["granted_twice"] += misattributed
    r_holds, ledger = rl_holds(soak)
    found = overlaps(c_holds + r_holds)
    rl_report, rl_problems = check_rl(results, ledger)
    # Tokens the contenders saw must not show up in an RL job's phases (the results keep the
    # recent epochs' tokens), nor one RL job's in another's.
    owner: dict[int, str] = {h.token: f"contender {h.job}" for h in c_holds if h.token}
    for job, token in rl_tokens(results):
        seen = owner.setdefault(token, f"rl {job}")
        if seen != f"rl {job}":
            requests["granted_twice"].append(f"token {token} granted to {seen} and rl {job}")
        if token in leases and leases[token].job_id != job:
            requests["granted_twice"].append(
                f"token {token}: used by rl {job}, granted by the group to {leases[token].job_id}"
            )
    timed = handoffs_ms(soak)
    handoffs = [ms for _, ms in timed]
    lost = requests["lost"] + grants_lost + [f"{h}: hung at the end, killed" for h in hung]
    faults = Counter(f.kind for f in soak.faults)
    kinds = soak_kinds(soak)
    problems = []
    if found:
        problems.append(f"{len(found)} overlapping holds")
    if lost:
        problems.append(f"{len(lost)} lost requests")
    if requests["granted_twice"]:
        problems.append(f"{len(requests['granted_twice'])} requests granted twice")
    problems += rl_problems
    if soak.crashes:
        problems.append(f"{len(soak.crashes)} processes exited on their own")
    missing = [k for k in kinds if not faults[k]]
    if missing:
        problems.append(f"fault kinds never injected: {', '.join(missing)}")
    stats = None
    if status is not None:
        s = status.stats
        stats = {
            "leases": s.leases, "released": s.released, "expired": s.expired,
            "dead_waiters": s.dead_waiters, "timed_out": s.timed_out, "cancelled": s.cancelled,
            "rejected": s.rejected, "stale_messages": s.stale_messages,
            "forged_messages": s.forged_messages, "departed": s.departed, "runs": s.runs,
            "held": round(status.held_share, 3),  # lease share (docs/report.md, "Utilization")
        }  # fmt: skip
    return {
        "passed": not problems,
        "problems": problems,
        "holds": {
            "total": len(c_holds) + len(r_holds),
            "contender": len(c_holds),
            "rl_gpu_phases": len(r_holds),
            "by_end": dict(Counter(h.how for h in c_holds + r_holds)),
        },
        "faults": {"total": sum(faults.values()), "by_kind": dict(sorted(faults.items()))},
        "fault_log": [
            {
                "kind": f.kind,
                "planned": f.planned,
                "wall": datetime.fromtimestamp(f.wall, UTC).isoformat(timespec="milliseconds"),
                "target": f.target,
                "detail": f.detail,
                "took_s": round(f.took_s, 2),
            }
            for f in soak.faults
        ],
        "overlaps": len(found),
        "overlap_details": found[:20],
        "lost": len(lost),
        "lost_details": lost[:20],
        "granted_twice": len(requests["granted_twice"]),
        "granted_twice_details": requests["granted_twice"][:20],
        "requests": requests["outcomes"],
        "unclaimed_grants": dict(unclaimed),
        "group_lease_records": len(leases),
        "request_errors_by_type": requests["errors_by_type"],
        "handoff": {
            "count": len(handoffs),
            "p50_ms": round(statistics.median(handoffs), 1) if handoffs else None,
            "p99_ms": round(percentile(handoffs, 0.99), 1) if handoffs else None,
            "max_ms": round(max(handoffs), 1) if handoffs else None,
            "slowest": slowest_handoffs(soak, timed),
        },
        "rl_jobs": rl_report,
        "rl_epochs_exactly_once": not rl_problems and bool(rl_report),
        "crashes": soak.crashes,
        "group_stats": stats,
    }


def soak_kinds(soak: Soak) -> list[str]:
    return list(soak.settings.fault_kinds)


def summary(r: dict[str, Any]) -> str:
    h, ho = r["holds"], r["handoff"]
    lines = [
        "",
        f"Soak with faults — {r['date']}, {r['machine']}",
        f"  {r['command']}",
        f"  soaked {r['soak_s']} s (set-up {r['setup_s']} s, drain {r['drain_s']} s)",
        f"  holds: {h['total']} ({h['contender']} by contenders, {h['rl_gpu_phases']} RL GPU "
        f"phases); ended: {', '.join(f'{k} {v}' for k, v in sorted(h['by_end'].items()))}",
        f"  faults: {r['faults']['total']} — "
        + ", ".join(f"{k} {v}" for k, v in r["faults"]["by_kind"].items()),
        f"  requests: {', '.join(f'{k} {v}' for k, v in sorted(r['requests'].items()))}",
        f"  overlaps: {r['overlaps']}   lost: {r['lost']}   granted twice: {r['granted_twice']}",
        f"  hand-off under faults ({ho['count']}): p50 {ho['p50_ms']} ms, p99 {ho['p99_ms']} ms, "
        f"max {ho['max_ms']} ms",
        f"    slowest: {'; '.join(ho['slowest']) or '-'}",
    ]
    for job, entry in r["rl_jobs"].items():
        if "error" in entry:
            lines.append(f"  RL job {job}: {entry['error']}")
            continue
        lines.append(
            f"  RL job {job}: {entry['epochs']} epochs, each applied once: "
            f"{entry.get('checkpoint_ledger_ok')} (rewinds {entry['rewinds']}, redone "
            f"{entry['redone_epochs']}, train steps run {entry['train_steps_applied']})"
        )
    if r["group_stats"]:
        g = r["group_stats"]
        lines.append(
            f"  group: {g['leases']} leases, {g['expired']} expired, {g['dead_waiters']} dead "
            f"waiters, {g['timed_out']} timed out, {g['runs']} runs, held {g['held']:.0%} of "
            "its life"
        )
    lines.append("  PASSED" if r["passed"] else "  FAILED: " + "; ".join(r["problems"]))
    return "\n".join(lines)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


# ---------------------------------------------------------------- command line


def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value

    return parse


def kinds_list(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown fault kind(s) {unknown or text!r}; known: {', '.join(FAULT_KINDS)}"
        )
    return kinds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="Checks and figures: see the module docstring (bench/soak.py).",
    )
    p.add_argument(
        "--duration",
        type=positive(float),
        default=60.0,
        help="seconds of load and faults, set-up and drain not counted (>= 20)",
    )
    p.add_argument("--seed", type=int, default=1, help="fault times, kinds and victims")
    p.add_argument("--contenders", type=int, default=4, help="client processes (>= 2)")
    p.add_argument("--rl-jobs", type=int, default=2, help="RL jobs (>= 0)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(".timeslice/soak"),
        help="server database, logs and soak.json (must hold no earlier soak's logs)",
    )
    p.add_argument(
        "--fault-every", type=positive(float), default=8.0, help="mean seconds between faults"
    )
    p.add_argument(
        "--every-kind-within",
        type=positive(float),
        default=None,
        metavar="S",
        help="after the planned faults, keep trying each kind that has not struck yet (one "
        "try every --fault-every s) for up to S more seconds; the soak then runs its settle time "
        "past the last fault (default: planned slots only)",
    )
    p.add_argument(
        "--faults",
        type=kinds_list,
        default=list(FAULT_KINDS),
        help=f"comma-separated kinds to inject (default all: {','.join(FAULT_KINDS)})",
    )
    p.add_argument(
        "--ttl",
        type=positive(float),
        default=5.0,
        help="contenders' lease TTL and the group's grant confirmation time-out",
    )
    p.add_argument("--rl-ttl", type=positive(float), default=10.0, help="RL jobs' lease TTL")
    p.add_argument(
        "--acquire-timeout",
        type=positive(float),
        default=20.0,
        help="contenders give up a request after this long",
    )
    p.add_argument(
        "--hold-min",
        type=positive(float),
        default=0.05,
        help="contenders hold the group at least this long",
    )
    p.add_argument("--hold-max", type=positive(float), default=0.4, help="and at most this long")
    p.add_argument(
        "--pause-max",
        type=positive(float),
        default=0.4,
        help="contenders' CPU time between holds, at most",
    )
    p.add_argument(
        "--progress-every",
        type=positive(float),
        default=10.0,
        help="seconds between progress lines (and polls of the group's lease records)",
    )
    p.add_argument(
        "--drain-timeout",
        type=positive(float),
        default=90.0,
        help="how long the end may take: contenders' last request, RL jobs' stop",
    )
    # The contender processes are this file again.
    p.add_argument(
        "--role", choices=["driver", "contender"], default="driver", help=argparse.SUPPRESS
    )
    p.add_argument("--wait-go", action="store_true", help=argparse.SUPPRESS)
    for name in ("--address", "--group", "--job-id", "--log", "--stop-file"):
        p.add_argument(name, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.role == "contender":
        run_contender(args)
        return 0
    if args.duration < 20:
        p.error("--duration must be >= 20 s: faults need room to strike and settle")
    if args.contenders < 2:
        p.error("--contenders must be >= 2: killing a waiter needs someone waiting")
    if args.rl_jobs < 0:
        p.error("--rl-jobs must be >= 0")
    if args.hold_min > args.hold_max:
        p.error("--hold-min must not exceed --hold-max")
    if args.ttl < 1 or args.rl_ttl < 1:
        p.error("--ttl and --rl-ttl must be >= 1 s (the group's smallest lease TTL)")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} exists and is not a directory")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".writable"
        probe.touch()
        probe.unlink()
    except OSError as err:
        p.error(f"--out {args.out} is not writable: {err}")
    from timeslice.cli.server import temporal_binary
    from timeslice.errors import TimesliceError

    try:
        temporal_binary()
    except TimesliceError as err:
        p.error(str(err))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
