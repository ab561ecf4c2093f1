"""A plain TRL GRPO script, time-sliced by two added lines (each marked ``# timeslice``).

It trains a tiny Qwen2 policy, made locally (no download), to sort four digits with TRL's
``GRPOTrainer`` on the CPU; over the default 120 optimizer steps the mean reward climbs from
about 0.05 to about 0.35 (under a minute alone on one core). Without ``--group`` it is plain
TRL. With it, start a server and a control worker first, then run two of these at once on the
same group (the client finds the server at ``TEMPORAL_ADDRESS``, by default localhost:7233):

    .venv/bin/timeslice server
    .venv/bin/timeslice worker
    .venv/bin/python examples/trl_grpo.py --group gpus-0 --job-id a --seed 1 &
    .venv/bin/python examples/trl_grpo.py --group gpus-0 --job-id b --seed 2

Each holds the group only while it generates or optimises; while one scores its rewards the
other runs, and each job's state leaves the device when the other takes it. ``--report FILE``
writes the rewards, losses and (time-sliced) the phases and moves as JSON; ``--save FILE``
the final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from timeslice.integrations.trl import time_slice  # timeslice (1 of 2)
from timeslice.workloads.hf_tiny import DigitTask, build_model, build_tokenizer, reward_function
from transformers import PrinterCallback
from trl import GRPOConfig, GRPOTrainer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", help="time-slice on this GPU group (default: plain TRL)")
    p.add_argument("--job-id", help="this job's id on the group (default: a fresh one)")
    p.add_argument("--task", default="sort", choices=["sort", "reverse", "copy"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=120, help="optimizer steps")
    p.add_argument("--prompts", type=int, default=16, help="prompts per generation")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--iterations", type=int, default=4, help="optimizer steps per generation")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--report", type=Path, help="write rewards, losses and phases here (JSON)")
    p.add_argument("--save", type=Path, help="write the final weights here (torch.save)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    task = DigitTask(args.task, seq_len=4)
    tokenizer = build_tokenizer()
    model = build_model(args.seed)
    dataset = Dataset.from_list(task.rows(4096, args.seed))
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        num_iterations=args.iterations,
        max_completion_length=task.seq_len + 1,  # the digits, then end-of-sequence
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,  # float32: TRL's default bf16 autocast is several times slower on a CPU
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_function(task),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # one line per generation below, not a dict a step
    trainer.add_callback(_RewardLine())
    # timeslice (2 of 2): time-slice the trainer on the group (plain TRL without --group)
    slicing = time_slice(trainer, group=args.group, job_id=args.job_id) if args.group else None
    trainer.train()

    history = trainer.state.log_history
    report: dict[str, Any] = {
        "job_id": slicing.job_id if slicing else None,
        "group": args.group,
        "seed": args.seed,
        "rewards": [h["reward"] for h in history if "reward" in h],
        "losses": [h["loss"] for h in history if "loss" in h],
    }
    if slicing is not None:
        report |= {
            "phases": [p.as_dict() for p in slicing.phases],
            "snapshots": slicing.snapshots,
            "restores": slicing.restores,
            "bytes_moved": slicing.bytes_moved,
            "lora_only": slicing.lora_only,
            "kept_at_boundaries": slicing.kept_at_boundaries,
            "yielded_at_boundaries": slicing.yielded_at_boundaries,
        }
        print(
            f"{slicing.job_id}: {len(slicing.phases)} phases on {args.group}; state moved out "
            f"{slicing.snapshots} times and back {slicing.restores} times "
            f"({slicing.bytes_moved / 2**20:.1f} MiB); at phase boundaries the group kept "
            f"the lease {slicing.kept_at_boundaries} times and handed it on "
            f"{slicing.yielded_at_boundaries}"
        )
    rewards = report["rewards"]
    print(f"reward: first {rewards[0]:.3f}, last {rewards[-1]:.3f}, best {max(rewards):.3f}")
    if args.report:
        args.report.write_text(json.dumps(report))
    if args.save:
        torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}, args.save)


class _RewardLine(PrinterCallback):
    """Print each generation's mean reward (logs without a reward are optimizer-only steps)."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "reward" in logs:
            print(f"step {state.global_step:4d}  reward {logs['reward']:.3f}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no tokenizer threads on 2 cores
    main()
