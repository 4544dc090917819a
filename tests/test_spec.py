"""Speculative decoding (--draft ngram, --draft CKPT and --draft TABLE): greedy output, tokens and the
logits of every emitted position, bit for bit what plain cached decoding gives, on every
trained target, alone and in a batch of prompts where each sequence accepts its own count,
with a pool tight enough to preempt; --check-spec says so; sampled speculation follows the
target's distribution; the summary's speculation figures add up; bad combinations and bad
drafts are refused in one line, exit 2."""
import math
import os
import shutil

import numpy as np
import pytest

from conftest import PROMPT, ROOT, TOKENIZER, VARIANTS, generate_json, json_one, read_logits, run

# a prompt that repeats itself, so that prompt lookup finds drafts the target accepts
REPEATING = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog"


DRAFT = os.path.join(ROOT, "weights", "draft", "gqa-2x256.bin")
TABLE = os.path.join(ROOT, "weights", "draft", "tinystories-6gram.ngram")


def weights(variant):
    return os.path.join(ROOT, "weights", f"{variant}.bin")


def greedy(variant, prompt, extra, dump):
    p, seqs, summary = generate_json([weights(variant), "-p", prompt, "-k", 1, "-n", 48, "--kv", "-q",
                                      "--dump-logits", dump] + extra)
    return seqs[0]["tokens"], np.fromfile(dump, dtype=np.float32), summary


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("prompt", [PROMPT, REPEATING])
def test_speculation_is_bitwise_plain_decoding(tmp_path, variant, prompt):
    plain_tokens, plain_logits, plain = greedy(variant, prompt, [], tmp_path / "plain.bin")
    spec_tokens, spec_logits, spec = greedy(variant, prompt, ["--draft", "ngram", "--draft-k", 5],
                                            tmp_path / "spec.bin")
    assert spec_tokens == plain_tokens
    assert spec_logits.tobytes() == plain_logits.tobytes()  # every emitted position, bitwise
    assert plain["draft"] is None and plain["draft_tokens"] == 0
    assert spec["draft"] == "ngram" and spec["draft_k"] == 5
    assert 0 <= spec["draft_accepted"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["draft_accepted"] / spec["draft_tokens"], abs=1e-4)
    # a verifying pass keeps its accepted drafts and the target's own token: 1 to draft_k + 1
    assert 1.0 <= spec["tokens_per_verify_pass"] <= 1 + spec["draft_k"]
    if prompt == REPEATING:
        assert spec["draft_accepted"] > 0, spec  # the repeated sentence is found and kept
        # each accepted draft saves a step: fewer decode steps than tokens
        assert spec["decode_steps"] < plain["decode_steps"], (spec["decode_steps"], plain["decode_steps"])


@pytest.mark.parametrize("k", [1, 3, 16])
def test_speculation_in_a_batch_of_prompts(tmp_path, k):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([PROMPT, REPEATING, "Lily had a red ball. Lily had a", PROMPT, "Tom ran and ran and"]) + "\n")
    base = [weights("mqa"), "--prompts", prompts, "--batch", 3, "-k", 1, "-n", 40, "--kv", "-q"]
    _, plain, _ = generate_json(base)
    _, spec, summary = generate_json(base + ["--draft", "ngram", "--draft-k", k])
    assert [s["tokens"] for s in spec] == [s["tokens"] for s in plain]
    assert summary["draft_accepted"] > 0 and summary["draft_tokens"] >= summary["draft_accepted"]
    assert summary["tokens_per_verify_pass"] >= 1.0


