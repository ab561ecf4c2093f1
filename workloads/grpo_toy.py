"""A real, small GRPO on torch: a tiny decoder-only transformer learns to sort digits.

The task is verifiable: each prompt is ``seq_len`` random digits, the policy writes ``seq_len``
digits after a separator, and the reward is the fraction of positions that match the sorted
prompt (partial credit, in [0, 1]). A random policy scores about 0.1; a policy that has learnt
only "small digits first, large digits last" scores about 0.3; one that also reads the prompt
climbs from there.

Like a real RL system (a vLLM sampler and a torch trainer), the state is split in two:

* the **sampler** holds its own copy of the policy weights (backend ``"sampler"``);
* the **trainer** holds the policy, a frozen reference copy and the Adam optimizer
  (backend ``"trainer"``).

Weights travel from trainer to sampler through a host-side *pending* buffer (plain CPU tensors,
registered in no backend): ``train`` copies its updated weights into it at the end, ``sample``
copies them into the sampler's policy at the start. Neither phase touches the other group's
tensors, which may be evicted (zero-byte storages) while the other group holds the device.

Determinism: the model is built from ``spec.seed`` inside :func:`torch.random.fork_rng`, and all
of epoch ``e``'s randomness (the prompt draw and the token sampling) comes from a fresh
:class:`torch.Generator` seeded from ``(spec.seed, e)``. Adam's state is created eagerly at setup,
so the backend covers it from the start and every step updates the same tensor objects in
place. A ``train`` stopped part-way (:class:`PhaseStopped`) rolls the trainer back to where it
began, so running the phase again gives the same result.

Async mode (:class:`~timeslice.workloads.base.AsyncWorkload`): batch ``b`` is sampled with the
sampler's (stale) copy of the policy and randomness from ``(seed, b)``; the trainer trains on
batches as they come, and the pending buffer is refreshed only when the job publishes its
weights (``publish_weights``), the sampler's copy only when it loads them (``load_weights``).
With ``max_staleness`` 0 every batch ``b`` is sampled with the weights after ``b`` steps, which
is the sync job's schedule: the same rewards and the same trained weights.

A *stale* batch (its sampler's weights older than the trainer's policy, counted in train calls)
is trained with the decoupled PPO objective (option ``stale_objective``, default
``"decoupled"``): the ratio is clipped against the trainer's policy as the call begins, and
each token weighted by that policy's probability over the sampler's, truncated at
``behaviour_weight_cap``. Plain PPO, clipping against the sampler's policy, starts a batch two
steps stale with 36-79% of its tokens outside the clip range, and learns about a quarter as fast.
A fresh batch, and every sync phase, keeps plain PPO (bit for bit the sync job).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from timeslice.snapshot.torch_backend import TorchBackend
from timeslice.workloads.base import AsyncWorkload, JobSpec, PhaseContext, PhaseStopped
from timeslice.workloads.digit_grpo import (
    DigitGrpoWorkload,
    steps_summary,
)
from timeslice.workloads.options import GrpoToyOptions
from torch import nn

__all__ = ["GrpoToyOptions", "GrpoToyWorkload", "create"]

_FILES = ("trainer.pt", "pending.pt", "meta.pt")


# ---------------------------------------------------------------------------- the policy


class _Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class _Policy(nn.Module):
    """Decoder-only transformer over ``digits`` digit tokens plus BOS and SEP."""

    def __init__(self, vocab: int, max_len: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.tok.weight, std=0.1)
        nn.init.normal_(self.pos.weight, std=0.1)
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------------------- the workload


@dataclass
class _Rollout:
    """One epoch's samples, on the host: never registered in a backend."""

    epoch: int
    prompts: torch.Tensor  # (n, seq_len) digits
    completions: torch.Tensor  # (n, seq_len) digits
    old_logp: torch.Tensor  # (n, seq_len) log-probs under the sampler's policy
    rewards: torch.Tensor | None = None  # (n,)
    # Async mode: the trainer's policy version the sampler's weights were (None: the sync
    # phases, whose sample always runs the trainer's latest weights).
    behaviour_version: int | None = None


