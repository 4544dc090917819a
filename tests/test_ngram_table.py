"""The corpus n-gram table (train/ngram.py, --draft TABLE): the builder keeps the contexts
worked out here by hand and writes docs/FORMAT.md's layout; ./run drafts from the shipped
table exactly what the format's definition gives (the draft and acceptance counts of a
greedy run against a simulation in Python); a table of another tokenizer, a cut one, or a
table beside a model without a tokenizer is refused in one line, exit 2."""
import os
import struct
import subprocess
import sys

import pytest

from conftest import PROMPT, ROOT, TOKENIZER, generate_json
from test_spec import refused

import ngram  # train/ngram.py

TABLE = os.path.join(ROOT, "weights", "draft", "tinystories-6gram.ngram")


def read_table(path):
    """{context tuple: next token} and the header, read as docs/FORMAT.md lays the file out."""
    data = open(path, "rb").read()
    assert data[:8] == b"RUNNGRAM"
    version, vocab, orders, zero = struct.unpack_from("<IIII", data, 8)
    (pieces,) = struct.unpack_from("<Q", data, 24)
    counts = struct.unpack_from(f"<{orders}I", data, 32)
    at, table = 32 + 4 * orders, {}
    for n in range(1, orders + 1):
        for _ in range(counts[n - 1]):
            ids = struct.unpack_from(f"<{n + 1}H", data, at)
            at += 2 * (n + 1)
            table[ids[:n]] = ids[n]
    assert at == len(data)
    return table, dict(version=version, vocab=vocab, orders=orders, zero=zero, pieces=pieces)


def test_the_builder_keeps_the_contexts_that_change_a_draft():
    # 2 x "5 6 7", 3 x "9 6 8": after 6, 8 follows 3 times and 7 twice
    sequences = [[1, 5, 6, 7, 2]] * 2 + [[1, 9, 6, 8, 2]] * 3 + [[1, 4, 3, 2]]
    tables = ngram.table(ngram.count(sequences, 3), 3, min_count=2)
    assert tables[1] == {(1,): 9, (5,): 6, (9,): 6, (6,): 8, (7,): 2, (8,): 2}  # (4,), (3,) seen once
    # (5 6) -> 7 overrides (6) -> 8; (9 6) -> 8, (1 5) -> 6, (1 9) -> 6 ... add nothing
    assert tables[2] == {(5, 6): 7}
    assert tables[3] == {}  # (1 5 6) -> 7 is what (5 6) drafts
    # a tie goes to the token the shorter context prefers: after (3), 4 and 5 once each; 5 is
    # the more frequent after nothing at all
    ties = ngram.table(ngram.count([[3, 4], [3, 5], [5, 5], [5, 5]], 1), 1, min_count=1)
    assert ties[1][(3,)] == 5


def test_the_builder_writes_the_format(tmp_path):
    stories = tmp_path / "stories.txt"
    stories.write_text("Lily had a red ball.\n<|endoftext|>\nLily had a red ball.\n<|endoftext|>\nTom had a cat.\n")
    out = tmp_path / "t.ngram"
    subprocess.run([sys.executable, os.path.join(ROOT, "train", "ngram.py"), "--train", stories, "--orders", "4",
                    "--out", out], check=True, capture_output=True)
    table, head = read_table(out)
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=TOKENIZER)
    assert head == dict(version=1, vocab=4096, orders=4, zero=0, pieces=ngram.pieces_hash(sp))
    lily = [ngram.BOS_ID] + sp.encode("Lily had a red ball.") + [ngram.EOS_ID]
    # every token of the story twice told follows its predecessor twice: the 1-token contexts
    # draft the whole story, and "had a" (followed by "red" twice, "cat" once) keeps "red"
    for a, b in zip(lily, lily[1:]):
        assert table[(a,)] == b
    assert all(len(c) == 1 for c in table)
    # the same text, the same bytes
    again = tmp_path / "again.ngram"
    subprocess.run([sys.executable, os.path.join(ROOT, "train", "ngram.py"), "--train", stories, "--orders", "4",
                    "--out", again], check=True, capture_output=True)
    assert again.read_bytes() == out.read_bytes()


def simulate(table, orders, prompt_ids, tokens, k, steps):
    """(drafted, accepted) of greedy speculation with the table against the target's plain
    greedy tokens, as docs/FORMAT.md and the scheduler define them: no draft on the prompt's
    pass; each pass drafts up to k tokens (the longest held context of the sequence's last
    `orders` tokens, drafts included); its rows keep the target's tokens until one differs
    from the draft it was computed on, or the run has its `steps` tokens."""
    seq, generated, drafted, accepted = list(prompt_ids) + [tokens[0]], 1, 0, 0
    while generated < steps:
        draft = []
        while len(draft) < k:
            recent = (seq + draft)[-orders:]
            nxt = next((table[tuple(recent[-n:])] for n in range(len(recent), 0, -1) if tuple(recent[-n:]) in table),
                       None)
            if nxt is None:
                break
            draft.append(nxt)
        drafted += len(draft)
        for j in range(len(draft) + 1):
            token = tokens[generated]
            generated += 1
            seq.append(token)
            done = generated >= steps
            if j < len(draft):
                if done or token != draft[j]:
                    break
                accepted += 1
            if done:
                break
    return drafted, accepted


@pytest.mark.parametrize("variant,k", [("mha", 2), ("gqa", 3), ("mla64", 1)])
def test_drafts_are_the_tables(variant, k):
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=TOKENIZER)
    table, head = read_table(TABLE)
    base = [os.path.join(ROOT, "weights", f"{variant}.bin"), "-p", PROMPT, "-k", 1, "-n", 64, "--kv", "-q",
            "--ignore-eos"]
    _, plain, _ = generate_json(base)
    _, spec, summary = generate_json(base + ["--draft", TABLE, "--draft-k", k])
    assert spec[0]["tokens"] == plain[0]["tokens"]
    prompt_ids = [ngram.BOS_ID] + sp.encode(PROMPT)
    want = simulate(table, head["orders"], prompt_ids, plain[0]["tokens"], k, 64)
    assert (summary["draft_tokens"], summary["draft_accepted"]) == want
    assert want[1] > 10  # the stories' phrases: a real share of the drafts is kept


def test_a_bad_table_is_refused(tmp_path):
    mqa = [os.path.join(ROOT, "weights", "mqa.bin"), "-p", PROMPT, "-n", 4, "--kv"]
    data = open(TABLE, "rb").read()
    other = tmp_path / "other.ngram"  # the pieces' hash of another tokenizer
    other.write_bytes(data[:24] + struct.pack("<Q", struct.unpack_from("<Q", data, 24)[0] ^ 1) + data[32:])
    refused(mqa + ["--draft", other], "tokenizer", "other pieces")
    fewer = tmp_path / "fewer.ngram"
    fewer.write_bytes(data[:12] + struct.pack("<I", 300) + data[16:])
    refused(mqa + ["--draft", fewer], "vocabulary size")
    reserved = tmp_path / "reserved.ngram"
    reserved.write_bytes(data[:20] + struct.pack("<I", 1) + data[24:])
    refused(mqa + ["--draft", reserved], "reserved")
    cut = tmp_path / "cut.ngram"
    cut.write_bytes(data[:-3])
    refused(mqa + ["--draft", cut], "its header gives")
    refused(mqa + ["--draft", tmp_path / "none.ngram"], "none.ngram")
    refused(["--shape", "mqa", "-p", "5 6", "-n", 4, "--kv", "--draft", TABLE], "tokenizer")
