"""The documented behaviour at every limit of ./run (docs/ROBUSTNESS.md): the prompt against
the context, -n, -k, -t and --threads at and just past their bounds, and the --ppl story
length. test_cli.py::test_bad_flags and ::test_bad_prompts hold the plain out-of-range
cases; these are the boundaries and the cases they leave out (test_robustness.py: limits
set from outside the flags). The small checkpoints have a 64-token context and the real
4096-piece tokenizer."""
import pytest

from conftest import TOKENIZER, generate_json, run

CONTEXT = 64
VOCAB = 4096


def prompt_of(n_tokens):
    """A prompt that the tokenizer turns into exactly n_tokens ids (BOS not counted)."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    p = " ".join(["cat"] * n_tokens)
    assert len(sp.encode(p)) == n_tokens
    return p


def error(args, code, message):
    """The run fails with exactly `run: message` on stderr, the exit code, nothing on stdout."""
    p = run(args, check=False)
    assert p.returncode == code, (args, p.returncode, p.stderr.decode())
    assert p.stderr.decode() == f"run: {message}\n"
    assert p.stdout == b""


def stop_of(args):
    """(decode steps, why the one sequence stopped) of a --json run; the summary's count of
    stops agrees."""
    _, [sequence], summary = generate_json(args)
    stop = sequence["stop"]
    assert summary["stops"] == {k: int(k == stop.replace(" ", "_")) for k in summary["stops"]}, summary
    return summary["decode_steps"], stop


@pytest.fixture(scope="module")
def ckpt(small_checkpoints):
    return small_checkpoints["gqa"][0]


# ---- the prompt against the context: BOS + prompt must leave room for one token ----

def test_prompt_longer_than_the_context(ckpt):
    error([ckpt, "-p", prompt_of(64)], 1, "the prompt is 65 tokens, longer than the context (64 tokens)")
    error([ckpt, "-p", "word " * 5000], 1, "the prompt is 5001 tokens, longer than the context (64 tokens)")
    error([ckpt, "--check-kv", "-p", prompt_of(64)], 1, "the prompt is 65 tokens, longer than the context (64 tokens)")


def test_prompt_filling_the_context(ckpt):
    error([ckpt, "-p", prompt_of(63)], 1, "the prompt is 64 tokens and fills the whole context (64): no room to generate")


@pytest.mark.parametrize("kv", [[], ["--kv"]])
def test_prompt_one_short_of_the_context(ckpt, kv):
    # 63 positions used: the prefill gives token 64, which fills the context; one more is sampled
    assert stop_of([ckpt, "-p", prompt_of(62), "--ignore-eos", "-s", "1", "-q"] + kv) == (1, "context full")


def test_empty_prompt_starts_from_bos(ckpt):
    args = [ckpt, "-p", "", "-n", "3", "--ignore-eos", "-s", "1", "-q"]
    assert generate_json(args)[2]["prefill_tokens"] == 1 and stop_of(args) == (2, "steps")


# ---- -n: 1..context; past what the prompt leaves, generation stops at the full context ----

def test_steps_bounds(ckpt):
    error([ckpt, "-n", "0"], 2, "-n 0 is out of range (1..1048576)")
    error([ckpt, "-n", str(CONTEXT + 1)], 2, f"-n {CONTEXT + 1} is out of range (1..{CONTEXT}, the context; more with --window)")
    error([ckpt, "-n", "1048577"], 2, "-n 1048577 is out of range (1..1048576)")
    error([ckpt, "-n", "99999999999999999999"], 2, "-n 99999999999999999999 is out of range (1..1048576)")  # past a long
    error([ckpt, "--check-kv", "-n", str(CONTEXT + 1)], 2, f"-n {CONTEXT + 1} is out of range (1..{CONTEXT}, the context)")


@pytest.mark.parametrize("kv", [[], ["--kv"]])
def test_steps_equal_to_the_context_stop_when_it_is_full(ckpt, kv):
    # BOS + 4 prompt tokens: 60 tokens fit, the 60th fills the context, so -n 64 stops there
    args = [ckpt, "-p", "Once upon a time", "--ignore-eos", "-s", "1", "-q"] + kv
    assert stop_of(args + ["-n", str(CONTEXT)]) == (CONTEXT - 5, "context full")
    assert stop_of(args + ["-n", "1"]) == (0, "steps")


# ---- -k: 1..vocab ----

def test_top_k_bounds(ckpt, tmp_path):
    error([ckpt, "-k", "0"], 2, "-k 0 is out of range (1..1048576)")
    error([ckpt, "-k", "-3"], 2, "-k -3 is out of range (1..1048576)")
    error([ckpt, "-k", str(VOCAB + 1)], 2, f"-k {VOCAB + 1} is out of range (1..{VOCAB}, the vocabulary)")
    error([ckpt, "-k", "2000000"], 2, "-k 2000000 is out of range (1..1048576)")
    # the whole vocabulary is a valid top-k; -k 1 is greedy, as -t 0 is
    run([ckpt, "-k", str(VOCAB), "-n", "8", "-s", "5", "-q", "--ignore-eos"])
    greedy_k = run([ckpt, "-p", "Once upon a time", "-k", "1", "-n", "12", "-s", "5", "-q", "--ignore-eos"]).stdout
    greedy_t = run([ckpt, "-p", "Once upon a time", "-t", "0", "-n", "12", "-s", "9", "-q", "--ignore-eos"]).stdout
    assert greedy_k == greedy_t


# ---- -t: 0..100, finite ----

def test_temperature_bounds(ckpt):
    error([ckpt, "-t", "-1"], 2, "-t -1 is out of range (0..100)")
    error([ckpt, "-t", "-0.001"], 2, "-t -0.001 is out of range (0..100)")
    error([ckpt, "-t", "100.5"], 2, "-t 100.5 is out of range (0..100)")
    error([ckpt, "-t", "nan"], 2, "-t needs a number, got 'nan'")
    error([ckpt, "-t", "inf"], 2, "-t inf is out of range (0..100)")
    error([ckpt, "-t", "-inf"], 2, "-t -inf is out of range (0..100)")
    error([ckpt, "-t", "1e39"], 2, "-t 1e39 is out of range (0..100)")   # overflows a float
    error([ckpt, "-t", "0.5x"], 2, "-t needs a number, got '0.5x'")
    for t in ["0", "-0", "100", "1e-3"]:
        run([ckpt, "-t", t, "-n", "4", "-s", "5", "-q", "--ignore-eos"])


# ---- --threads: 1..256 ----

def test_threads_bounds(ckpt):
    error([ckpt, "--threads", "0"], 2, "--threads 0 is out of range (1..256)")
    error([ckpt, "--threads", "-1"], 2, "--threads -1 is out of range (1..256)")
    error([ckpt, "--threads", "257"], 2, "--threads 257 is out of range (1..256)")
    error([ckpt, "--threads", "10000"], 2, "--threads 10000 is out of range (1..256)")
    one = run([ckpt, "--threads", "1", "-k", "1", "-n", "6", "-q", "--ignore-eos"]).stdout
    most = run([ckpt, "--threads", "256", "-k", "1", "-n", "6", "-q", "--ignore-eos"]).stdout
    assert one == most


# ---- --ppl: a story may hold at most 262144 bytes (what the tokenizer takes at once) and 65535 tokens ----

def test_ppl_story_too_long(ckpt, tmp_path):
    text = tmp_path / "long.txt"
    text.write_text("a " * 70000 + "\n<|endoftext|>\n")  # 140,000 bytes
    error([ckpt, "--ppl", text], 1, f"{text}: story 1 is longer than 65535 tokens")
    text.write_text("word " * 70000 + "\n<|endoftext|>\n")  # 350,000 bytes
    error([ckpt, "--ppl", text], 1, f"{text}: story 1 is over 262144 bytes, more than the tokenizer encodes at once")
