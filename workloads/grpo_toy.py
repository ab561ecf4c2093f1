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
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timeslice.snapshot.torch_backend import TorchBackend
from timeslice.workloads.base import (
    AsyncWorkload,
    JobSpec,
    PhaseContext,
    PhaseStopped,
    options_as,
)
from torch import nn

TASKS = ("sort", "reverse", "copy")
STALE_OBJECTIVES = ("decoupled", "ppo")
DEVICES = ("cpu", "cuda", "auto")
_FILES = ("trainer.pt", "pending.pt", "meta.pt")


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class GrpoToyOptions:
    """The knobs in ``JobSpec.options`` (all optional)."""

    task: str = "sort"  # what the completion must be: the prompt sorted, reversed or copied
    seq_len: int = 4  # digits in a prompt (and in its completion)
    digits: int = 10  # the digit alphabet: 0 .. digits-1
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    kl_coef: float = 0.0  # weight of the KL penalty to the frozen reference policy
    clip_eps: float = 0.2  # PPO-style clip of the policy ratio
    # Async mode, a batch sampled with older weights than the trainer's: the most its
    # behaviour importance weight (proximal / behaviour policy, per token) may count.
    behaviour_weight_cap: float = 2.0
    # "decoupled": a stale batch's ratio is clipped against the trainer's policy as the step
    # begins (the proximal policy) and weighted by proximal / behaviour; "ppo": clipped against
    # the behaviour policy, as a fresh batch's is.
    stale_objective: str = "decoupled"
    ppo_steps: int = 4  # optimizer steps per train call, each over the whole batch
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda where available)
    # Seconds the rewards phase also waits, standing in for an external verifier (a code
    # sandbox, a judge model, a tool) whose latency leaves the GPU idle; the toy's own check
    # takes microseconds, which would make every job GPU-bound.
    reward_latency_s: float = 0.0

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> GrpoToyOptions:
        opts = options_as(cls, "grpo-toy", options)
        opts._check()
        return opts

    def _check(self) -> None:
        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise ValueError(
                    f"grpo-toy: option {key!r} = {getattr(self, key)!r} is invalid; "
                    f"allowed: {allowed}"
                )

        need(self.task in TASKS, "task", f"one of {list(TASKS)}")
        need(self.device in DEVICES, "device", f"one of {list(DEVICES)}")
        need(1 <= self.seq_len <= 32, "seq_len", "an int in 1..32")
        need(2 <= self.digits <= 64, "digits", "an int in 2..64")
        need(8 <= self.d_model <= 1024, "d_model", "an int in 8..1024")
        need(1 <= self.layers <= 12, "layers", "an int in 1..12")
        need(
            self.heads >= 1 and self.d_model % self.heads == 0,
            "heads",
            f"an int >= 1 that divides d_model ({self.d_model})",
        )
        need(0.0 < self.lr <= 1.0 and math.isfinite(self.lr), "lr", "a float in (0, 1]")
        need(0.0 <= self.kl_coef <= 100.0, "kl_coef", "a float in [0, 100]")
        need(0.0 < self.clip_eps < 1.0, "clip_eps", "a float in (0, 1)")
        need(1 <= self.ppo_steps <= 64, "ppo_steps", "an int in 1..64")
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
        need(
            self.max_grad_norm > 0.0 and math.isfinite(self.max_grad_norm),
            "max_grad_norm",
            "a finite float > 0",
        )
        need(0.05 <= self.temperature <= 10.0, "temperature", "a float in [0.05, 10]")
        need(
            0.0 <= self.reward_latency_s <= 3600.0 and math.isfinite(self.reward_latency_s),
            "reward_latency_s",
            "a float in [0, 3600]",
        )
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "grpo-toy: option 'device' = 'cuda' but CUDA is not available here; "
                "use 'cpu' or 'auto'"
            )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


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


