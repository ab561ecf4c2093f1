"""Time-slice a Hugging Face TRL ``GRPOTrainer`` with one added line.

.. code-block:: python

    from timeslice.integrations.trl import time_slice

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    time_slice(trainer, group="gpus-0")  # the added line
    trainer.train()

What it does to the trainer it is given (nothing of TRL is copied; the trainer's class is
untouched, only this instance is wrapped):

* **generation** (``GRPOTrainer._generate``: the rollouts, vLLM's weight sync included) runs
  under a lease of the *sampler* group;
* the reference and old-policy **scoring** passes and the **optimisation** — from
  ``compute_loss`` (a public ``Trainer`` method) through backward, gradient clipping and the
  optimizer step — run under a lease of the *trainer* group (one group serves both by default);
* the **rewards** (``GRPOTrainer._calculate_rewards``) run with no lease when every reward
  function is plain Python, so another job uses the device meanwhile; a reward *model* is
  device state like the others and keeps the trainer lease;
* the policy, the reference model, reward models and the optimizer's state (registered after
  the first step, when the optimizer has created it) are registered with a
  :class:`~timeslice.snapshot.torch_backend.TorchBackend`, so the group moves them to host
  memory when another job takes the device, and back before this job's next phase — the same
  tensor objects, bit for bit. With a PEFT model only the trainable (LoRA) parameters and the
  optimizer state move: the frozen base stays on the device;
* a job alternates two kinds of GPU work, as an RL job alternates ``sample`` and ``train``:
  *rollout* (generation, then its scoring) and *optimisation* (the optimizer steps on one
  generation's completions, or an evaluation). Within one kind the lease stays from phase to
  phase; where one kind follows the other on the same group (the last optimizer step → the
  next generation) the job asks the group to carry its lease into the coming phase, saying how
  long that kind of work took it lately (the median of its last few). The group decides by its
  grant policy, as for any holder (kept when nobody waits; under ``phase_aware`` past a waiter
  within its bounds), and the job goes on under the same lease or acquires again. The lease is
  released when the job has CPU work to do (rewards) or the next phase is on another group;
* ``train()`` ends by bringing the state home (if it was away) and leaving the group, so the
  trained model is usable after it (so does an ``evaluate()`` outside training).

Three of the methods wrapped are private (``_generate``,
``_get_per_token_logps_and_entropies`` and ``_calculate_rewards``; TRL has no public hook at
those points), so this module accepts only the TRL releases it was tested with
(:data:`TRL_REQUIREMENT`, pinned by the ``trl`` extra) and raises
:class:`UnsupportedTRLError` at import for any other.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: The TRL releases whose GRPOTrainer internals this module was tested against; the ``trl``
#: extra in pyproject.toml pins the same range.
TRL_SPECIFIER = ">=1.16,<1.17"
TRL_REQUIREMENT = f"trl{TRL_SPECIFIER}"
#: The private methods wrapped, and the parameters each must take (checked at attach time).
WRAPPED_METHODS: dict[str, tuple[str, ...]] = {
    "_generate": ("prompts",),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask"),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
}

log = logging.getLogger("timeslice.integrations.trl")
#: The runs of one kind of work whose median is the expected length of the next (the group's
#: grant policy is told it where one kind follows the other).
MEASURED_PHASES = 5
#: Phases of the optimisation kind; every other phase (generate, score, rewards on a reward
#: model) is rollout.
OPTIMISATION_PHASES = frozenset({"train", "eval"})


def _kind(phase: str) -> str:
    return "optimisation" if phase in OPTIMISATION_PHASES else "rollout"


class UnsupportedTRLError(ImportError):
    """The installed TRL is outside the releases this integration was tested with."""


def check_trl_version(version: str) -> None:
    """Raise :class:`UnsupportedTRLError` unless ``version`` is in :data:`TRL_SPECIFIER`."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    if parsed is None or parsed not in SpecifierSet(TRL_SPECIFIER):
        raise UnsupportedTRLError(
            f"timeslice.integrations.trl supports TRL {TRL_SPECIFIER} (it wraps GRPOTrainer "
            f"methods that are not public API, checked on those releases only); this "
            f"environment has trl {version}. Install a supported one: "
            f"pip install 'timeslice[trl]' (or '{TRL_REQUIREMENT}')"
        )


def _installed_trl() -> str:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError(
            "timeslice.integrations.trl needs TRL: pip install 'timeslice[trl]'"
        ) from err