class GrpoToyWorkload(DigitGrpoWorkload, AsyncWorkload):
    """GRPO with a tiny transformer on a digit task; split sampler / trainer state."""

    name = "grpo-toy"
    options_type = GrpoToyOptions
    opts: GrpoToyOptions

    def __init__(self) -> None:
        super().__init__()
        # Async mode: the batches held by id; the pending buffer is shared by the sampler's
        # thread (loading) and the trainer's (publishing).
        self._batches: dict[int, _Rollout] = {}
        self._pending_lock = threading.Lock()
        # Policy versions (train calls applied), the trainer's and those copied to the pending
        # buffer and into the sampler: a batch whose sampler version is not the trainer's is
        # stale. Only equality matters, so a load() may set all three to any one value.
        self._policy_version = self._pending_version = self._sampler_version = 0

    # ------------------------------------------------------------ setup

    def setup(self, spec: JobSpec) -> None:
        """Build the transformer from ``spec.seed`` (a forked RNG), its frozen reference, Adam with
        its state, the sampler's copy and the pending buffer, and both groups' torch backends (their
        host buffers made now).

        Args:
            spec: The job: its seed, sizes and options (:class:`GrpoToyOptions`).

        Raises:
            ValueError: A batch or group size below 1, or a bad option.
        """
        opts: GrpoToyOptions = self._configure(spec)
        self.device = opts.torch_device()
        self.bos, self.sep = opts.digits, opts.digits + 1
        self.vocab = opts.digits + 2
        self.prompt_len = opts.seq_len + 2  # BOS d1 .. dk SEP

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            policy = _Policy(
                self.vocab, self.prompt_len + opts.seq_len, opts.d_model, opts.layers, opts.heads
            )
        trainer_backend = self._build_trainer(policy)
        # Sampler: its own copy of the weights.
        self.sampler = copy.deepcopy(self.policy).requires_grad_(False).eval()
        sampler_backend = TorchBackend()
        sampler_backend.register_module("policy", self.sampler)
        self._backends = {"sampler": sampler_backend, "trainer": trainer_backend}
        for backend in self._backends.values():  # host buffers made now, not at a switch
            backend.reserve_host_buffers()

    def _build_trainer(self, policy: nn.Module) -> TorchBackend:
        """The trainer's state from ``policy``: the policy on the device, a frozen reference,
        Adam with its state created now (so the backend covers it from the start), and the
        host-side hand-over buffer (pending); no rollout held, no step trained.

        Returns:
            The trainer's backend, with the policy, the reference and Adam registered.
        """
        self.policy = policy.to(self.device)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.opts.lr)
        for p in self.policy.parameters():
            self.optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        self.pending = {
            n: p.detach().to("cpu", copy=True) for n, p in self.policy.named_parameters()
        }
        self._rollout = None
        self._last_trained = None
        self._policy_version = self._pending_version = self._sampler_version = 0
        backend = TorchBackend()
        backend.register_module("policy", self.policy)
        backend.register_module("reference", self.reference)
        backend.register_optimizer("adam", self.optimizer)
        return backend

    # ------------------------------------------------------------ helpers

    def _generator(self, epoch: int) -> torch.Generator:
        """Epoch ``epoch``'s only source of randomness: a fresh generator from (seed, epoch)."""
        seed = (self._spec().seed * 1_000_003 + epoch) % (1 << 63)
        return torch.Generator(device="cpu").manual_seed(seed)

    def _targets(self, prompts: torch.Tensor) -> torch.Tensor:
        task = self.opts.task
        if task == "sort":
            return prompts.sort(dim=1).values
        if task == "reverse":
            return prompts.flip(1)
        return prompts.clone()

    def _prefix(self, prompts: torch.Tensor) -> torch.Tensor:
        n = prompts.shape[0]
        bos = torch.full((n, 1), self.bos, dtype=torch.long)
        sep = torch.full((n, 1), self.sep, dtype=torch.long)
        return torch.cat([bos, prompts, sep], dim=1)

    def _digit_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Restrict to digit tokens (BOS / SEP are never sampled), at the temperature."""
        return logits[..., : self.opts.digits].float() / self.opts.temperature

    def _completion_logp(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs of the completion tokens in ``tokens`` (prefix + completion) under model."""
        k = self.opts.seq_len
        logits = model(tokens[:, :-1])[:, self.prompt_len - 1 :]
        logp = F.log_softmax(self._digit_logits(logits), dim=-1)
        return logp.gather(-1, tokens[:, -k:].unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(src)

    # ------------------------------------------------------------ phases

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Copy the pending weights into the sampler, then sample ``seq_len`` digits for each of
        ``batch_size`` prompts ``group_size`` times, with randomness from (seed, epoch).

        Args:
            epoch: The epoch.
            ctx: Checked before each digit; ``step`` of ``seq_len`` reported.

        Returns:
            ``completions`` and ``tokens`` sampled.

        Raises:
            PhaseStopped: The lease was lost.
        """
        self._spec()  # setup() first
        ctx.check()
        # The trainer's last weights, through the host buffer (never the trainer's tensors).
        for name, param in self.sampler.named_parameters():
            self._copy_in(param, self.pending[name])
        self._rollout, metrics = self._sample_rollout(epoch, ctx)
        return metrics

    def _sample_rollout(self, epoch: int, ctx: PhaseContext) -> tuple[_Rollout, dict[str, float]]:
        """Rollouts with the sampler's weights as they are, randomness from (seed, epoch)."""
        spec = self._spec()
        k, n = self.opts.seq_len, spec.batch_size * spec.group_size
        prompts, gen = self._draw_prompts(epoch)
        prompts = prompts.repeat_interleave(spec.group_size, dim=0)
        tokens = self._prefix(prompts).to(self.device)
        logps = []
        with torch.no_grad():
            for step in range(k):
                ctx.check()
                logits = self._digit_logits(self.sampler(tokens)[:, -1])
                logp = F.log_softmax(logits, dim=-1).cpu()
                choice = torch.multinomial(logp.exp(), 1, generator=gen)
                logps.append(logp.gather(1, choice))
                tokens = torch.cat([tokens, choice.to(self.device)], dim=1)
                ctx.progress(step=step + 1, of=k)
        ctx.check()
        rollout = _Rollout(
            epoch=epoch,
            prompts=prompts,
            completions=tokens[:, -k:].cpu(),
            old_logp=torch.cat(logps, dim=1),
        )
        return rollout, {"completions": float(n), "tokens": float(n * k)}

    def _draw_prompts(self, epoch: int) -> tuple[torch.Tensor, torch.Generator]:
        """Epoch ``epoch``'s prompts (``batch_size`` rows of digits), and the generator the
        completions are then sampled with."""
        gen = self._generator(epoch)
        shape = (self._spec().batch_size, self.opts.seq_len)
        return torch.randint(0, self.opts.digits, shape, generator=gen), gen

    def compute_rewards(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Score each completion: the share of its digits where the task's answer has them
        (then wait ``reward_latency_s``, the stand-in verifier).

        Args:
            epoch: The epoch :meth:`sample` ran in this process.
            ctx: The stop check, and the latency's wait.

        Returns:
            ``reward_mean``, ``reward_std``, ``group_std_mean``, ``accuracy`` (whole answers right)
            and ``digit_accuracy``.

        Raises:
            RuntimeError: This process holds no rollout of ``epoch``.
        """
        return self._score(self._sampled(epoch), ctx)

    def _reward_metrics(self, correct: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        spec = self._spec()
        rewards = correct.float().mean(dim=1)
        grouped = rewards.view(spec.batch_size, spec.group_size)
        return rewards, {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std(unbiased=False).item(),
            "group_std_mean": grouped.std(dim=1, unbiased=False).mean().item(),
            "accuracy": correct.all(dim=1).float().mean().item(),
            "digit_accuracy": correct.float().mean().item(),
        }

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """``ppo_steps`` clipped GRPO steps on the scored rollout (group-normalised advantages,
        KL to the reference), then the new weights into the pending buffer. Stopped part-way, the
        trainer's tensors are rolled back to where the phase began.

        Args:
            epoch: The epoch scored in this process.
            ctx: Checked before each optimizer step.

        Returns:
            The steps' mean ``loss``, ``grad_norm`` and ``clip_frac``, the last ``kl``, and
            ``optimizer_steps``.

        Raises:
            RuntimeError: The epoch's rollout was not scored here.
            PhaseStopped: The lease was lost.
        """
        stats = self._train_on(self._scored(epoch), ctx)
        # Hand the new weights to the sampler through the host buffer.
        for name, param in self.policy.named_parameters():
            self._copy_in(self.pending[name], param.detach())
        self._pending_version = self._policy_version
        self._last_trained = epoch
        return stats

    def _train_on(self, ro: _Rollout, ctx: PhaseContext) -> dict[str, float]:
        spec = self._spec()
        assert ro.rewards is not None
        ctx.check()
        grouped = ro.rewards.view(spec.batch_size, spec.group_size)
        mean = grouped.mean(dim=1, keepdim=True)
        std = grouped.std(dim=1, unbiased=False, keepdim=True)
        advantages = ((grouped - mean) / (std + 1e-4)).reshape(-1, 1).to(self.device)
        tokens = torch.cat([self._prefix(ro.prompts), ro.completions], dim=1).to(self.device)
        old_logp = ro.old_logp.to(self.device)
        with torch.no_grad():
            ref_logp = self._completion_logp(self.reference, tokens)
        lag = 0 if ro.behaviour_version is None else self._policy_version - ro.behaviour_version
        decoupled = lag != 0 and self.opts.stale_objective == "decoupled"

        backup = self._trainer_state()
        try:
            if decoupled:
                stats = self._optimize_decoupled(ctx, tokens, advantages, old_logp, ref_logp)
            else:
                stats = self._optimize(ctx, tokens, advantages, old_logp, ref_logp)
        except PhaseStopped:
            self._restore_trainer_state(backup)  # a rerun of this phase starts from the same state
            raise
        finally:
            self.optimizer.zero_grad(set_to_none=True)  # no device memory outside the backends
        self._policy_version += 1
        if ro.behaviour_version is None:  # the sync phases: always the trainer's own policy
            return stats
        return {**stats, "policy_lag": float(lag), "decoupled": float(decoupled)}

    # ------------------------------------------------------------ async mode

    def sample_batch(self, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Sample batch ``batch`` with the sampler's weights as loaded (maybe stale), randomness
        from (seed, batch); the batch remembers the policy version it saw.

        Args:
            batch: The batch's id.
            ctx: As for :meth:`sample`.

        Returns:
            ``completions`` and ``tokens``.

        Raises:
            PhaseStopped: The sampler's lease was lost.
        """
        self._spec()  # setup() first
        ctx.check()
        rollout, metrics = self._sample_rollout(batch, ctx)
        rollout.behaviour_version = self._sampler_version
        self._batches[batch] = rollout
        return metrics

    def score_batch(self, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Score batch ``batch`` as :meth:`compute_rewards` scores an epoch.

        Args:
            batch: A batch sampled in this process.
            ctx: The stop check.

        Returns:
            The batch's reward metrics.

        Raises:
            RuntimeError: No such batch was sampled here.
        """
        ro = self._batches.get(batch)
        if ro is None:
            raise RuntimeError(f"{self.name}: batch {batch} was not sampled in this process")
        return self._score(ro, ctx)

    def train_batch(self, step: int, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Train on batch ``batch``, then drop it: plain PPO when it is fresh, the decoupled
        objective (``stale_objective``) when the policy moved on since it was sampled.

        Args:
            step: The step.
            batch: A batch scored here.
            ctx: As for :meth:`train`.

        Returns:
            :meth:`train`'s metrics, with ``policy_lag`` (steps since the batch's weights) and
            ``decoupled`` (1 if that objective ran).

        Raises:
            RuntimeError: No scored batch ``batch`` is held.
            PhaseStopped: The trainer's lease was lost.
        """
        ro = self._batches.pop(batch, None)
        if ro is None or ro.rewards is None:
            raise RuntimeError(f"{self.name}: batch {batch} is not held scored in this process")
        stats = self._train_on(ro, ctx)
        self._last_trained = step
        return stats

    def publish_weights(self, version: int, ctx: PhaseContext) -> int:
        """Copy the trainer's weights into the pending buffer (host memory), under its lock.

        Args:
            version: The steps trained (the workload counts its own).
            ctx: The training step's context.

        Returns:
            The pending buffer's bytes.
        """
        with self._pending_lock:
            for name, param in self.policy.named_parameters():
                self._copy_in(self.pending[name], param.detach())
            self._pending_version = self._policy_version
        return sum(t.numel() * t.element_size() for t in self.pending.values())

    def load_weights(self, version: int, ctx: PhaseContext) -> int:
        """Copy the pending buffer into the sampler's weights.

        Args:
            version: The version published last.
            ctx: Checked before the copy.

        Returns:
            The bytes copied.

        Raises:
            PhaseStopped: The sampler's lease was lost.
        """
        ctx.check()
        with self._pending_lock:
            for name, param in self.sampler.named_parameters():
                self._copy_in(param, self.pending[name])
            self._sampler_version = self._pending_version
        return sum(t.numel() * t.element_size() for t in self.pending.values())

    def drop_batches(self) -> None:
        """Forget every batch held (the job rewound)."""
        self._batches.clear()

    def _optimize(
        self,
        ctx: PhaseContext,
        tokens: torch.Tensor,
        advantages: torch.Tensor,
        centre_logp: torch.Tensor,
        ref_logp: torch.Tensor,
        weight: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """``ppo_steps`` clipped-objective steps, the trust region centred on ``centre_logp``
        (plain PPO: the behaviour policy's), each token's objective times ``weight`` if given."""
        opts = self.opts
        steps = []
        for step in range(opts.ppo_steps):
            ctx.check()
            logp = self._completion_logp(self.policy, tokens)
            ratio = torch.exp(logp - centre_logp)
            unclipped = ratio * advantages
            clipped_obj = ratio.clamp(1 - opts.clip_eps, 1 + opts.clip_eps) * advantages
            objective = torch.minimum(unclipped, clipped_obj)
            policy_loss = -(objective if weight is None else weight * objective).mean()
            log_ref_ratio = ref_logp - logp
            kl = (torch.exp(log_ref_ratio) - log_ref_ratio - 1).mean()  # k3 estimator, >= 0
            loss = policy_loss + opts.kl_coef * kl
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self._reduce_gradients()
            norm = nn.utils.clip_grad_norm_(self.policy.parameters(), opts.max_grad_norm)
            self.optimizer.step()
            steps.append(
                {
                    "loss": loss.item(),
                    "kl": kl.item(),
                    "grad_norm": norm.item(),
                    "clip_frac": ((ratio - 1).abs() > opts.clip_eps).float().mean().item(),
                }
            )
            ctx.progress(step=step + 1, of=opts.ppo_steps)
        return steps_summary(steps)

    def _reduce_gradients(self) -> None:
        """Between backward and the optimizer step: where data-parallel ranks average their
        gradients (grpo-dp); one rank has nothing to do."""

    def _optimize_decoupled(
        self,
        ctx: PhaseContext,
        tokens: torch.Tensor,
        advantages: torch.Tensor,
        behaviour_logp: torch.Tensor,
        ref_logp: torch.Tensor,
    ) -> dict[str, float]:
        """Decoupled PPO (Hilton et al. 2021; AReaL's objective for async RL) for a stale batch.

        PPO's behaviour log-probs serve two ends: the importance ratio's denominator and the
        trust region's centre. A batch sampled several updates ago has a ratio far from 1
        before the first step, and the clip then zeroes the gradient of every token on the far
        side of the region. Here the trust region is centred on the *proximal* policy, the
        trainer's own as this call begins, so the first step's ratio is exactly 1; the
        off-policy correction is the per-token weight proximal / behaviour, detached and
        truncated at ``behaviour_weight_cap`` so that one unlikely token cannot dominate.
        """
        opts = self.opts
        with torch.no_grad():
            prox_logp = self._completion_logp(self.policy, tokens)
            behaviour_ratio = torch.exp(prox_logp - behaviour_logp)
            weight = behaviour_ratio.clamp(max=opts.behaviour_weight_cap)
            behaviour_clip = ((behaviour_ratio - 1).abs() > opts.clip_eps).float().mean().item()
        stats = self._optimize(ctx, tokens, advantages, prox_logp, ref_logp, weight)
        return {
            **stats,
            # What the plain objective would have clipped before its first step.
            "behaviour_clip_frac": behaviour_clip,
            "behaviour_weight_mean": weight.mean().item(),
        }

    def _trainer_state(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self._trainer_tensors()]

    def _restore_trainer_state(self, backup: list[torch.Tensor]) -> None:
        for dst, src in zip(self._trainer_tensors(), backup, strict=True):
            self._copy_in(dst, src)

    def _trainer_tensors(self) -> list[torch.Tensor]:
        tensors = list(self.policy.parameters())
        for p in self.policy.parameters():
            state = self.optimizer.state[p]
            tensors += [state["step"], state["exp_avg"], state["exp_avg_sq"]]
        return tensors

    # ------------------------------------------------------------ checkpoints

    def save(self, directory: Path) -> None:
        """Write ``trainer.pt`` (policy, reference, Adam state), ``pending.pt`` and ``meta.pt``,
        each under a temporary name first.

        Args:
            directory: The checkpoint's folder (made if missing).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        trainer = {
            "policy": {k: v.detach().cpu() for k, v in self.policy.state_dict().items()},
            "reference": {k: v.detach().cpu() for k, v in self.reference.state_dict().items()},
            "optimizer": [
                {key: t.detach().cpu() for key, t in self.optimizer.state[p].items()}
                for p in self.policy.parameters()
            ],
        }
        # Write to temporary names first so a crash never leaves a half-written checkpoint.
        for fname, obj in zip(_FILES, (trainer, dict(self.pending), self._meta()), strict=True):
            tmp = directory / (fname + ".tmp")
            torch.save(obj, tmp)
            tmp.replace(directory / fname)

    def load(self, directory: Path) -> None:
        """Copy a checkpoint into the existing tensors (the backends hold those very objects);
        the sampler then runs the trained weights and no batch survives.

        Args:
            directory: A folder :meth:`save` wrote.

        Raises:
            FileNotFoundError: A file is missing.
            ValueError: It was written for another workload, seed, options or model.
        """
        directory = Path(directory)
        self._check_checkpoint(directory, _FILES)
        meta = torch.load(directory / "meta.pt", weights_only=True)
        self._check_meta(directory, meta)
        trainer = torch.load(directory / "trainer.pt", weights_only=True)
        pending = torch.load(directory / "pending.pt", weights_only=True)
        # Copy into the existing tensors: the backends hold these very objects.
        for module, saved in (
            (self.policy, trainer["policy"]),
            (self.reference, trainer["reference"]),
        ):
            current = module.state_dict()
            if set(saved) != set(current):
                raise ValueError(f"{self.name}: checkpoint {directory} does not fit this model")
            for key, tensor in current.items():
                self._copy_in(tensor, saved[key])
        params = list(self.policy.parameters())
        if len(trainer["optimizer"]) != len(params):
            raise ValueError(f"{self.name}: checkpoint {directory} optimizer state does not fit")
        for p, saved in zip(params, trainer["optimizer"], strict=True):
            for key, tensor in self.optimizer.state[p].items():
                self._copy_in(tensor, saved[key])
        for name, tensor in self.pending.items():
            self._copy_in(tensor, pending[name])
        # The sampler starts from the trained weights (what a sync job's next sample copies in
        # anyway; an async job's pending buffer may hold older ones): no batch survives.
        for name, param in self.policy.named_parameters():
            self._copy_in(self.pending[name], param.detach())
        for name, param in self.sampler.named_parameters():
            self._copy_in(param, self.pending[name])
        self._last_trained = meta.get("last_trained_epoch")
        self._pending_version = self._sampler_version = self._policy_version
        self._rollout = None
        self._batches.clear()


def create() -> GrpoToyWorkload:
    """The factory a job process calls to build this workload."""
    return GrpoToyWorkload()
