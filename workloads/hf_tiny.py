"""A tiny transformers-format policy, its tokenizer and a verifiable digit task, made locally.

Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library from the task's own
alphabet, and the model is a Qwen2 causal LM created from a config with seeded random weights.
Both save and load with ``save_pretrained`` / ``from_pretrained`` like any Hub model, so TRL,
vLLM and the rest of the Hugging Face stack take them as they are.

The task is the one ``grpo-toy`` learns: a prompt is ``^`` + ``seq_len`` random digits + ``=``
(``^3142=``), the completion should be the digits sorted (``1234``; or reversed / copied) and
then end-of-sequence. The reward is the fraction of the ``seq_len`` positions the completion
gets right, so it gives partial credit in [0, 1]. The vocabulary lays out the ten digits as
token ids 0-9, then ``^`` and ``=``, exactly as grpo-toy numbers its tokens, so a grpo-toy
prefix is also this tokenizer's encoding of the prompt.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
except ImportError as err:  # a clean message instead of a bare ImportError deep in a worker
    raise ImportError(
        f"the tiny transformers policy needs transformers and tokenizers ({err}): "
        "pip install 'timeslice[trl]'"
    ) from err

from timeslice.workloads.digit_grpo import TASKS

BOS, SEP = "^", "="
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


@dataclass(frozen=True)
class DigitTask:
    """Prompts of ``seq_len`` digits; the completion is them sorted, reversed or copied."""

    kind: str = "sort"
    seq_len: int = 4

    def __post_init__(self) -> None:
        if self.kind not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, not {self.kind!r}")
        if not 1 <= self.seq_len <= 32:
            raise ValueError(f"seq_len must be in 1..32, not {self.seq_len}")

    def prompt(self, digits: Sequence[int]) -> str:
        return BOS + "".join(str(d) for d in digits) + SEP

    def target(self, digits: Sequence[int]) -> str:
        if self.kind == "sort":
            out = sorted(digits)
        elif self.kind == "reverse":
            out = list(reversed(digits))
        else:
            out = list(digits)
        return "".join(str(d) for d in out)

    def score(self, completion: str, target: str) -> float:
        """The fraction of the target's positions the completion's first characters match."""
        hits = sum(1 for got, want in zip(completion, target, strict=False) if got == want)
        return hits / len(target)

    def rows(self, n: int, seed: int) -> list[dict[str, str]]:
        """``n`` examples ``{"prompt", "target"}`` drawn from ``seed`` (the same list each time)."""
        rng = random.Random(seed)
        rows = []
        for _ in range(n):
            digits = [rng.randrange(10) for _ in range(self.seq_len)]
            rows.append({"prompt": self.prompt(digits), "target": self.target(digits)})
        return rows


def vocabulary() -> dict[str, int]:
    """Digits 0-9 as ids 0-9 (grpo-toy's numbering), then ``^``, ``=`` and the specials."""
    tokens = [str(d) for d in range(10)] + [BOS, SEP, EOS, PAD, UNK]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over the task's alphabet, built with ``tokenizers``."""
    raw = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    # Every character is one token, and decoding joins them back without separators.
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([EOS, PAD, UNK])
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )


@dataclass(frozen=True)
class TinyModelSpec:
    """The policy's size. Defaults: about 0.3 M parameters, head size 64 (what vLLM's
    attention kernels support), a forward pass of a batch in milliseconds on one CPU core."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    intermediate_size: int = 256
    max_positions: int = 64


def build_model(seed: int, spec: TinyModelSpec | None = None) -> Qwen2ForCausalLM:
    """A Qwen2 causal LM over :func:`vocabulary`, its weights drawn from ``seed`` alone
    (inside a forked RNG, so the caller's random state is left as it was)."""
    spec = spec or TinyModelSpec()
    vocab = vocabulary()
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD],
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = vocab[EOS]
    model.generation_config.pad_token_id = vocab[PAD]
    model.generation_config.bos_token_id = vocab[BOS]
    return model


def save_pretrained(directory: Path, model: Qwen2ForCausalLM, tokenizer: Any) -> Path:
    """Write the model and tokenizer as a Hub-format directory (what vLLM and TRL load)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def reward_function(task: DigitTask) -> Any:
    """A TRL reward function for ``task``: one score per completion, from the ``target`` column."""

    def digit_reward(completions: list[str], target: list[str], **_: Any) -> list[float]:
        return [task.score(c, t) for c, t in zip(completions, target, strict=True)]

    digit_reward.__name__ = f"{task.kind}_reward"
    return digit_reward