# The version is read from the installed distribution before TRL itself is imported, so an
# unsupported release is refused with this message even where it would not import at all.
TRL_VERSION = _installed_trl()
check_trl_version(TRL_VERSION)

import torch  # noqa: E402  (after the version gate, on purpose)
from timeslice.errors import LeaseRevokedError  # noqa: E402
from timeslice.orchestrator import TimeSliceOrchestratorClient  # noqa: E402
from timeslice.protocol.group import SnapshotReport  # noqa: E402
from timeslice.session.lease import Lease  # noqa: E402
from timeslice.snapshot.base import Capability, Health, SnapshotRequest  # noqa: E402
from timeslice.snapshot.torch_backend import TorchBackend  # noqa: E402
from transformers import TrainerCallback, TrainerControl, TrainerState  # noqa: E402
from transformers import TrainingArguments as _TrainingArguments  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

__all__ = [
    "TRL_REQUIREMENT",
    "TRL_SPECIFIER",
    "GRPOTimeSlicing",
    "PhaseRecord",
    "UnsupportedTRLError",
    "check_trl_version",
    "time_slice",
]


@dataclass(frozen=True)
class PhaseRecord:
    """One phase as this process timed it (``time.monotonic()``, shared by all processes of a
    machine), with the lease it ran under."""

    phase: str  # "generate", "score", "rewards" (reward models only), "train", "eval"
    group_id: str
    token: int
    step: int  # the trainer's global step when the phase began
    start: float
    end: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _CountingBackend:
    """The torch backend, counting the moves the groups ask of it (for reports and tests)."""

    name = "torch"
    # The client is told the state's size itself (state_bytes=): none is declared here.
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self, inner: TorchBackend) -> None:
        self.inner = inner
        self.snapshots = 0
        self.restores = 0
        self.bytes_moved = 0
        # Set when training is over and the job leaves its groups: the state stays where it is
        # (the trained model is used after train()), as it would with the process gone.
        self.staying = False

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        if self.staying:
            return SnapshotReport(
                job_id=request.job_id, backend=self.name, mode="offload", bytes=0, seconds=0.0
            )
        report = await self.inner.snapshot(request)
        self.snapshots += 1
        self.bytes_moved += report.bytes
        return report

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        report = await self.inner.restore(request)
        self.restores += 1
        self.bytes_moved += report.bytes
        return report

    def health(self) -> Health:
        return self.inner.health()


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    # accelerate wraps the optimizer; its state lives on the wrapped torch optimizer.
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _check_wrappable(trainer: GRPOTrainer) -> None:
    """The wrapped private methods must exist and take the parameters they are called with."""
    problems = []
    for name, params in WRAPPED_METHODS.items():
        method = getattr(trainer, name, None)
        if not callable(method):
            problems.append(f"GRPOTrainer.{name} is missing")
            continue
        accepted = set(inspect.signature(method).parameters)
        missing = [p for p in params if p not in accepted]
        if missing:
            problems.append(f"GRPOTrainer.{name} lacks parameter(s) {missing}")
    if problems:
        raise UnsupportedTRLError(
            f"this TRL ({TRL_VERSION}) does not have the GRPOTrainer internals "
            f"timeslice.integrations.trl wraps: {'; '.join(problems)}. "
            f"Install {TRL_REQUIREMENT!r}"
        )


