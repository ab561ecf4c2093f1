"""``hf-grpo``: grpo-toy's GRPO on a transformers-format policy, sampled by torch or by vLLM.

The policy is the tiny Qwen2 causal LM of :mod:`timeslice.workloads.hf_tiny` (created from a
config with seeded weights, its tokenizer built locally) and the task is grpo-toy's digit task,
whose token numbering the tokenizer shares. The algorithm, the split of sampler and trainer
state, the checkpoints and the determinism are grpo-toy's (this class subclasses it); what
changes is the model, and the sampler:

* ``sampler: "torch"`` — the sampler is a second copy of the policy, sampled token by token with
  torch (any device; the CPU in the tests), exactly as grpo-toy samples;
* ``sampler: "vllm"`` — a ``vllm.LLM`` built from the policy saved in Hub format, with
  ``enable_sleep_mode=True``. Each epoch's ``sample`` first loads the trainer's latest weights
  into the engine (``load_weights`` on the worker's model, as TRL's colocate mode does), then
  generates with the epoch's seeds, digits only; the sampler group's switches put the engine to
  sleep and wake it through the ``vllm`` snapshot backend. ``train`` computes the old policy's
  log-probabilities itself (the engine's would be in another precision), so each epoch's first
  optimizer step is exactly on-policy;
* ``sampler: "auto"`` (the default) — vLLM where it imports and a CUDA device is present, else
  torch. Needs a GPU: without one this path is never taken, and its test
  (``tests/gpu/test_vllm_sampler.py``) is skipped.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch
from timeslice.snapshot.base import SnapshotBackend
from timeslice.snapshot.torch_backend import TorchBackend
from timeslice.snapshot.vllm_backend import VllmSleepBackend
from timeslice.workloads.base import JobSpec, PhaseContext
from timeslice.workloads.grpo_toy import GrpoToyWorkload, _Rollout
from timeslice.workloads.hf_tiny import (
    BOS,
    SEP,
    TinyModelSpec,
    build_model,
    build_tokenizer,
    save_pretrained,
    vocabulary,
)
from timeslice.workloads.options import SAMPLERS, HfGrpoOptions, vllm_available
from torch import nn

__all__ = ["SAMPLERS", "HfGrpoOptions", "HfGrpoWorkload", "create", "vllm_available"]


class _Logits(nn.Module):
    """A causal LM as grpo-toy's policies are called: token ids in, logits out."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Every sequence in a batch has the same length (prompts and completions are fixed
        # length), so no attention mask or padding is needed.
        return self.lm(input_ids=tokens, use_cache=False).logits