@pytest.mark.parametrize("drafter", ["ngram", DRAFT])
def test_sampled_speculation_in_a_batch_is_each_sequence_alone(drafter):
    """Sampled (-k 40), a batch of 3 with --draft: sequence i is its run alone with seed s+i,
    while the pool holds every sequence (README's promise; a preemption changes when a
    sequence drafts, and sampled speculation's draws follow its drafts)."""
    base = [weights("mha"), "-p", REPEATING, "-k", 40, "-n", 60, "--kv", "-q", "--ignore-eos",
            "--draft", drafter, "--draft-k", 4]
    _, batch, summary = generate_json(base + ["--batch", 3, "-s", 11])
    assert summary["draft_accepted"] > 0 and summary["preemptions"] == 0
    for i, seq in enumerate(batch):
        _, alone, _ = generate_json(base + ["-s", 11 + i])
        assert seq["tokens"] == alone[0]["tokens"], i
    assert len({tuple(s["tokens"]) for s in batch}) == 3


@pytest.mark.parametrize("drafter", ["ngram", DRAFT])
def test_sampled_speculation_drafts_as_alone_beside_long_prompts_and_streaming(tmp_path, drafter):
    """A draft model catches up on a sequence's prompt at its first decode step. Two prompts
    of 128 tokens, prefilled in one step, reached it together, one token more than a pass of
    the context (256) takes: the second drafted nothing that step (the catch-up shared one budget), so its sampled tokens
    were not its run alone's (seed s+1). A cache streamed from the tier never drafted: the
    target's pool had no room behind the last token, the draft's pool (as many blocks as the
    target's) none for the prompt. Now the catch-up takes the passes it needs, a streamed
    sequence spills for its drafts as for its tokens, and the draft's pool holds its context:
    the batch's sequences are each their run alone, the tier's run is the run without it."""
    words = "once upon a time there was a little girl named lily she loved to play in the sun".split()

    def text(n, step):
        return " ".join(words[(i * step) % len(words)] for i in range(n))

    prompts = [text(127, 3), text(120, 5)]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    base = [weights("gqa"), "--kv", "-q", "-n", 12, "-k", 40, "--ignore-eos", "--draft", drafter, "--draft-k", 4]
    _, batch, summary = generate_json(base + ["--prompts", path, "--batch", 2, "-s", 1])
    assert [s["prompt_tokens"] for s in batch] == [128, 128] and summary["preemptions"] == 0, batch
    for i, seq in enumerate(batch):
        _, alone, _ = generate_json(base + ["-p", prompts[i], "-s", 1 + i])
        assert seq["tokens"] == alone[0]["tokens"], i
    # a pool of 0.9 MiB streams a prompt of 230 words through a few blocks
    long_prompt = text(230, 7)
    _, plain, without = generate_json(base + ["-p", long_prompt, "-s", 3])
    _, tiered, tier = generate_json(base + ["-p", long_prompt, "-s", 3, "--kv-mem", 0.9,
                                            "--kv-offload", tmp_path / "tier"])
    assert tier["tier_stream_blocks"] > 0 and without["tier_stream_blocks"] == 0, tier
    assert tier["draft_tokens"] == without["draft_tokens"] > 0
    assert tiered[0]["tokens"] == plain[0]["tokens"]


def test_drafts_without_room_are_counted():
    """Three copies of a 125-token prompt in a pool of 16 blocks: the target's caches share
    the prompt's blocks, the draft model's do not, and its pool (as many blocks as the
    target's) runs short: those sequences' steps draft nothing, which README's exemption
    covers and the summary counts (drafts_without_room). Greedy, the tokens stay the plain
    run's; with room, none is counted."""
    words = "once upon a time there was a little girl named lily she loved to play in the sun".split()
    prompt = " ".join(words[(i * 3) % len(words)] for i in range(124))
    base = [weights("gqa"), "-p", prompt, "-n", 9, "--kv", "-q", "--ignore-eos", "-k", 1, "--batch", 3]
    _, plain, _ = generate_json(base)
    _, tight, summary = generate_json(base + ["--draft", DRAFT, "--kv-mem", 1.03])
    _, roomy, with_room = generate_json(base + ["--draft", DRAFT])
    assert summary["preemptions"] == 0 and summary["drafts_without_room"] > 0, summary
    assert with_room["drafts_without_room"] == 0 and with_room["draft_tokens"] > summary["draft_tokens"]
    assert [s["tokens"] for s in tight] == [s["tokens"] for s in roomy] == [s["tokens"] for s in plain]


