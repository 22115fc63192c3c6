"""Offline assets for ``torchtitan_train.py``: a tokenizer and a text data set, made here.

torchtitan's wheel ships neither its test tokenizer nor its ``c4_test`` data (its registry
points into the test assets of a torchtitan source checkout), and the example must run without a
network. ``make_assets(DIR)`` writes::

    DIR/tokenizer/tokenizer.json, tokenizer_config.json   a 512-entry byte-level BPE
    DIR/data/data.jsonl                                    400 {"text": ...} documents

Both are deterministic for a given seed. A directory that already holds them is left as
it is, so that every run of a comparison trains on the very same files: make them once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

__all__ = ["data_dir", "make_assets", "tokenizer_dir"]

_TEXT = (
    "the a an of to and in is was for on that with as by at from it this be are or his her they we "
    "you not but have had has which one all were when there can their been if more will would who so "
    "no time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education"
)
WORDS = _TEXT.split()

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def tokenizer_dir(root: str) -> str:
    return os.path.join(root, "tokenizer")


def data_dir(root: str) -> str:
    return os.path.join(root, "data")


def documents(n_docs: int = 400, seed: int = 0) -> list[str]:
    """Sentences of common English words: enough structure for a loss that falls."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))).capitalize() + "."
                     for _ in range(rng.randint(2, 8))]
        docs.append(" ".join(sentences))
    return docs


def make_assets(root: str, *, seed: int = 0) -> str:
    """Write the tokenizer and the data set under ``root`` unless they are there; returns ``root``.

    Written into a temporary directory and renamed into place, so that a reader never sees
    half of them (two processes making them at once: one rename wins, both are identical)."""
    if os.path.exists(os.path.join(tokenizer_dir(root), "tokenizer.json")) and \
            os.path.exists(os.path.join(data_dir(root), "data.jsonl")):
        return root
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".making-")
    try:
        docs = documents(seed=seed)
        _write_data(data_dir(tmp), docs)
        _write_tokenizer(tokenizer_dir(tmp), docs)
        for sub in ("tokenizer", "data"):
            try:
                os.rename(os.path.join(tmp, sub), os.path.join(root, sub))
            except OSError:
                if not os.path.isdir(os.path.join(root, sub)):  # another process won: same files
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _write_data(path: str, docs: list[str]) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "data.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)


def _write_tokenizer(path: str, docs: list[str]) -> None:
    # `tokenizers` comes with torchtitan (its HuggingFaceTokenizer reads what this writes).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False}, f)


if __name__ == "__main__":
    import sys

    print(make_assets(sys.argv[1]))
