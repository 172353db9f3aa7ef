"""The shipped training corpus, a byte-level tokenizer and a deterministic batch sampler.

``data/corpus.txt`` (~100 KB, ASCII) holds public-domain English: the King James Genesis 1-3,
Psalms, Ecclesiastes and 1 Corinthians 13; Carroll's *Alice* (ch. 1-2); Austen's *Pride and
Prejudice* (ch. 1-2); Dickens (*A Tale of Two Cities*, *A Christmas Carol*); Melville's
*Moby-Dick* (ch. 1); the Declaration of Independence, parts of the US Constitution, Lincoln's
Gettysburg and Second Inaugural addresses; Emerson, Thoreau; Shakespeare's sonnets and
speeches; Aesop's fables; Conan Doyle and Mary Shelley. The passages were written out from
memory, so they may differ in places from any printed edition; they exist to give a small model
something real to learn, not to be cited.

Tokens are bytes (vocabulary 256), so any model whose ``vocab_size >= 256`` trains on it with
no tokenizer files. Batches depend only on ``(seed, step)``: every rank of a data-parallel run,
and the single-process baseline it is compared with, draw the same global batch at each step
without any communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

VOCAB_SIZE = 256


def load_text() -> str:
    """The shipped corpus as text."""
    return resources.files("autopar.cli.data").joinpath("corpus.txt").read_text("utf-8")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids in ``[0, 256)``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """Inverse of :func:`encode`; invalid UTF-8 (a model's sample can cut a character) is replaced."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_tokens() -> torch.Tensor:
    return encode(load_text())


@dataclass
class BatchSampler:
    """``batch(step) -> (tokens, targets)``, both int64 ``[batch, seq]``; targets shifted by one.

    Windows start at random offsets drawn from a generator seeded by ``(seed, step)``, not from
    one running stream: a rank that joins late, a resumed run and the baseline all see the same
    step ``k`` batch without replaying steps ``0..k-1``.
    """

    data: torch.Tensor
    batch_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.data.dim() != 1 or self.data.dtype != torch.int64:
            raise ValueError("data must be a 1-D int64 tensor of token ids")
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch ({self.batch_size}) and seq ({self.seq_len}) must be >= 1")
        if self.data.numel() < self.seq_len + 2:
            raise ValueError(
                f"corpus of {self.data.numel()} tokens is too short for seq={self.seq_len}"
            )

    @classmethod
    def from_corpus(cls, batch_size: int, seq_len: int, seed: int = 0) -> BatchSampler:
        return cls(load_tokens(), batch_size, seq_len, seed)

    def state_dict(self, next_step: int) -> dict[str, int]:
        """The position in the data before ``next_step``, as a checkpoint keeps it: the step,
        and what decides every batch (the seed, the shapes, the corpus's length)."""
        return {"step": next_step, "seed": self.seed, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "corpus_tokens": int(self.data.numel())}

    def differences(self, state: dict[str, int]) -> dict[str, tuple[int, int]]:
        """What a saved :meth:`state_dict` asks for that this sampler does not draw:
        ``{field: (saved, ours)}``; empty where resuming from ``state["step"]`` continues the
        same stream of batches."""
        ours = self.state_dict(state.get("step", 0))
        return {k: (state.get(k), v) for k, v in ours.items() if k != "step" and
                state.get(k) != v}

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        hi = self.data.numel() - self.seq_len - 1
        starts = torch.randint(0, hi + 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self.data[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _mix(seed: int, step: int) -> int:
    # A plain ``seed + step`` would make run (seed=0, step=1) replay run (seed=1, step=0).
    return (seed * 0x9E3779B1 + step * 0x85EBCA77 + 0x165667B1) & 0x7FFF_FFFF_FFFF_FFFF