class GRPOTimeSlicing:
    """The time-slicing attached to one ``GRPOTrainer`` (made by :func:`time_slice`).

    ``phases`` lists every GPU phase this process ran, with its lease; ``backend`` is the
    torch backend holding the registered state; ``snapshots`` / ``restores`` count how often
    the groups moved it.
    """

    def __init__(
        self,
        trainer: GRPOTrainer,
        *,
        sampler_group: str,
        trainer_group: str,
        timeout: float | None,
        lora_only: bool | None,
        client_options: dict[str, Any],
    ) -> None:
        if not isinstance(trainer, GRPOTrainer):
            raise TypeError(f"time_slice needs a trl.GRPOTrainer, not {type(trainer).__name__}")
        _check_wrappable(trainer)
        if sampler_group != trainer_group and not (
            getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", "") == "server"
        ):
            raise ValueError(
                f"sampler group {sampler_group!r} differs from trainer group {trainer_group!r}, "
                "but this trainer generates in its own process, with the policy on the trainer's "
                "device: give one group (group=...), or generate on a separate pool of devices "
                "with TRL's vLLM server mode (use_vllm=True, vllm_mode='server')"
            )
        self.trainer = trainer
        self.sampler_group = sampler_group
        self.trainer_group = trainer_group
        self.timeout = timeout
        self.phases: list[PhaseRecord] = []
        self._reported = 0  # phases up to here went to their group with a release
        # Where one kind of work follows the other on one group: the lease kept, or handed on.
        self.kept_at_boundaries = 0
        self.yielded_at_boundaries = 0
        self._client_options = dict(client_options)
        self._lease: Lease | None = None
        self._lease_kind: str | None = None  # the kind of work last begun under it
        self._open: tuple[str, str, int, int, float] | None = None  # phase, group, token, step, t
        self._optimizer_registered = False
        self._finished = False

        model = trainer.model
        self.lora_only = _is_peft(model) if lora_only is None else lora_only
        reward_models = [f for f in trainer.reward_funcs if isinstance(f, torch.nn.Module)]
        self._reward_models_on_device = bool(reward_models)
        include = None
        if self.lora_only:
            # Only what training changes moves; the frozen base stays on the device.
            include = [f"policy.{n}" for n, p in model.named_parameters() if p.requires_grad]
            include += ["optimizer.*"]
            if not include[:-1]:
                raise ValueError("lora_only: the policy has no trainable parameter")
        self.backend = TorchBackend(include=include)
        self.backend.register_module("policy", model)
        ref_model = getattr(trainer, "ref_model", None)
        if isinstance(ref_model, torch.nn.Module) and not self.lora_only:
            self.backend.register_module("reference", ref_model)
        if not self.lora_only:
            for i, reward_model in enumerate(reward_models):
                self.backend.register_module(f"reward.{i}", reward_model)
        self._counting = _CountingBackend(self.backend)
        self._connect_clients()
        self._attach()

    # ------------------------------------------------------------ public

    @property
    def snapshots(self) -> int:
        """Evictions of this trainer's state so far."""
        return self._counting.snapshots

    @property
    def restores(self) -> int:
        """Restores of its state so far."""
        return self._counting.restores

    @property
    def bytes_moved(self) -> int:
        """Bytes its evictions and restores moved, both ways summed."""
        return self._counting.bytes_moved

    @property
    def job_id(self) -> str:
        """The job id its leases carry (the client's)."""
        return self.client.job_id

    def finish(self) -> None:
        """End the current phase, bring the state home if a group had moved it out, and leave
        the groups (their queues forget this job). ``train()`` calls it when it returns."""
        self._end_phase()
        try:
            self._hold(self.trainer_group)  # a group restores this job's state before the grant
        finally:
            # The release may hand the group to a waiter, whose grant would evict this job
            # before the departure below reaches the group: nothing leaves any more.
            self._counting.staying = True
            self._release()
            self._await_eviction(self.trainer_group)
            for client in {id(c): c for c in self._clients.values()}.values():
                client.close()
            self._finished = True

    def _await_eviction(self, group: str, timeout: float = 30.0) -> None:
        """Wait until ``group`` no longer needs this process: a waiter granted on the release
        above first has the group evict this job (a no-op now), and a process that closed
        before answering would leave the group waiting for the answer until its snapshot
        time-out. Nothing to wait for when nobody takes the group (this job stays resident
        until its departure)."""
        client = self._clients[group]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = client.group_status(group)
            if status.resident_job != self.job_id or (status.holder is None and not status.queue):
                return
            time.sleep(0.05)  # a status query a tick: only at the end of training
        log.warning("group %s still counts %s resident after %.0f s", group, self.job_id, timeout)

    def detach(self) -> None:
        """Undo :func:`time_slice`: finish, and give the trainer its own methods back."""
        if not self._finished:
            self.finish()
        for name in (*WRAPPED_METHODS, "compute_loss", "train", "evaluate"):
            self.trainer.__dict__.pop(name, None)
        self.trainer.remove_callback(self._callback)

    def __enter__(self) -> GRPOTimeSlicing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ------------------------------------------------------------ leases and phases

    def _connect_clients(self) -> None:
        self.client = self._make_client(with_state=True)
        # The sampler group of a vLLM server holds no state of this process: the server's own
        # memory is its business (its node agent or its own sleep mode).
        sampler = (
            self.client
            if self.sampler_group == self.trainer_group
            else self._make_client(with_state=False)
        )
        self._clients = {self.trainer_group: self.client, self.sampler_group: sampler}

    def _make_client(self, *, with_state: bool) -> TimeSliceOrchestratorClient:
        options = dict(self._client_options)
        if not with_state:
            base = options.get("job_id")
            options["job_id"] = None if base is None else f"{base}-sampler"
        return TimeSliceOrchestratorClient(
            snapshot_backends=[self._counting] if with_state else None,
            **options,
        )

    def _hold(self, group: str, phase: str | None = None) -> Lease:
        """A lease on ``group`` for ``phase``: the one held if it is that group's and either
        ``phase`` continues the kind of work it ran (or is None, as at the end of training) or
        the group carries it into ``phase``; else a new one (the other group's lease is
        released first, so a job never holds one group while waiting for another)."""
        if self._finished:
            self._connect_clients()  # train() again after a finished run: the old ones left
            self._counting.staying = False
            self._finished = False
        if self._lease is not None:
            if self._lease.group_id == group and self._kept_for(phase):
                return self._lease
            self._release()
        self._lease = self._clients[group].acquire(group, timeout=self.timeout)
        self._lease_kind = None if phase is None else _kind(phase)
        return self._lease

    def _kept_for(self, phase: str | None) -> bool:
        """Whether the held lease goes on into ``phase`` (next on the same group): at once if
        it continues the kind of work the lease ran (or is None), else if the group carries
        it; if not, the lease is released and the group hands it on."""
        lease = self._lease
        assert lease is not None
        if phase is None or _kind(phase) == self._lease_kind:
            return True
        try:
            kept = self._clients[lease.group_id].release(
                lease,
                next_phase=phase,
                expected_s=self.expected_s(phase),
                phases=self._phases_to_report(lease),
            )
        except LeaseRevokedError as err:
            log.warning("%s; acquiring again for %s", err, phase)
            kept = False
        if kept:
            self.kept_at_boundaries += 1
            self._lease_kind = _kind(phase)
        else:
            self._lease = None
            self.yielded_at_boundaries += 1
        return kept

    def expected_s(self, phase: str) -> float | None:
        """How long the work ``phase`` begins is expected to take: the median of this job's
        last ``MEASURED_PHASES`` runs of that kind of phases, back to back, first start to last
        end (None before the first)."""
        kind = _kind(phase)
        runs: list[tuple[str, float, float]] = []  # kind, start, end
        for record in self.phases:
            this = _kind(record.phase)
            if runs and runs[-1][0] == this:
                runs[-1] = (this, runs[-1][1], record.end)
            else:
                runs.append((this, record.start, record.end))
        recent = sorted([end - start for k, start, end in runs if k == kind][-MEASURED_PHASES:])
        if not recent:
            return None
        middle = len(recent) // 2
        return (recent[middle] + recent[(len(recent) - 1) // 2]) / 2

    def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self._clients[lease.group_id].release(lease, phases=self._phases_to_report(lease))

    def _phases_to_report(self, lease: Lease) -> list[tuple[float, float]]:
        """The phases run under ``lease`` since its last release: what this release reports,
        so the group (and `timeslice report`) knows the lease's phase time from its overhead."""
        new, self._reported = self.phases[self._reported :], len(self.phases)
        return [
            (r.start, r.end) for r in new if r.token == lease.token and r.group_id == lease.group_id
        ]

    def _begin(self, phase: str, group: str) -> None:
        if self._open is not None and self._open[:2] == (phase, group):
            return
        self._end_phase()
        lease = self._hold(group, phase)
        self._open = (phase, group, lease.token, self.trainer.state.global_step, time.monotonic())

    def _end_phase(self) -> None:
        if self._open is None:
            return
        phase, group, token, step, start = self._open
        self._open = None
        self.phases.append(PhaseRecord(phase, group, token, step, start, time.monotonic()))

    @contextmanager
    def _phase(self, phase: str, group: str) -> Iterator[None]:
        self._begin(phase, group)
        try:
            yield
        finally:
            self._end_phase()

    def _then_finish(
        self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``run(*args, **kwargs)``, then :meth:`finish`; a failure to finish after ``run``
        failed is logged, never raised over ``run``'s own exception."""
        try:
            result = run(*args, **kwargs)
        except BaseException:
            try:
                self.finish()
            except Exception as err:
                log.warning("leaving the groups after a failed run: %s", err)
            raise
        self.finish()
        return result

    def _register_optimizer(self) -> None:
        """Register the optimizer's state once it exists (optimizers create it in their first
        step), while this job holds the trainer lease, so the state is on the device."""
        if self._optimizer_registered:
            return
        optimizer = _torch_optimizer(self.trainer.optimizer)
        if optimizer is None or not optimizer.state:
            return
        self.backend.register_optimizer("optimizer", optimizer)
        self._optimizer_registered = True
        # Everything is registered now: the host buffers are made while this step's lease
        # still holds, not at the first switch.
        self.backend.reserve_host_buffers()

    # ------------------------------------------------------------ wrapping

    def _attach(self) -> None:
        trainer = self.trainer
        generate = trainer._generate
        logps = trainer._get_per_token_logps_and_entropies
        rewards = trainer._calculate_rewards
        compute_loss = trainer.compute_loss
        train = trainer.train
        evaluate = trainer.evaluate

        @functools.wraps(generate)
        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            with self._phase("generate", self.sampler_group):
                return generate(*args, **kwargs)

        @functools.wraps(logps)
        def timed_logps(*args: Any, **kwargs: Any) -> Any:
            if self._open is not None and self._open[0] in ("train", "eval"):
                return logps(*args, **kwargs)  # the loss's own forward pass, already leased
            with self._phase("score", self.trainer_group):
                return logps(*args, **kwargs)

        @functools.wraps(rewards)
        def timed_rewards(*args: Any, **kwargs: Any) -> Any:
            if self._reward_models_on_device:
                with self._phase("rewards", self.trainer_group):
                    return rewards(*args, **kwargs)
            self._end_phase()
            self._release()  # CPU work: the device is free for another job meanwhile
            return rewards(*args, **kwargs)

        @functools.wraps(compute_loss)
        def timed_compute_loss(*args: Any, **kwargs: Any) -> Any:
            # The phase runs on through backward and the optimizer step (until on_step_end).
            self._begin("train" if trainer.model.training else "eval", self.trainer_group)
            return compute_loss(*args, **kwargs)

        @functools.wraps(train)
        def timed_train(*args: Any, **kwargs: Any) -> Any:
            return self._then_finish(train, args, kwargs)

        @functools.wraps(evaluate)
        def timed_evaluate(*args: Any, **kwargs: Any) -> Any:
            if trainer.is_in_train:  # an evaluation inside train(): train() finishes
                return evaluate(*args, **kwargs)
            return self._then_finish(evaluate, args, kwargs)

        for name, wrapper in (
            ("_generate", timed_generate),
            ("_get_per_token_logps_and_entropies", timed_logps),
            ("_calculate_rewards", timed_rewards),
            ("compute_loss", timed_compute_loss),
            ("train", timed_train),
            ("evaluate", timed_evaluate),
        ):
            setattr(trainer, name, wrapper)
        self._callback = _StepCallback(self)
        trainer.add_callback(self._callback)


class _StepCallback(TrainerCallback):
    """Public Trainer hooks: the optimizer step's end closes the train phase."""

    def __init__(self, slicing: GRPOTimeSlicing) -> None:
        self.slicing = slicing

    def on_optimizer_step(
        self,
        args: _TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.slicing._register_optimizer()

    def on_step_end(
        self,
        args: _TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # The lease stays until the next phase asks the group to carry it on (same group), so
        # the log / save / evaluate that follow a step still find the state on the device.
        self.slicing._end_phase()


def time_slice(
    trainer: GRPOTrainer,
    group: str | None = None,
    *,
    sampler_group: str | None = None,
    trainer_group: str | None = None,
    timeout: float | None = None,
    lora_only: bool | None = None,
    **client_options: Any,
) -> GRPOTimeSlicing:
    """Time-slice ``trainer`` on a GPU group (see the module's doc for what runs where).

    ``group``: the group for every phase; or ``sampler_group`` / ``trainer_group`` apart
    (apart only where generation runs elsewhere: TRL's vLLM server mode). ``timeout``: give up
    an acquire after this many seconds (``AcquireTimeoutError``). ``lora_only``: move only the
    trainable parameters and the optimizer state (default: when the model is a PEFT model).
    ``client_options`` go to :class:`~timeslice.TimeSliceOrchestratorClient` (``target``,
    ``job_id``, ``priority``, ``lease_ttl``, ``namespace``, ...).
    """
    sampler = sampler_group or group or trainer_group
    trainer_g = trainer_group or group or sampler_group
    if sampler is None or trainer_g is None:
        raise ValueError("time_slice needs a group: group=... (or sampler_group / trainer_group)")
    if "snapshot_backends" in client_options or "group_id" in client_options:
        raise ValueError("time_slice sets snapshot_backends and group_id itself")
    return GRPOTimeSlicing(
        trainer,
        sampler_group=sampler,
        trainer_group=trainer_g,
        timeout=timeout,
        lora_only=lora_only,
        client_options=client_options,
    )