class HfGrpoWorkload(GrpoToyWorkload):
    """GRPO on a transformers causal LM; torch or vLLM sampler (see the module's doc)."""

    name = "hf-grpo"
    options_type = HfGrpoOptions
    opts: HfGrpoOptions

    def __init__(self) -> None:
        super().__init__()
        self._llm: Any = None
        self._vllm_dir: tempfile.TemporaryDirectory[str] | None = None

    def setup(self, spec: JobSpec) -> None:
        """grpo-toy's trainer on the tiny Qwen2 policy (seeded from ``spec.seed``); the sampler is
        its torch copy, or a vLLM engine (built from the policy saved in Hub format) moved by the
        ``vllm`` backend.

        Args:
            spec: The job; options as :class:`HfGrpoOptions`.

        Raises:
            ValueError: A batch or group size below 1, or a bad option.
        """
        opts: HfGrpoOptions = self._configure(spec)
        self.device = opts.torch_device()
        vocab = vocabulary()
        self.bos, self.sep = vocab[BOS], vocab[SEP]  # 10 and 11: grpo-toy's numbering
        self.vocab = len(vocab)
        self.prompt_len = opts.seq_len + 2
        model_spec = TinyModelSpec(
            hidden_size=opts.d_model,
            layers=opts.layers,
            heads=opts.heads,
            kv_heads=1,
            intermediate_size=2 * opts.d_model,
            max_positions=max(64, self.prompt_len + opts.seq_len),
        )
        lm = build_model(spec.seed, model_spec)
        trainer_backend = self._build_trainer(_Logits(lm))  # as grpo-toy's
        sampler_backend: SnapshotBackend
        if opts.use_vllm():
            self._llm = self._build_engine(lm, spec.seed)
            sampler_backend = VllmSleepBackend(self._llm, level=1)
        else:
            self.sampler = copy.deepcopy(self.policy).requires_grad_(False).eval()
            torch_sampler = TorchBackend()
            torch_sampler.register_module("policy", self.sampler)
            torch_sampler.reserve_host_buffers()  # host buffers made now, not at a switch
            sampler_backend = torch_sampler
        trainer_backend.reserve_host_buffers()
        self._backends = {"sampler": sampler_backend, "trainer": trainer_backend}  # type: ignore[dict-item]

    @property
    def sampler_kind(self) -> str:
        """``vllm`` or ``torch``: the sampler ``setup`` built."""
        return "vllm" if self._llm is not None else "torch"

    # ------------------------------------------------------------ the vLLM sampler

    def _build_engine(self, lm: nn.Module, seed: int) -> Any:
        from vllm import LLM

        self._vllm_dir = tempfile.TemporaryDirectory(prefix="hf-grpo-")
        path = save_pretrained(Path(self._vllm_dir.name), lm, build_tokenizer())
        return LLM(
            model=str(path),
            # The kernels' common precision; load_weights casts the trainer's float32 weights,
            # and train() scores the samples itself, so the sampler's precision never enters
            # the loss.
            dtype="bfloat16",
            seed=seed,
            enable_sleep_mode=True,
            enforce_eager=True,  # no CUDA graphs to capture for a model this small
            gpu_memory_utilization=self.opts.vllm_memory,
            max_model_len=self.prompt_len + self.opts.seq_len,
        )

    def _sync_engine(self) -> None:
        """Load the trainer's latest weights (the host buffer) into the engine's model."""
        weights = [(name.removeprefix("lm."), t) for name, t in self.pending.items()]
        self._llm.collective_rpc(_load_weights, args=(weights,))
        self._llm.reset_prefix_cache()

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """With vLLM: load the trainer's latest weights into the engine, then generate
        ``group_size`` digit-only completions per prompt with the epoch's seeds (log-probs are left
        to :meth:`train`); with torch, grpo-toy's sampling.

        Args:
            epoch: The epoch.
            ctx: The stop check.

        Returns:
            ``completions`` and ``tokens``.

        Raises:
            PhaseStopped: The lease was lost.
        """
        if self._llm is None:
            return super().sample(epoch, ctx)
        from vllm import SamplingParams

        spec = self._spec()
        ctx.check()
        self._sync_engine()
        gen = self._generator(epoch)
        k = self.opts.seq_len
        prompts = torch.randint(0, self.opts.digits, (spec.batch_size, k), generator=gen)
        base_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        requests = [{"prompt_token_ids": row.tolist()} for row in self._prefix(prompts)]
        params = [
            SamplingParams(
                n=spec.group_size,
                max_tokens=k,
                min_tokens=k,
                temperature=self.opts.temperature,
                allowed_token_ids=list(range(self.opts.digits)),  # digits only, as grpo-toy
                seed=base_seed + i,
            )
            for i in range(spec.batch_size)
        ]
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        ctx.check()
        completions = torch.tensor(
            [list(c.token_ids) for out in outputs for c in out.outputs], dtype=torch.long
        )
        n = spec.batch_size * spec.group_size
        self._rollout = _Rollout(
            epoch=epoch,
            prompts=prompts.repeat_interleave(spec.group_size, dim=0),
            completions=completions,
            old_logp=torch.empty(0),  # computed by train from the same weights
        )
        ctx.progress(step=k, of=k)
        return {"completions": float(n), "tokens": float(n * k)}

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """grpo-toy's training; a vLLM-sampled rollout first gets its old-policy log-probs from
        the trainer's own weights, so the first step is exactly on-policy.

        Args:
            epoch: The epoch scored in this process.
            ctx: The stop check.

        Returns:
            grpo-toy's training metrics.

        Raises:
            RuntimeError: The rollout of ``epoch`` is not scored here.
            PhaseStopped: The lease was lost.
        """
        ro = self._rollout
        if (
            self._llm is not None
            and ro is not None
            and ro.epoch == epoch
            and not ro.old_logp.numel()
        ):
            tokens = torch.cat([self._prefix(ro.prompts), ro.completions], dim=1).to(self.device)
            with torch.no_grad():
                ro.old_logp = self._completion_logp(self.policy, tokens).cpu()
        return super().train(epoch, ctx)


def _load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run on each vLLM worker (``collective_rpc``): load new weights into its model."""
    worker.model_runner.model.load_weights(weights=weights)


def create() -> HfGrpoWorkload:
    """The factory a job process calls to build this workload."""
    return HfGrpoWorkload()