def test_the_draft_path_is_masked_in_the_summary(tmp_path):
    """The speculation line printed --draft's path raw: a name holding an escape sequence
    reached the terminal. It goes through msg_path now, as every other path does."""
    named = tmp_path / "draft\x1b[2J.bin"
    os.symlink(DRAFT, named)
    p = run([weights("gqa"), "--kv", "--draft", named, "-n", 8, "-k", 1, "-q"])
    err = p.stderr.decode()
    assert "speculation: " in err and "\x1b" not in err, err


def test_a_tight_pool_rolls_back_and_still_matches(tmp_path):
    """A pool of few blocks: drafts that find no room decode plainly, preemption and the
    rollback leave the tokens as they were."""
    base = [weights("gqa"), "-p", REPEATING, "--batch", 4, "-k", 1, "-n", 60, "--kv", "-q", "--kv-mem", "1.1"]
    _, plain, _ = generate_json(base)
    _, spec, summary = generate_json(base + ["--draft", "ngram", "--draft-k", 8])
    assert [s["tokens"] for s in spec] == [s["tokens"] for s in plain]
    assert summary["preemptions"] > 0, summary
    # some drafts were rejected, so their cache rows were rolled back; some were kept
    assert summary["draft_tokens"] > summary["draft_accepted"] > 0, summary


