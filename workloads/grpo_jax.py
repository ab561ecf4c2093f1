"""GRPO in JAX + optax on grpo-toy's digits task, its state moved by the ``jax`` backend.

The task is grpo-toy's: each prompt is ``seq_len`` random digits, the policy writes ``seq_len``
digits, and the reward is the fraction of positions that match the sorted (reversed, copied)
prompt. The policy is small enough to learn on a CPU in seconds: an autoregressive MLP that sees
the prompt, the digits written so far and the position, and gives the next digit's logits.

As in grpo-toy the state is split like a real sampler / trainer pair:

* the **sampler** holds its own copy of the policy's parameters (backend ``"sampler"``);
* the **trainer** holds the policy, a frozen reference copy and the optax Adam state (backend
  ``"trainer"``).

Both are :class:`~timeslice.snapshot.jax_backend.JaxState` holders: every phase reads its arrays
from the holders and puts the new ones back, so after a snapshot and restore (new arrays, the old
ones deleted) the next phase finds the restored state. Weights go from trainer to sampler through
a host-side *pending* copy (NumPy arrays, in no backend): ``train`` writes it at its end,
``sample`` loads it at its start, so neither phase touches the other group's state.

Determinism: the parameters are drawn from a NumPy generator seeded with ``spec.seed``; all of
epoch ``e``'s randomness (the prompts, and the uniforms each sampled digit inverts the policy's
CDF at) from a fresh generator seeded with ``(seed, e)``. JAX on one CPU computes the
same bytes every run, and an eviction copies bytes, so a job that was evicted and restored ends
with the very parameters of one run alone. A ``train`` stopped part-way puts the arrays it began
with back into the holders (JAX arrays are immutable: keeping the old references is the backup).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
except ImportError as err:  # a clean message instead of a bare ImportError deep in a worker
    raise ImportError(
        f"the grpo-jax workload needs JAX and optax ({err}): pip install 'timeslice[jax]'"
    ) from err

from timeslice.snapshot.jax_backend import JaxBackend, JaxState, path_name
from timeslice.workloads.base import JobSpec, PhaseContext, PhaseStopped
from timeslice.workloads.digit_grpo import DigitGrpoWorkload, steps_summary
from timeslice.workloads.options import GrpoJaxOptions

_FILES = ("trainer.npz", "pending.npz", "meta.json")


# ---------------------------------------------------------------------------- the policy


def init_policy(rng: np.random.Generator, opts: GrpoJaxOptions) -> dict[str, Any]:
    """The policy's parameters as host arrays, drawn from ``rng``."""
    k, d = opts.seq_len, opts.digits
    width = 2 * k * d + k  # the prompt, the digits so far (one-hot each), the position
    layers = []
    for _ in range(opts.layers):
        w = rng.standard_normal((width, opts.hidden), dtype=np.float32) * np.float32(
            math.sqrt(2.0 / width)
        )
        layers.append({"w": w, "b": np.zeros(opts.hidden, np.float32)})
        width = opts.hidden
    head_w = rng.standard_normal((width, d), dtype=np.float32) * np.float32(0.01)
    return {"layers": layers, "head": {"w": head_w, "b": np.zeros(d, np.float32)}}


def _features(prompts: jax.Array, written: jax.Array, position: jax.Array, d: int) -> jax.Array:
    """Input rows for writing position ``position`` (N,) after ``written`` (N, k; the digits at
    ``position`` and later are masked out)."""
    k = prompts.shape[-1]
    seen = (jnp.arange(k)[None, :] < position[:, None])[..., None]
    parts = [
        jax.nn.one_hot(prompts, d).reshape(prompts.shape[0], -1),
        (jax.nn.one_hot(written, d) * seen).reshape(prompts.shape[0], -1),
        jax.nn.one_hot(position, k),
    ]
    return jnp.concatenate(parts, axis=-1)


def _logits(params: dict[str, Any], x: jax.Array, temperature: float) -> jax.Array:
    for layer in params["layers"]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return (x @ params["head"]["w"] + params["head"]["b"]) / temperature


@partial(jax.jit, static_argnames=("optimizer",))
def _optimizer_init(policy: dict[str, Any], *, optimizer: optax.GradientTransformation) -> Any:
    return optimizer.init(policy)