class GrpoToyWorkload(AsyncWorkload):
    """GRPO with a tiny transformer on a digit task; split sampler / trainer state."""

    name = "grpo-toy"
    sampler_backends = ("sampler",)
    trainer_backends = ("trainer",)

    def __init__(self) -> None:
        self.spec: JobSpec | None = None
        self.opts = GrpoToyOptions()
        self._backends: dict[str, TorchBackend] | None = None
        self._rollout: _Rollout | None = None
        self._last_trained: int | None = None
        # Async mode: the batches held by id; the pending buffer is shared by the sampler's
        # thread (loading) and the trainer's (publishing).
        self._batches: dict[int, _Rollout] = {}
        self._pending_lock = threading.Lock()
        # Policy versions (train calls applied), the trainer's and those copied to the pending
        # buffer and into the sampler: a batch whose sampler version is not the trainer's is
        # stale. Only equality matters, so a load() may set all three to any one value.
        self._policy_version = self._pending_version = self._sampler_version = 0

    # ------------------------------------------------------------ setup

    def state_names(self, options: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        # Checked when the job first meets its process: a bad option ends the job at once.
        type(self.opts).parse(options)
        return super().state_names(options)

    def setup(self, spec: JobSpec) -> None:
        if spec.batch_size < 1:
            raise ValueError(f"grpo-toy: batch_size must be >= 1, not {spec.batch_size}")
        if spec.group_size < 1:
            raise ValueError(f"grpo-toy: group_size must be >= 1, not {spec.group_size}")
        opts = type(self.opts).parse(spec.options)
        self.spec, self.opts = spec, opts
        self.device = opts.torch_device()
        self.bos, self.sep = opts.digits, opts.digits + 1
        self.vocab = opts.digits + 2
        self.prompt_len = opts.seq_len + 2  # BOS d1 .. dk SEP

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            policy = _Policy(
                self.vocab, self.prompt_len + opts.seq_len, opts.d_model, opts.layers, opts.heads
            )
        # Trainer: the policy, a frozen reference, Adam with its state created now.
        self.policy = policy.to(self.device)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=opts.lr)
        for p in self.policy.parameters():
            self.optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        # Sampler: its own copy of the weights; pending: the host-side hand-over buffer.
        self.sampler = copy.deepcopy(self.policy).requires_grad_(False).eval()
        self.pending = {
            n: p.detach().to("cpu", copy=True) for n, p in self.policy.named_parameters()
        }
        self._rollout = None
        self._last_trained = None
        self._policy_version = self._pending_version = self._sampler_version = 0

        sampler_backend = TorchBackend()
        sampler_backend.register_module("policy", self.sampler)
        trainer_backend = TorchBackend()
        trainer_backend.register_module("policy", self.policy)
        trainer_backend.register_module("reference", self.reference)
        trainer_backend.register_optimizer("adam", self.optimizer)
        self._backends = {"sampler": sampler_backend, "trainer": trainer_backend}
        for backend in self._backends.values():  # host buffers made now, not at a switch
            backend.reserve_host_buffers()

    def snapshot_backends(self) -> dict[str, TorchBackend]:  # type: ignore[override]
        if self._backends is None:
            raise RuntimeError("grpo-toy: snapshot_backends() called before setup()")
        return self._backends

    # ------------------------------------------------------------ helpers

    def _spec(self) -> JobSpec:
        if self.spec is None:
            raise RuntimeError("grpo-toy: setup() has not run")
        return self.spec

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
        ro = self._rollout
        if ro is None or ro.epoch != epoch:
            have = "none" if ro is None else f"epoch {ro.epoch}"
            raise RuntimeError(
                f"grpo-toy: compute_rewards({epoch}) needs sample({epoch}) to have run in this "
                f"process first (sampled rollouts held: {have})"
            )
        return self._score(ro, ctx)

    def _score(self, ro: _Rollout, ctx: PhaseContext) -> dict[str, float]:
        spec = self._spec()
        ctx.check()
        correct = ro.completions == self._targets(ro.prompts)
        rewards = correct.float().mean(dim=1)
        if self.opts.reward_latency_s:
            ctx.wait(self.opts.reward_latency_s)
        ro.rewards = rewards
        grouped = rewards.view(spec.batch_size, spec.group_size)
        ctx.progress(step=1, of=1)
        return {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std(unbiased=False).item(),
            "group_std_mean": grouped.std(dim=1, unbiased=False).mean().item(),
            "accuracy": correct.all(dim=1).float().mean().item(),
            "digit_accuracy": correct.float().mean().item(),
        }

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        ro = self._rollout
        if ro is None or ro.epoch != epoch or ro.rewards is None:
            have = (
                "none"
                if ro is None
                else f"epoch {ro.epoch}, {'scored' if ro.rewards is not None else 'unscored'}"
            )
            raise RuntimeError(
                f"grpo-toy: train({epoch}) needs compute_rewards({epoch}) to have run in this "
                f"process first (rollouts held: {have})"
            )
        stats = self._train_on(ro, ctx)
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
        self._spec()  # setup() first
        ctx.check()
        rollout, metrics = self._sample_rollout(batch, ctx)
        rollout.behaviour_version = self._sampler_version
        self._batches[batch] = rollout
        return metrics

    def score_batch(self, batch: int, ctx: PhaseContext) -> dict[str, float]:
        ro = self._batches.get(batch)
        if ro is None:
            raise RuntimeError(f"grpo-toy: batch {batch} was not sampled in this process")
        return self._score(ro, ctx)

    def train_batch(self, step: int, batch: int, ctx: PhaseContext) -> dict[str, float]:
        ro = self._batches.pop(batch, None)
        if ro is None or ro.rewards is None:
            raise RuntimeError(f"grpo-toy: batch {batch} is not held scored in this process")
        stats = self._train_on(ro, ctx)
        self._last_trained = step
        return stats

    def publish_weights(self, version: int, ctx: PhaseContext) -> int:
        with self._pending_lock:
            for name, param in self.policy.named_parameters():
                self._copy_in(self.pending[name], param.detach())
            self._pending_version = self._policy_version
        return sum(t.numel() * t.element_size() for t in self.pending.values())

    def load_weights(self, version: int, ctx: PhaseContext) -> int:
        ctx.check()
        with self._pending_lock:
            for name, param in self.sampler.named_parameters():
                self._copy_in(param, self.pending[name])
            self._sampler_version = self._pending_version
        return sum(t.numel() * t.element_size() for t in self.pending.values())

    def drop_batches(self) -> None:
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
        losses, kls, norms, clipped = [], [], [], []
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
            losses.append(loss.item())
            kls.append(kl.item())
            norms.append(norm.item())
            clipped.append(((ratio - 1).abs() > opts.clip_eps).float().mean().item())
            ctx.progress(step=step + 1, of=opts.ppo_steps)
        return {
            "loss": sum(losses) / len(losses),
            "kl": kls[-1],
            "grad_norm": sum(norms) / len(norms),
            "clip_frac": sum(clipped) / len(clipped),
            "optimizer_steps": float(opts.ppo_steps),
        }

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

    def _meta(self) -> dict[str, Any]:
        spec = self._spec()
        return {
            "workload": self.name,
            "seed": spec.seed,
            "options": dict(spec.options),
            "last_trained_epoch": self._last_trained,
        }

    def save(self, directory: Path) -> None:
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
        directory = Path(directory)
        missing = [f for f in _FILES if not (directory / f).is_file()]
        if missing:
            raise FileNotFoundError(f"grpo-toy: checkpoint {directory} lacks {missing}")
        meta = torch.load(directory / "meta.pt", weights_only=True)
        mine = self._meta()
        if meta.get("workload") != self.name or meta.get("seed") != mine["seed"]:
            raise ValueError(
                f"grpo-toy: checkpoint {directory} is for {meta.get('workload')!r} with seed "
                f"{meta.get('seed')!r}, this job is {self.name!r} with seed {mine['seed']!r}"
            )
        if meta.get("options") != mine["options"]:
            raise ValueError(
                f"grpo-toy: checkpoint {directory} was written with options "
                f"{meta.get('options')!r}, this job has {mine['options']!r}"
            )
        trainer = torch.load(directory / "trainer.pt", weights_only=True)
        pending = torch.load(directory / "pending.pt", weights_only=True)
        # Copy into the existing tensors: the backends hold these very objects.
        for module, saved in (
            (self.policy, trainer["policy"]),
            (self.reference, trainer["reference"]),
        ):
            current = module.state_dict()
            if set(saved) != set(current):
                raise ValueError(f"grpo-toy: checkpoint {directory} does not fit this model")
            for key, tensor in current.items():
                self._copy_in(tensor, saved[key])
        params = list(self.policy.parameters())
        if len(trainer["optimizer"]) != len(params):
            raise ValueError(f"grpo-toy: checkpoint {directory} optimizer state does not fit")
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