@pytest.mark.parametrize("args,says", [
    (["--draft", "ngram"], "--draft speculates on the cache: it needs --kv"),
    (["--kv", "--draft", "ngram", "--draft-k", 0], "--draft-k 0 is out of range (1..16)"),
    (["--kv", "--draft", "ngram", "--draft-k", 17], "--draft-k 17 is out of range (1..16)"),
    (["--kv", "--draft-k", 4], "--draft-k needs --draft"),
    (["--kv", "--draft", "ngram", "--window", 64], "takes no --window (a ring cannot be rolled back)"),
    (["--kv", "--draft", DRAFT, "--draft-k", 17], "--draft-k 17 is out of range (1..16)"),
    (["--draft", DRAFT], "--draft speculates on the cache: it needs --kv"),
    (["--kv", "--check-spec"], "--check-spec needs --draft"),
])
def test_bad_draft_flags(args, says):
    p = run([weights("mqa"), "-p", PROMPT, "-n", 4, "-k", 1] + args, check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run: ") and says in lines[0], lines


# ---- the draft model (--draft CKPT) ----

@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_model_is_bitwise_plain_decoding(tmp_path, variant):
    plain_tokens, plain_logits, _ = greedy(variant, PROMPT, [], tmp_path / "plain.bin")
    spec_tokens, spec_logits, spec = greedy(variant, PROMPT, ["--draft", DRAFT, "--draft-k", 4], tmp_path / "spec.bin")
    assert spec_tokens == plain_tokens
    assert spec_logits.tobytes() == plain_logits.tobytes()  # every emitted position, bitwise
    assert spec["draft"] == DRAFT and spec["draft_k"] == 4
    # the draft model proposes at every decode step but those near the end
    assert spec["draft_tokens"] > 0 and 0 <= spec["draft_accepted"] <= spec["draft_tokens"]
    assert spec["draft_ms_total"] > 0 and 0 < spec["draft_time_share"] < 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_model_in_a_batch_of_prompts(tmp_path, variant):
    """Five prompts through three slots: each sequence accepts its own count, the tokens are
    plain decoding's, and --check-spec compares every emitted position's logits bitwise."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([PROMPT, REPEATING, "Lily had a red ball. Lily had a", PROMPT, "Tom ran and ran and"]) + "\n")
    base = [weights(variant), "--prompts", prompts, "--batch", 3, "-k", 1, "-n", 40, "--kv", "-q"]
    _, plain, _ = generate_json(base)
    _, spec, summary = generate_json(base + ["--draft", DRAFT, "--draft-k", 6])
    assert [s["tokens"] for s in spec] == [s["tokens"] for s in plain]
    assert summary["draft_accepted"] > 0 and summary["draft_tokens"] >= summary["draft_accepted"]
    rc, check = json_one(base[:-1] + ["--draft", DRAFT, "--draft-k", 6, "--check-spec"])
    assert rc == 0 and check["identical"] is True
    assert [s["bitwise_identical"] for s in check["sequences"]] == [True] * 5
    assert [s["steps"] for s in check["sequences"]] == [len(s["tokens"]) for s in plain]


def test_draft_model_with_a_tight_pool_preempts_and_matches(tmp_path):
    """A pool of 17 blocks for four sequences: one is preempted, its draft cache freed and
    rebuilt from its tokens; the tokens stay plain decoding's."""
    base = [weights("gqa"), "-p", REPEATING, "--batch", 4, "-k", 1, "-n", 60, "--kv", "-q", "--kv-mem", "1.1"]
    _, plain, _ = generate_json(base)
    _, spec, summary = generate_json(base + ["--draft", DRAFT, "--draft-k", 8])
    assert summary["preemptions"] > 0
    assert [s["tokens"] for s in spec] == [s["tokens"] for s in plain]
    rc, check = json_one(base[:-3] + ["--kv-mem", "1.1", "--draft", DRAFT, "--draft-k", 8, "--check-spec"])
    assert rc == 0 and check["identical"] is True


@pytest.mark.parametrize("drafter", ["ngram", DRAFT, TABLE])
def test_check_spec_on_every_target(drafter):
    for variant in VARIANTS:
        base = [weights(variant), "-p", REPEATING, "-n", 40, "--kv", "--batch", 2, "--draft", drafter, "--ignore-eos"]
        rc, check = json_one(base + ["--check-spec"])
        assert rc == 0 and check["identical"] is True and check["batch"] == 2, check
        assert check["sequences_identical"] == 2
        assert [(s["steps"], s["bitwise_identical"], s["first_difference"]) for s in check["sequences"]] == \
            [(40, True, -1)] * 2
        _, _, summary = generate_json(base + ["-q", "-k", 1])
        assert summary["draft_tokens"] > 0, summary  # the check compared runs that speculated


# ---- sampled speculation ----

def chi_square_p(observed, expected):
    """The p-value of Pearson's chi-square for counts against expected counts (bins under 5
    expected merged into one)."""
    from scipy.stats import chi2
    big = [i for i in range(len(expected)) if expected[i] >= 5]
    small = [i for i in range(len(expected)) if expected[i] < 5]
    obs = [observed[i] for i in big] + ([sum(observed[i] for i in small)] if small else [])
    exp = [expected[i] for i in big] + ([sum(expected[i] for i in small)] if small else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return chi2.sf(stat, len(obs) - 1)


# its first token is often one of the prompt's, where prompt lookup finds a draft
SAMPLED = "Lily saw a big red ball and Tom saw a big red ball and Lily saw a big"


@pytest.mark.parametrize("drafter", ["ngram", DRAFT, TABLE])
def test_sampled_speculation_follows_the_target(tmp_path, drafter):
    """The second token of 1024 seeds (-k 8 -t 1.5), the first one verified against a draft,
    among the seeds whose first token is the most common of those the prompt holds (so that
    prompt lookup drafts after it): its counts against the target's distribution after that
    token, the top 8 of the logits --dump-logits gives at that position, softmax at 1.5. A
    drafter's tokens kept without the acceptance test (q's distribution, a point mass for
    prompt lookup, instead of p's) or a residual drawn wrongly moves the counts away."""
    import sentencepiece
    in_prompt = set(sentencepiece.SentencePieceProcessor(model_file=TOKENIZER).encode(SAMPLED))
    K, T, B = 8, 1.5, 256
    first, second = {}, {}
    for s in range(4):
        _, seqs, summary = generate_json([weights("mha"), "-p", SAMPLED, "--batch", B, "-s", 1000 + s * B, "-k", K,
                                          "-t", T, "-n", 2, "--kv", "--kv-mem", 80, "-q", "--ignore-eos",
                                          "--draft", drafter, "--draft-k", 3])
        assert summary["draft_tokens"] > 0
        for q in seqs:
            first.setdefault(q["tokens"][0], []).append(q["seed"])
            second.setdefault(q["tokens"][0], []).append(q["tokens"][1])
    top = max((t for t in first if t in in_prompt), key=lambda t: len(first[t]))
    seed = first[top][0]
    dump = tmp_path / "logits.bin"
    run([weights("mha"), "-p", SAMPLED, "-s", seed, "-k", K, "-t", T, "-n", 2, "--kv", "-q", "--ignore-eos",
         "--dump-logits", dump])
    logits = np.fromfile(dump, dtype=np.float32).reshape(2, -1)[1].astype(np.float64)
    best = np.argsort(-logits, kind="stable")[:K]
    p = np.exp((logits[best] - logits[best[0]]) / T)
    p /= p.sum()
    n = len(second[top])
    assert n >= 100, n
    counts = [second[top].count(int(t)) for t in best]
    assert sum(counts) == n  # nothing outside the target's top 8
    assert chi_square_p(counts, list(p * n)) > 1e-4, (counts, list(p * n))


# ---- bad drafts ----

def tokenizer_of(tmp_path_factory, name, words):
    """A 300-piece tokenizer trained here on sentences of these words."""
    import prepare
    rng = np.random.default_rng(0)
    prefix = str(tmp_path_factory.mktemp(name) / "tok")
    prepare.train_tokenizer([" ".join(rng.choice(words.split(), 20)) for _ in range(50)], prefix, vocab_size=300)
    return prefix + ".model"


@pytest.fixture(scope="module")
def other_vocabularies(tmp_path_factory):
    """(target, draft of the same tokenizer, draft of another tokenizer of as many pieces), small
    random models of a 300-piece vocabulary."""
    import export
    a = tokenizer_of(tmp_path_factory, "a", "once upon a time there was little cat who liked to play in the sun with her friend")
    b = tokenizer_of(tmp_path_factory, "b", "the big brown dog ran fast over green hills and jumped into cold blue water today")
    d = tmp_path_factory.mktemp("models")
    paths = []
    for name, tok, seed in (("target", a, 1), ("same", a, 2), ("other", b, 3)):
        model = export.random_model("gqa", small=True, seed=seed, vocab_size=300)
        paths.append(str(d / f"{name}.bin"))
        export.export(model, paths[-1], tok, dtype="bf16")
    return paths


def refused(args, *words):
    p = run(args, check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "draft" in lines[0], lines
    for w in words:
        assert w in lines[0], lines
    return lines[0]


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(other_vocabularies):
    target, same, other = other_vocabularies
    # a draft of the committed 4096-piece tokenizer beside a 300-piece target, and the other way round
    refused([target, "-p", PROMPT, "-n", 4, "--kv", "--draft", DRAFT], "vocabulary")
    refused([weights("mqa"), "-p", PROMPT, "-n", 4, "--kv", "--draft", same], "vocabulary")
    # as many pieces, other pieces
    refused([target, "-p", PROMPT, "-n", 4, "--kv", "--draft", other], "tokenizer")
    p = run([target, "-p", PROMPT, "-n", 8, "-k", 1, "--kv", "--draft", same, "--check-spec"], check=False)
    assert p.returncode == 0, p.stderr  # the positive control: the same tokenizer is taken


def test_a_missing_or_corrupt_draft_is_refused(tmp_path):
    refused([weights("mqa"), "-p", PROMPT, "-n", 4, "--kv", "--draft", tmp_path / "none.bin"], "none.bin")
    cut = tmp_path / "cut.bin"
    with open(DRAFT, "rb") as f:
        cut.write_bytes(f.read()[:100000])
    refused([weights("mqa"), "-p", PROMPT, "-n", 4, "--kv", "--draft", cut])
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a checkpoint at all" * 100)
    refused([weights("mqa"), "-p", PROMPT, "-n", 4, "--kv", "--draft", junk])