@partial(jax.jit, static_argnames=("d", "temperature"))
def _sample_step(
    params: dict[str, Any],
    prompts: jax.Array,
    written: jax.Array,
    step: jax.Array,
    uniform: jax.Array,
    *,
    d: int,
    temperature: float,
) -> tuple[jax.Array, jax.Array]:
    """Write position ``step`` of every completion, drawing each digit by inverting the
    policy's CDF at ``uniform`` (N,): (completions so far, the digits' log-probs)."""
    position = jnp.full((prompts.shape[0],), step, dtype=jnp.int32)
    x = _features(prompts, written, position, d)
    logp = jax.nn.log_softmax(_logits(params, x, temperature))
    cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
    choice = jnp.minimum(jnp.sum(cdf < uniform[:, None], axis=-1), d - 1).astype(jnp.int32)
    chosen = jnp.take_along_axis(logp, choice[:, None], axis=-1)[:, 0]
    return written.at[:, step].set(choice), chosen


def _completion_logp(
    params: dict[str, Any], prompts: jax.Array, completions: jax.Array, d: int, temperature: float
) -> jax.Array:
    """Log-probs (N, k) of each written digit under ``params`` (teacher-forced)."""
    n, k = completions.shape
    rows = jnp.repeat(jnp.arange(n), k)
    position = jnp.tile(jnp.arange(k), n)
    x = _features(prompts[rows], completions[rows], position, d)
    logp = jax.nn.log_softmax(_logits(params, x, temperature))
    chosen = jnp.take_along_axis(logp, completions.reshape(-1, 1), axis=-1)
    return chosen.reshape(n, k)


_completion_logp_jit = jax.jit(_completion_logp, static_argnames=("d", "temperature"))


@partial(jax.jit, static_argnames=("optimizer", "d", "temperature", "clip_eps", "kl_coef"))
def _update(
    policy: dict[str, Any],
    opt_state: Any,
    prompts: jax.Array,
    completions: jax.Array,
    advantages: jax.Array,
    old_logp: jax.Array,
    ref_logp: jax.Array,
    *,
    optimizer: optax.GradientTransformation,
    d: int,
    temperature: float,
    clip_eps: float,
    kl_coef: float,
) -> tuple[dict[str, Any], Any, dict[str, jax.Array]]:
    def loss_fn(params: dict[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        logp = _completion_logp(params, prompts, completions, d, temperature)
        ratio = jnp.exp(logp - old_logp)
        clipped = jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps)
        policy_loss = -jnp.minimum(ratio * advantages, clipped * advantages).mean()
        log_ref_ratio = ref_logp - logp
        kl = (jnp.exp(log_ref_ratio) - log_ref_ratio - 1).mean()  # k3 estimator, >= 0
        clip_frac = (jnp.abs(ratio - 1) > clip_eps).mean()
        return policy_loss + kl_coef * kl, {"kl": kl, "clip_frac": clip_frac}

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(policy)
    updates, opt_state = optimizer.update(grads, opt_state, policy)
    stats = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
    return optax.apply_updates(policy, updates), opt_state, stats


@lru_cache(maxsize=16)
def _optimizer(lr: float, max_grad_norm: float) -> optax.GradientTransformation:
    """One object per setting: the jitted update takes it as a static argument, so jobs (and
    tests) with the same settings share one compilation."""
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(lr))


@dataclass
class _Rollout:
    epoch: int
    prompts: np.ndarray  # (N, k) digits, each prompt repeated group_size times
    completions: np.ndarray  # (N, k)
    old_logp: np.ndarray  # (N, k) under the sampler's policy
    rewards: np.ndarray | None = None


# ---------------------------------------------------------------------------- the workload


