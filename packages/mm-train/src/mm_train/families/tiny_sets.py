"""What the built-in tiny sets of both wings share: their colours and their tokenizer trainer."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

# Deferred imports: tokenizers (optional: a missing one is named when a run needs it).

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "white": (245, 245, 245), "black": (15, 15, 15)}


def train_tokenizer(texts: List[str], path: Path, special: List[str], vocab_size: int = 300,
                    unk_token: Optional[str] = None) -> None:
    """A byte-level BPE tokenizer trained on ``texts`` with ``special`` tokens, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=unk_token))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
