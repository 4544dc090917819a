"""Turns TinyStories text into token files with the committed tokenizer, or with a new one.

Input: text in the TinyStoriesV2 layout, stories separated by lines `<|endoftext|>`.
Output: data/{train,valid}.bin, uint16 ids, each story as BOS ... EOS. By default the
text is encoded with the committed tokenizer/tokenizer.model, the one every shipped
checkpoint embeds; --new-tokenizer trains a new SentencePiece model into --tokenizer
first (and overwrites it), so checkpoints trained on its data need that tokenizer.

    python3 train/prepare.py --train ../shared/tinystories/train.txt --valid ../shared/tinystories/valid.txt
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import sentencepiece as spm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEPARATOR = "<|endoftext|>"
VOCAB_SIZE = 4096
# SentencePiece's default ids: <unk>=0, <s>=1 (BOS), </s>=2 (EOS); 3..258 are the byte pieces.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def read_stories(path):
    """Stories of a TinyStoriesV2-layout file, stripped, empty ones dropped."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stories = []
    story = []
    for line in text.split("\n"):
        if line.strip() == SEPARATOR:
            stories.append("\n".join(story).strip())
            story = []
        else:
            story.append(line)
    stories.append("\n".join(story).strip())
    return [s for s in stories if s]


def train_tokenizer(stories, model_prefix, vocab_size=VOCAB_SIZE):
    os.makedirs(os.path.dirname(model_prefix), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        for s in stories:
            f.write(s.replace("\n", " ") + "\n")  # one story a line
        corpus = f.name
    try:
        spm.SentencePieceTrainer.train(
            input=corpus, model_prefix=model_prefix, model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True, character_coverage=1.0, split_digits=True,
            allow_whitespace_only_pieces=True, normalization_rule_name="identity",
            max_sentence_length=65536, input_sentence_size=2_000_000, shuffle_input_sentence=True,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            num_threads=os.cpu_count(), minloglevel=2)
    finally:
        os.unlink(corpus)


def encode_stories(sp, stories):
    """All stories as one uint16 array, each BOS ... EOS."""
    ids = sp.encode(stories)
    out = []
    for s in ids:
        out.append(BOS_ID)
        out.extend(s)
        out.append(EOS_ID)
    arr = np.array(out, dtype=np.uint16)
    assert arr.max() < sp.get_piece_size()
    return arr


def last_line(error):
    """SentencePiece's errors span lines (a source location, then the reason): the reason."""
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="training text (TinyStoriesV2 layout)")
    ap.add_argument("--valid", required=True, help="validation text (TinyStoriesV2 layout)")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "tokenizer", "tokenizer"),
                    help="model prefix of the tokenizer: PREFIX.model encodes the text (default tokenizer/tokenizer, "
                         "the committed one)")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--out", default=os.path.join(ROOT, "data"), help="where the .bin token files go")
    ap.add_argument("--new-tokenizer", action="store_true",
                    help="train a new tokenizer into --tokenizer (overwriting it) instead of using the existing one")
    # The default since the committed tokenizer stopped being overwritten; kept so older commands still run.
    ap.add_argument("--reuse-tokenizer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.new_tokenizer and args.reuse_tokenizer:
        ap.error("--new-tokenizer and --reuse-tokenizer contradict each other")

    texts = {}
    for name in ("train", "valid"):
        path = getattr(args, name)
        try:
            texts[name] = read_stories(path)
        except FileNotFoundError:
            sys.exit(f"prepare.py: --{name} {path} does not exist; give a TinyStoriesV2-layout text file "
                     "(README.md, 'Training your own checkpoints', says where to get one)")
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"prepare.py: --{name} {path} cannot be read as UTF-8 text: {getattr(e, 'strerror', None) or e}")
    train, valid = texts["train"], texts["valid"]
    print(f"{len(train)} training stories, {len(valid)} validation stories")
    if not train or not valid:
        sys.exit("prepare.py: no stories found (expected stories separated by <|endoftext|> lines)")
    model_file = args.tokenizer + ".model"
    if args.new_tokenizer:
        try:
            train_tokenizer(train, args.tokenizer, args.vocab_size)
        except (OSError, RuntimeError) as e:
            sys.exit(f"prepare.py: training the tokenizer failed: {last_line(e)}")
    elif not os.path.isfile(model_file):
        sys.exit(f"prepare.py: {model_file} is missing; pass --tokenizer PREFIX of an existing PREFIX.model "
                 "(the committed one: git checkout tokenizer/), or train one with --new-tokenizer")
    try:
        sp = spm.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as e:
        sys.exit(f"prepare.py: {model_file} is not a SentencePiece model ({last_line(e)})")
    if (sp.bos_id(), sp.eos_id()) != (BOS_ID, EOS_ID):
        sys.exit(f"prepare.py: {model_file} has BOS {sp.bos_id()} and EOS {sp.eos_id()}; "
                 f"the engine expects {BOS_ID} and {EOS_ID}")
    os.makedirs(args.out, exist_ok=True)
    for name, stories in (("train", train), ("valid", valid)):
        arr = encode_stories(sp, stories)
        path = os.path.join(args.out, name + ".bin")
        arr.tofile(path)
        print(f"{path}: {len(arr):,} tokens ({len(arr) / len(stories):.1f} per story)")


if __name__ == "__main__":
    main()