class GrpoJaxWorkload(DigitGrpoWorkload):
    name = "grpo-jax"
    options_type = GrpoJaxOptions
    opts: GrpoJaxOptions

    def setup(self, spec: JobSpec) -> None:
        """Draw the MLP from ``spec.seed`` (NumPy), put three copies on the device (policy,
        reference, sampler) and Adam's state, and register them with two jax backends.

        Args:
            spec: The seed the parameters come from, the batch and group sizes, and the
                options (:class:`GrpoJaxOptions`).

        Raises:
            ValueError: From the spec's checks: a size below 1, an option refused.
        """
        opts: GrpoJaxOptions = self._configure(spec)
        self.optimizer = _optimizer(opts.lr, opts.max_grad_norm)
        # Committed to one device from the start, as restored arrays are: jitted calls then
        # see the same kind of argument before and after a switch (one compilation, not two).
        device = jax.local_devices()[0]
        initial = init_policy(np.random.default_rng([spec.seed]), opts)
        # Three distinct copies: a snapshot deletes arrays, so no two states may share one.
        policy, reference, sampler = (jax.device_put(initial, device) for _ in range(3))
        adam = jax.device_put(_optimizer_init(policy, optimizer=self.optimizer), device)
        self.pending = jax.tree.map(lambda x: np.array(x, copy=True), initial)
        self._rollout = None
        self._last_trained = None

        sampler_backend = JaxBackend()
        self.sampler = sampler_backend.register("policy", sampler)
        trainer_backend = JaxBackend()
        self.policy = trainer_backend.register("policy", policy)
        self.reference = trainer_backend.register("reference", reference)
        self.adam = trainer_backend.register("adam", adam)
        self._backends = {"sampler": sampler_backend, "trainer": trainer_backend}

    # ------------------------------------------------------------ helpers

    def _generator(self, epoch: int) -> np.random.Generator:
        """Epoch ``epoch``'s only source of randomness: a fresh generator from (seed, epoch)."""
        return np.random.default_rng([self._spec().seed, epoch])

    def _targets(self, prompts: np.ndarray) -> np.ndarray:
        if self.opts.task == "sort":
            return np.sort(prompts, axis=1)
        if self.opts.task == "reverse":
            return prompts[:, ::-1]
        return prompts.copy()

    # ------------------------------------------------------------ phases

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Load the pending weights onto the sampler, then write each completion digit by digit,
        inverting the policy's CDF at uniforms drawn from (seed, epoch).

        Args:
            epoch: The epoch.
            ctx: Checked before each digit.

        Returns:
            ``completions`` and ``tokens`` sampled.

        Raises:
            PhaseStopped: The lease was lost.
        """
        spec, opts = self._spec(), self.opts
        ctx.check()
        # The trainer's last weights, through the host copy (never the trainer's arrays).
        current = self.sampler.value
        self.sampler.value = jax.tree.map(
            lambda host, now: jax.device_put(host, now.sharding), self.pending, current
        )
        del current
        params = self.sampler.value
        gen = self._generator(epoch)
        k, n = opts.seq_len, spec.batch_size * spec.group_size
        prompts_host = gen.integers(0, opts.digits, (spec.batch_size, k), dtype=np.int32)
        uniforms = gen.random((k, n), dtype=np.float32)
        # Committed to the sampler's device, like its parameters: one compilation of the step.
        device = next(iter(jax.tree_util.tree_leaves(params)[0].sharding.device_set))
        prompts = jax.device_put(np.repeat(prompts_host, spec.group_size, axis=0), device)
        written = jax.device_put(np.zeros((n, k), dtype=np.int32), device)
        uniforms = jax.device_put(uniforms, device)
        logps = []
        for step in range(k):
            ctx.check()
            written, chosen = _sample_step(
                params,
                prompts,
                written,
                jnp.int32(step),
                uniforms[step],
                d=opts.digits,
                temperature=opts.temperature,
            )
            logps.append(chosen)
            ctx.progress(step=step + 1, of=k)
        ctx.check()
        self._rollout = _Rollout(
            epoch=epoch,
            prompts=np.asarray(prompts),
            completions=np.asarray(written),
            old_logp=np.stack([np.asarray(x) for x in logps], axis=1),
        )
        return {"completions": float(n), "tokens": float(n * k)}

    def compute_rewards(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Score each completion by the digits it gets right (NumPy), after the stand-in verifier's
        ``reward_latency_s``.

        Args:
            epoch: The epoch sampled in this process.
            ctx: The stop check and the latency's wait.

        Returns:
            ``reward_mean``, ``reward_std``, ``group_std_mean``, ``accuracy``, ``digit_accuracy``.

        Raises:
            RuntimeError: No rollout of ``epoch`` is held here.
        """
        return self._score(self._sampled(epoch), ctx)

    def _reward_metrics(self, correct: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        spec = self._spec()
        rewards = correct.astype(np.float32).mean(axis=1)
        grouped = rewards.reshape(spec.batch_size, spec.group_size)
        return rewards, {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "group_std_mean": float(grouped.std(axis=1).mean()),
            "accuracy": float(correct.all(axis=1).mean()),
            "digit_accuracy": float(correct.mean()),
        }

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """``ppo_steps`` jitted optax updates on the scored rollout; the new policy then goes to
        the host copy for the next sample. Stopped part-way, the arrays the phase began with are put
        back (JAX arrays are immutable: keeping them is the backup).

        Args:
            epoch: The epoch scored in this process.
            ctx: Checked before each update.

        Returns:
            Mean ``loss``, ``grad_norm``, ``clip_frac`` over the steps, the last ``kl``, and
            ``optimizer_steps``.

        Raises:
            RuntimeError: The rollout of ``epoch`` is not scored here.
            PhaseStopped: The lease was lost (after the rollback).
        """
        spec, opts = self._spec(), self.opts
        ro = self._scored(epoch)
        ctx.check()
        grouped = ro.rewards.reshape(spec.batch_size, spec.group_size)
        mean = grouped.mean(axis=1, keepdims=True)
        std = grouped.std(axis=1, keepdims=True)
        advantages = jnp.asarray(((grouped - mean) / (std + 1e-4)).reshape(-1, 1))
        prompts, completions = jnp.asarray(ro.prompts), jnp.asarray(ro.completions)
        old_logp = jnp.asarray(ro.old_logp)
        ref_logp = _completion_logp_jit(
            self.reference.value, prompts, completions, d=opts.digits, temperature=opts.temperature
        )
        # Immutable arrays: the references the step began with are the rollback.
        began = (self.policy.value, self.adam.value)
        stats: list[dict[str, float]] = []
        try:
            for step in range(opts.ppo_steps):
                ctx.check()
                policy, adam, step_stats = _update(
                    self.policy.value,
                    self.adam.value,
                    prompts,
                    completions,
                    advantages,
                    old_logp,
                    ref_logp,
                    optimizer=self.optimizer,
                    d=opts.digits,
                    temperature=opts.temperature,
                    clip_eps=opts.clip_eps,
                    kl_coef=opts.kl_coef,
                )
                self.policy.value, self.adam.value = policy, adam
                stats.append({key: float(v) for key, v in step_stats.items()})
                ctx.progress(step=step + 1, of=opts.ppo_steps)
        except PhaseStopped:
            self.policy.value, self.adam.value = began  # a rerun starts from the same state
            raise
        del began
        # Hand the new weights to the sampler through the host copy (its own memory).
        self.pending = jax.tree.map(lambda x: np.array(x, copy=True), self.policy.value)
        self._last_trained = epoch
        return steps_summary(stats)

    # ------------------------------------------------------------ checkpoints

    def _trainer_states(self) -> list[JaxState]:
        return [self.policy, self.reference, self.adam]

    def save(self, directory: Path) -> None:
        """Write ``trainer.npz`` (policy, reference, Adam state by path name), ``pending.npz``
        and ``meta.json``, each under a temporary name first.

        Args:
            directory: The checkpoint's folder (made if missing).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        trainer = {}
        for state in self._trainer_states():
            trainer.update(_named_leaves(state.name, state.value))
        pending = _named_leaves("pending", self.pending)
        # Temporary names first, so a crash never leaves a half-written checkpoint.
        for fname, arrays in (("trainer.npz", trainer), ("pending.npz", pending)):
            tmp = directory / (fname + ".tmp")
            with tmp.open("wb") as f:
                np.savez(f, **arrays)
            tmp.replace(directory / fname)
        tmp = directory / "meta.json.tmp"
        tmp.write_text(json.dumps(self._meta(), sort_keys=True))
        tmp.replace(directory / "meta.json")

    def load(self, directory: Path) -> None:
        """Read a checkpoint back onto the holders' devices and shardings, checking every array
        before changing anything.

        Args:
            directory: A folder :meth:`save` wrote.

        Raises:
            FileNotFoundError: A file is missing.
            ValueError: Written for another workload, seed or options, or an array that does
                not fit.
        """
        directory = Path(directory)
        self._check_checkpoint(directory, _FILES)
        meta = json.loads((directory / "meta.json").read_text())
        self._check_meta(directory, meta)
        with np.load(directory / "trainer.npz") as saved:
            trainer = {name: saved[name] for name in saved.files}
        with np.load(directory / "pending.npz") as saved:
            pending = {name: saved[name] for name in saved.files}
        # Check everything before changing anything: a checkpoint that does not fit loses nothing.
        loaded = [
            (state, _from_named(state.name, state.value, trainer, directory, device=True))
            for state in self._trainer_states()
        ]
        self.pending = _from_named("pending", self.pending, pending, directory, device=False)
        for state, tree in loaded:
            state.value = tree
        self._last_trained = meta.get("last_trained_epoch")
        self._rollout = None


def _named_leaves(name: str, tree: Any) -> dict[str, np.ndarray]:
    return {
        path_name(name, path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _from_named(
    name: str, like: Any, saved: dict[str, np.ndarray], directory: Path, *, device: bool
) -> Any:
    """A tree shaped like ``like`` from the saved arrays (on ``like``'s shardings if device)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for path, leaf in flat:
        key = path_name(name, path)
        array = saved.get(key)
        if array is None or array.shape != leaf.shape or array.dtype != leaf.dtype:
            raise ValueError(f"grpo-jax: checkpoint {directory} does not fit this model ({key})")
        leaves.append(jax.device_put(array, leaf.sharding) if device else array.copy())
    return jax.tree_util.tree_unflatten(treedef, leaves)


def create() -> GrpoJaxWorkload:
    """The factory a job process calls to build this workload."""
    return GrpoJaxWorkload()
