"""The built-in workloads' options: each one's name, type, default, meaning and allowed values.

A job's ``workload_options`` parse as its workload's options class here. The module imports
neither torch nor JAX, so ``timeslice job start`` checks a job's options before anything starts
(and ``timeslice job options WORKLOAD`` prints them), while the job process parses the same
class and also checks what only its own host can tell (a CUDA device, vLLM: ``parse(...,
here=True)``). Your own workload may declare its options the same way (subclass
:class:`WorkloadOptions`, give each field :func:`option`, set ``options_type``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

from timeslice.snapshot.simulated import DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    import torch

TASKS = ("sort", "reverse", "copy")
STALE_OBJECTIVES = ("decoupled", "ppo")
DEVICES = ("cpu", "cuda", "auto")
SAMPLERS = ("auto", "torch", "vllm")


def option(default: Any, doc: str) -> Any:
    """A field of an options class: its default and what it means (``timeslice job options``
    prints it).

    Args:
        default: The value when the job does not set it.
        doc: What it does, and what it may be.

    Returns:
        The dataclass field.
    """
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class OptionInfo:
    """One option as ``timeslice job options`` prints it."""

    name: str
    type: str
    default: Any
    doc: str


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and args:
        return f"{_type_name(args[0])} or null"
    return getattr(hint, "__name__", str(hint))


def _accepts(hint: Any, value: Any) -> tuple[bool, Any]:
    """Whether ``value`` (from JSON) is of the field's type, and the value to keep (an int is
    taken for a float field; a bool never for a number)."""
    if isinstance(hint, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return True, None
        for member in typing.get_args(hint):
            if member is not type(None):
                ok, kept = _accepts(member, value)
                if ok:
                    return True, kept
        return False, value
    if hint is bool or isinstance(value, bool):
        return type(value) is hint, value
    if hint is int:
        return isinstance(value, int), value
    if hint is float:
        number = isinstance(value, int | float)
        return number, float(value) if number else value
    return isinstance(value, hint), value


def options_as(
    options_type: type[WorkloadOptions], workload: str, options: dict[str, Any] | None
) -> Any:
    """A job's ``workload_options`` as ``options_type``: an unknown name (with the closest
    known one), or a value of another type than the field's, is refused with a message naming
    the option.

    Args:
        options_type: The workload's options class.
        workload: Its name, for the messages.
        options: The job's ``workload_options``.

    Returns:
        An instance of ``options_type`` (not yet range-checked: ``WorkloadOptions.parse``).

    Raises:
        ValueError: An unknown option, or a value of the wrong type.
    """
    values = dict(options or {})
    hints = typing.get_type_hints(options_type)
    # The dataclass's fields proper: a ClassVar (the workload's name, say) is no option.
    fields = [f.name for f in dataclasses.fields(options_type)]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        guesses = [
            f"{name!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(name, fields, n=1, cutoff=0.6))
            else repr(name)
            for name in unknown
        ]
        raise ValueError(
            f"{workload}: unknown option(s) {', '.join(guesses)}; allowed: {sorted(fields)} "
            f"(`timeslice job options {workload}` says what each does)"
        )
    for key, value in values.items():
        ok, values[key] = _accepts(hints[key], value)
        if not ok:
            raise ValueError(
                f"{workload}: option {key!r} must be {_type_name(hints[key])}, "
                f"not {type(value).__name__} ({value!r})"
            )
    return options_type(**values)


@dataclass(frozen=True)
class WorkloadOptions:
    """The base of every options class: parsing, the range checks' helpers, the listing."""

    #: The workload's name, in the messages that refuse an option.
    workload: ClassVar[str] = "workload"

    @classmethod
    def parse(cls, options: dict[str, Any] | None, *, here: bool = True) -> Self:
        """The options from a job's ``workload_options``.

        Args:
            options: Option names to values; None or empty for the defaults.
            here: Also check what only the host that runs the job can tell (a CUDA device,
                vLLM installed): the job process does, ``timeslice job start`` does not.

        Returns:
            The options, checked.

        Raises:
            ValueError: An option is unknown, of the wrong type or out of range (the message
                names the workload, the option and what is allowed).
        """
        opts = options_as(cls, cls.workload, options)
        opts._check()
        if here:
            opts._check_here()
        return opts

    @classmethod
    def describe(cls) -> list[OptionInfo]:
        """Every option: its name, type, default and meaning.

        Returns:
            One :class:`OptionInfo` per field, in declaration order.
        """
        hints = typing.get_type_hints(cls)
        return [
            OptionInfo(f.name, _type_name(hints[f.name]), f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(cls)
        ]

    def _check(self) -> None:
        """Range checks that hold anywhere (a subclass adds its own)."""

    def _check_here(self) -> None:
        """Checks of what the host running the job has (a subclass adds its own)."""

    def _need(self, ok: bool, key: str, allowed: str) -> None:
        if not ok:
            raise ValueError(
                f"{self.workload}: option {key!r} = {getattr(self, key)!r} is invalid; "
                f"allowed: {allowed}"
            )

    def _finite_in(self, key: str, low: float, high: float) -> bool:
        value = getattr(self, key)
        return math.isfinite(value) and low <= value <= high


@dataclass(frozen=True)
class DigitGrpoOptions(WorkloadOptions):
    """The options every digit-task GRPO (grpo-toy, hf-grpo, grpo-jax) takes: the task's and
    clipped GRPO's."""

    workload: ClassVar[str] = "digit-grpo"

    task: str = option(
        "sort", "what the completion must be: the prompt sorted (sort), reversed or copied"
    )
    seq_len: int = option(4, "digits in a prompt (and in its completion), 1..32")
    digits: int = option(10, "the digit alphabet, 0 .. digits-1; 2..64")
    layers: int = option(2, "the policy's layers, 1..12")
    lr: float = option(3e-3, "Adam's learning rate, in (0, 1]")
    kl_coef: float = option(0.0, "weight of the KL penalty to the frozen reference, [0, 100]")
    clip_eps: float = option(0.2, "PPO-style clip of the policy ratio, in (0, 1)")
    ppo_steps: int = option(4, "optimizer steps per train call, each over the batch; 1..64")
    max_grad_norm: float = option(1.0, "gradient clipping norm, > 0")
    temperature: float = option(1.0, "sampling temperature, [0.05, 10]")
    # The task's own check takes microseconds, which would make every job GPU-bound.
    reward_latency_s: float = option(
        0.0,
        "seconds the rewards phase also waits, standing in for an external verifier (a code "
        "sandbox, a judge model, a tool) whose latency leaves the GPU idle: the time another "
        "job sharing the group can use it (the demo uses 1.5); [0, 3600]",
    )

    def _check(self) -> None:
        need = self._need
        need(self.task in TASKS, "task", f"one of {list(TASKS)}")
        need(1 <= self.seq_len <= 32, "seq_len", "an int in 1..32")
        need(2 <= self.digits <= 64, "digits", "an int in 2..64")
        need(1 <= self.layers <= 12, "layers", "an int in 1..12")
        need(self._finite_in("lr", 0.0, 1.0) and self.lr > 0.0, "lr", "a float in (0, 1]")
        need(self._finite_in("kl_coef", 0.0, 100.0), "kl_coef", "a float in [0, 100]")
        need(0.0 < self.clip_eps < 1.0, "clip_eps", "a float in (0, 1)")
        need(1 <= self.ppo_steps <= 64, "ppo_steps", "an int in 1..64")
        need(
            math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0.0,
            "max_grad_norm",
            "a finite float > 0",
        )
        need(self._finite_in("temperature", 0.05, 10.0), "temperature", "a float in [0.05, 10]")
        need(
            self._finite_in("reward_latency_s", 0.0, 3600.0),
            "reward_latency_s",
            "a float in [0, 3600]",
        )


@dataclass(frozen=True)
class GrpoToyOptions(DigitGrpoOptions):
    """grpo-toy: the digit task's and GRPO's options, the transformer's, async mode's and the
    device."""

    workload: ClassVar[str] = "grpo-toy"

    d_model: int = option(64, "the transformer's width, 8..1024")
    heads: int = option(4, "attention heads, dividing d_model")
    behaviour_weight_cap: float = option(
        2.0,
        "async mode: the most a stale batch's behaviour importance weight (proximal / "
        "behaviour policy, per token) may count; [1, 100]",
    )
    stale_objective: str = option(
        "decoupled",
        "async mode: 'decoupled' clips a stale batch's ratio against the trainer's policy as "
        "the step begins and weights it by proximal / behaviour; 'ppo' clips against the "
        "behaviour policy, as a fresh batch's is",
    )
    device: str = option("cpu", "where the model computes: cpu, cuda, or auto (cuda if present)")

    def _check(self) -> None:
        super()._check()
        need = self._need
        need(self.device in DEVICES, "device", f"one of {list(DEVICES)}")
        need(8 <= self.d_model <= 1024, "d_model", "an int in 8..1024")
        need(
            self.heads >= 1 and self.d_model % self.heads == 0,
            "heads",
            f"an int >= 1 that divides d_model ({self.d_model})",
        )
        need(
            1.0 <= self.behaviour_weight_cap <= 100.0,
            "behaviour_weight_cap",
            "a float in [1, 100]",
        )
        need(
            self.stale_objective in STALE_OBJECTIVES,
            "stale_objective",
            f"one of {list(STALE_OBJECTIVES)}",
        )

    def _check_here(self) -> None:
        if self.device == "cuda" and not _cuda_available():
            raise ValueError(
                f"{self.workload}: option 'device' = 'cuda' but CUDA is not available here; "
                "use 'cpu' or 'auto'"
            )

    def torch_device(self) -> torch.device:
        """The device the option names.

        Returns:
            ``cuda`` where ``auto`` finds CUDA, else ``cpu``; or ``device`` as given.
        """
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def vllm_available() -> bool:
    """vLLM importable and a CUDA device present (the vLLM sampler needs both).

    Returns:
        Whether the ``vllm`` sampler can run here.
    """
    return importlib.util.find_spec("vllm") is not None and _cuda_available()


@dataclass(frozen=True)
class HfGrpoOptions(GrpoToyOptions):
    """hf-grpo: grpo-toy's options (``d_model`` is the hidden size, ``heads`` the attention
    heads), with a head size of 64 by default, and the sampler's."""

    workload: ClassVar[str] = "hf-grpo"

    d_model: int = option(128, "the policy's hidden size, 8..1024")
    heads: int = option(2, "attention heads, dividing d_model")
    sampler: str = option(
        "auto", "torch (a copy of the policy), vllm (a vLLM engine; needs a GPU) or auto"
    )
    vllm_memory: float = option(
        0.2, "the vLLM engine's share of the device memory (gpu_memory_utilization), [0.01, 0.95]"
    )

    def _check(self) -> None:
        super()._check()
        if self.digits != 10:
            raise ValueError(
                f"{self.workload}: option 'digits' must be 10 (the tokenizer's alphabet)"
            )
        self._need(self.sampler in SAMPLERS, "sampler", f"one of {list(SAMPLERS)}")
        self._need(0.01 <= self.vllm_memory <= 0.95, "vllm_memory", "a float in [0.01, 0.95]")

    def _check_here(self) -> None:
        super()._check_here()
        if self.sampler == "vllm" and not vllm_available():
            raise ValueError(
                f"{self.workload}: option 'sampler' = 'vllm' needs vLLM and a CUDA device "
                "(pip install 'timeslice[vllm]'); use 'torch' or 'auto'"
            )

    def use_vllm(self) -> bool:
        """Whether the sampler is a vLLM engine.

        Returns:
            True for ``vllm``, and for ``auto`` where vLLM imports and CUDA is present.
        """
        return self.sampler == "vllm" or (self.sampler == "auto" and vllm_available())


COLLECTIVES = ("rebuild", "keep")
DIST_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class GrpoDpOptions(GrpoToyOptions):
    """grpo-dp: grpo-toy's options, and how the job's data-parallel ranks talk to each other."""

    workload: ClassVar[str] = "grpo-dp"

    collectives: str = option(
        "rebuild",
        "'rebuild': the ranks' process group is torn down at every eviction and rebuilt at its "
        "next use (what NCCL needs); 'keep': kept across switches (gloo holds no device memory)",
    )
    dist_backend: str = option("auto", "gloo, nccl, or auto (NCCL on a CUDA device)")
    collective_timeout_s: float = option(
        60.0, "how long a collective (or a rebuild) waits for a lost rank, s; [1, 3600]"
    )

    def _check(self) -> None:
        super()._check()
        need = self._need
        need(self.collectives in COLLECTIVES, "collectives", f"one of {list(COLLECTIVES)}")
        need(self.dist_backend in DIST_BACKENDS, "dist_backend", ", ".join(DIST_BACKENDS))
        need(
            self._finite_in("collective_timeout_s", 1.0, 3600.0),
            "collective_timeout_s",
            "[1, 3600]",
        )


@dataclass(frozen=True)
class GrpoJaxOptions(DigitGrpoOptions):
    """grpo-jax: grpo-toy's task and GRPO options and the MLP's width."""

    workload: ClassVar[str] = "grpo-jax"

    hidden: int = option(128, "the MLP's hidden width, 8..4096")
    lr: float = option(1e-2, "optax Adam's learning rate, in (0, 1]")

    def _check(self) -> None:
        super()._check()
        self._need(8 <= self.hidden <= 4096, "hidden", "an int in 8..4096")


@dataclass(frozen=True)
class SimulatedOptions(WorkloadOptions):
    """simulated: how long each phase holds its lease and how large a state a switch moves."""

    workload: ClassVar[str] = "simulated"

    sample_s: float = option(1.0, "seconds the sample phase holds the sampler group")
    reward_s: float = option(1.5, "seconds the rewards phase takes, holding no group")
    train_s: float = option(0.5, "seconds the train phase holds the trainer group")
    state_bytes: float = option(0, "bytes of each state (sampler's, trainer's) a switch moves")
    snapshot_s: float = option(0.0, "seconds a switch takes to move a state off the device")
    restore_s: float | None = option(None, "seconds to move it back (default: snapshot_s)")
    shared_state: bool = option(
        False, "one state that both groups move, instead of a sampler's and a trainer's"
    )
    sync_s: float = option(0.0, "async mode: seconds publishing the weights takes (trainer lease)")
    load_s: float = option(0.0, "async mode: seconds loading them takes (sampler lease)")
    sync_bytes: float | None = option(
        None, "async mode: bytes a weights sync moves (default: state_bytes)"
    )
    chunk_bytes: float = option(
        DEFAULT_CHUNK_BYTES, "bytes a move streams at a time through a device room, >= 1"
    )
    residency_trace: str = option(
        "", "a file each chunk's arrival on and departure from the device is appended to"
    )
    state_on_host: bool = option(
        False,
        "the states stand for host memory (torch on the CPU): a switch frees no device memory, "
        "so the next job's restore does not wait for this job's eviction",
    )
    gpu_scale_from: int = option(
        0,
        "from this epoch (async: batch and step) on, the GPU phases take gpu_scale times their "
        "seconds (0: never): a profile that drifts",
    )
    gpu_scale: float = option(1.0, "what gpu_scale_from scales the GPU phases' seconds by")

    def _check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float | int) and not isinstance(value, bool):
                self._need(math.isfinite(value) and value >= 0, f.name, "a finite number >= 0")
        self._need(self.chunk_bytes >= 1, "chunk_bytes", "a number >= 1")

    def seconds_and_bytes(self) -> dict[str, float]:
        """Every number, defaults filled in (``restore_s`` from ``snapshot_s``, ``sync_bytes``
        from ``state_bytes``).

        Returns:
            Option name to value, for every option but ``shared_state``, ``state_on_host``
            and ``residency_trace``.
        """
        values = {
            f.name: float(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name
            not in ("shared_state", "residency_trace", "restore_s", "sync_bytes", "state_on_host")
        }
        values["restore_s"] = self.snapshot_s if self.restore_s is None else self.restore_s
        values["sync_bytes"] = self.state_bytes if self.sync_bytes is None else self.sync_bytes
        return values


BUILTIN_OPTIONS: dict[str, type[WorkloadOptions]] = {
    "grpo-dp": GrpoDpOptions,
    "grpo-jax": GrpoJaxOptions,
    "grpo-toy": GrpoToyOptions,
    "hf-grpo": HfGrpoOptions,
    "simulated": SimulatedOptions,
}


def check_workload_options(workload: str, options: dict[str, Any]) -> bool:
    """Check a job's options as its built-in workload parses them, before anything starts
    (what the host that runs it has is left to its process).

    Args:
        workload: The job's workload (a built-in name, or ``MODULE:FACTORY``).
        options: Its ``workload_options``.

    Returns:
        True if checked; False for a workload that is not built in (its own process checks
        its options when the job first meets it).

    Raises:
        ValueError: An option is unknown (with the closest known name), of the wrong type, or
            out of range.
    """
    options_type = BUILTIN_OPTIONS.get(workload)
    if options_type is None:
        return False
    options_type.parse(options, here=False)
    return True
