#!/usr/bin/env python3
"""bench/spec.py: speculative decoding (issue 43) against plain cached decoding, greedy and sampled.

Three drafters: prompt lookup (`--draft ngram`), the draft model (`--draft DRAFT`, a 2-layer
GQA of dim 256 with the targets' tokenizer) and the corpus table (`--draft TABLE`, the
training stories' 1- to 6-token contexts and the token that most often followed each). For each trained target: decode tokens/s of
plain `--kv` decoding and of each drafter at each K (batch 1), their ratio (the speedup),
the acceptance rate, the tokens a verifying pass keeps and the drafting cost (ms per
generated token, and its share of the steps' time); the acceptance and speedup over held-out
openings (the first words of --openings validation stories, greedy), as the bench prompt
opens most training stories; at batch 16 and 64 the same at one K; sampled (top-k 40, temperature 1) at batch 1;
the cost of a pass over K+1 positions against one cached step (a prefill of K+1 tokens over
the median step); and that ratio for a generated ~1B shape (--shape tinyllama-1.1b), whose
step reads its weights from DRAM, with the speedup the measured acceptance rates would give
there: a projection from measurements, not a run.

    /usr/bin/python3 bench/spec.py [--reps 3] [--ks 1,2,3,4,5,6,7,8] [--ngram-ks 1,2,4,8] [--table-ks 1,2,3,4,6]
                                   [--shape-ks 1,2,4,8] [--n 96] [--batches 16,64] [--sampled-ks 1,2,4] [--targets mha,gqa,...]
                                   [--draft weights/draft/gqa-2x256.bin] [--table weights/draft/tinystories-6gram.ngram]
                                   [--threads N] [--out DIR]
                                   [--valid ../shared/tinystories/valid.txt] [--openings 40] [--opening-ks 1,2,4]

Medians of --reps timed runs after one untimed warm-up run a cell. `make bench-spec` runs it.
Writes DIR/<machine>-spec.md. Greedy tokens are checked equal to plain decoding in every run."""
import argparse
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import BenchError, ORDER, PROMPT, ROOT, log, md_table, read_stories, rel
from bench.engine import engine_json
from bench.machine import write_machine_report

SHAPE = "tinyllama-1.1b"
DRAFT = os.path.join(ROOT, "weights", "draft", "gqa-2x256.bin")
TABLE = os.path.join(ROOT, "weights", "draft", "tinystories-6gram.ngram")
SPEC_COLUMNS = ["target", "drafter", "batch", "K", "plain tok/s", "spec tok/s", "speedup", "accepted",
                "tokens a verifying pass", "drafting ms/token", "drafting share"]  # spec_row's
FIELDS = ("tokens_per_s_mean", "step_ms_median", "prefill_ms", "prefill_tokens", "acceptance_rate", "sequences",
          "tokens_per_verify_pass", "draft_tokens", "draft_ms_total", "draft_time_share")


def generate(args, what):
    objs = engine_json(args, what, "summary")
    return [o["tokens"] for o in objs if o.get("type") == "sequence"], objs[-1]


def cell(base, extra, reps, what, same_as=None):
    """(tokens, median summary fields) over reps timed runs after a warm-up; the tokens checked
    equal to same_as (plain decoding's), when given."""
    generate(base + extra, what)
    runs = [generate(base + extra, what) for _ in range(reps)]
    tokens = runs[0][0]
    if any(t != tokens for t, _ in runs):
        raise BenchError(f"{what}: greedy tokens differ between runs")
    if same_as is not None and tokens != same_as:
        raise BenchError(f"{what}: speculative tokens differ from plain decoding")
    med = {k: statistics.median(s[k] for _, s in runs) for k in FIELDS}
    return tokens, med


def openings(path, n):
    """The first 3 to 8 words (by turns) of the first n stories of a TinyStoriesV2-layout file:
    prompts of held-out text, where the bench's one prompt opens most training stories."""
    try:
        stories = [s.split() for s in read_stories(path)]
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"--valid {path}: {getattr(e, 'strerror', None) or e}")
    if len(stories) < n:
        raise BenchError(f"--valid {path}: {len(stories)} stories, fewer than {n}")
    return [" ".join(words[:3 + i % 6]) for i, words in enumerate(stories[:n])]


def held_out_acceptance(targets, drafters, ks, prompts_file, n, threads, reps=1):
    """Rows of the acceptance and speed over the openings: engine runs serving every opening
    through one slot, plain and a (target, drafter, K); greedy, so the counts are exact, and
    decode tokens/s the median of reps runs after a warm-up, as cell() times."""
    rows = []
    for t in targets:
        base = [os.path.join(ROOT, "weights", f"{t}.bin"), "--prompts", prompts_file, "--batch", 1, "-k", 1, "-n", n,
                "--kv", "--ignore-eos", "-q", "--threads", threads]
        plain_tokens, plain = cell(base, [], reps, f"{t} held out plain")
        for name, drafter, _ in drafters:
            for k in ks:
                _, s = cell(base, ["--draft", drafter, "--draft-k", k], reps, f"{t} {name} K={k} held out",
                            plain_tokens)
                rows.append([t, name, k, s["sequences"], f"{100 * s['acceptance_rate']:.1f}%",
                             f"{s['tokens_per_verify_pass']:.2f}", f"{plain['tokens_per_s_mean']:.1f}",
                             f"{s['tokens_per_s_mean']:.1f}", f"{s['tokens_per_s_mean'] / plain['tokens_per_s_mean']:.2f}x"])
    return rows


def verify_ratio(model_args, ks, reps, threads, what, with_step=False):
    """{K: median prefill ms of K+1 positions / median cached step ms} (and the median of
    those steps, with_step)."""
    out, steps = {}, []
    shape = model_args[0] == "--shape"
    for k in ks:
        # K+1 positions in one pass: BOS and k tokens; generated weights take token ids, and
        # when they get no BOS one id more
        for n in (k, k + 1):
            prompt = " ".join(["5"] * n) if shape else " a" * n
            base = model_args + ["-p", prompt, "-k", 1, "-n", 8, "--kv", "--ignore-eos", "-q", "--threads", threads]
            _, med = cell(base, [], reps, f"{what} verify K={k}")
            if med["prefill_tokens"] >= k + 1:
                break
        if med["prefill_tokens"] != k + 1:
            raise BenchError(f"{what}: the prompt {prompt!r} is {med['prefill_tokens']} positions, not {k + 1}")
        out[k] = med["prefill_ms"] / med["step_ms_median"]
        steps.append(med["step_ms_median"])
    return (out, statistics.median(steps)) if with_step else out


def ints(text):
    """The integers of a comma-separated option ("" gives none)."""
    return [int(x) for x in text.split(",") if x]


def spec_row(t, drafter, b, k, plain, med, generated):
    """A table row: the speedup over plain decoding, acceptance, and the drafting cost a token."""
    return [t, drafter, b, k, f"{plain['tokens_per_s_mean']:.1f}", f"{med['tokens_per_s_mean']:.1f}",
            f"{med['tokens_per_s_mean'] / plain['tokens_per_s_mean']:.2f}x", f"{100 * med['acceptance_rate']:.1f}%",
            f"{med['tokens_per_verify_pass']:.2f}", f"{med['draft_ms_total'] / generated:.4f}",
            f"{100 * med['draft_time_share']:.1f}%"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="K of the draft model at batch 1")
    ap.add_argument("--ngram-ks", default="1,2,4,8", help="K of prompt lookup at batch 1")
    ap.add_argument("--table-ks", default="1,2,3,4,6", help="K of the corpus table at batch 1")
    ap.add_argument("--n", type=int, default=96, help="tokens generated a run")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--batch-k", type=int, default=4, help="K of the batched runs")
    ap.add_argument("--sampled-ks", default="1,2,4", help="K of the sampled runs (batch 1)")
    ap.add_argument("--targets", default=",".join(ORDER))
    ap.add_argument("--draft", default=DRAFT, help="the draft model's checkpoint")
    ap.add_argument("--table", default=TABLE, help="the corpus n-gram table (train/ngram.py)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--shape", default=SHAPE, help="'' leaves the ~1B verify cost and projection out")
    ap.add_argument("--shape-ks", default="1,2,4,8", help="K of the ~1B verify cost and projection")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--valid", default=os.path.join(ROOT, "..", "shared", "tinystories", "valid.txt"),
                    help="held-out stories whose openings the acceptance section drafts from")
    ap.add_argument("--openings", type=int, default=40, help="held-out openings (0 leaves the section out)")
    ap.add_argument("--opening-ks", default="1,2,4", help="K of the held-out acceptance")
    a = ap.parse_args()
    ks = ints(a.ks)
    ngram_ks = ints(a.ngram_ks)
    table_ks = ints(a.table_ks)
    batches = ints(a.batches)
    sampled_ks = ints(a.sampled_ks)
    targets = [t for t in a.targets.split(",") if t]
    drafters = [("ngram", "ngram", ngram_ks), ("model", a.draft, ks), ("table", a.table, table_ks)]
    lines = ["# Speculative decoding (bench/spec.py)", "",
             f"Drafters: prompt lookup (`--draft ngram`), the draft model (`--draft {rel(a.draft)}`) and the "
             f"corpus table (`--draft {rel(a.table)}`). "
             f"{a.n} tokens a sequence from \"{PROMPT}\", --threads {a.threads}, medians of {a.reps} runs after "
             f"a warm-up; greedy unless said. Speedup: decode tokens/s over plain `--kv` decoding's at the same batch. Drafting: "
             f"ms a generated token, and its share of the steps' time. Every run's tokens equal plain "
             f"decoding's (greedy).", ""]
    accept = {}  # (drafter, K): [(tokens a verifying pass, drafting ms a verifying pass)] over the targets
    in_runs = {}  # (target, K): the table runs' median pass over plain decoding's median step
    rows = []
    for t in targets:
        ck = os.path.join(ROOT, "weights", f"{t}.bin")
        base = [ck, "-p", PROMPT, "-k", 1, "-n", a.n, "--kv", "--ignore-eos", "-q", "--threads", a.threads]
        plain_tokens, plain = cell(base, [], a.reps, f"{t} plain")
        log(f"{t}: plain {plain['tokens_per_s_mean']:.1f} tokens/s")
        for name, drafter, dks in drafters:
            for k in dks:
                _, med = cell(base, ["--draft", drafter, "--draft-k", k], a.reps, f"{t} {name} K={k}", plain_tokens)
                passes = med["draft_tokens"] / k if med["draft_tokens"] else 0  # about K drafts a verifying pass
                accept.setdefault((name, k), []).append(
                    (med["tokens_per_verify_pass"], med["draft_ms_total"] / passes if passes else 0.0))
                rows.append(spec_row(t, name, 1, k, plain, med, a.n))
                if name == "table":
                    in_runs[(t, k)] = med["step_ms_median"] / plain["step_ms_median"]
        for b in batches:
            bb = base + ["--batch", b]
            _, p = cell(bb, [], a.reps, f"{t} batch {b} plain")
            for name, drafter, _ in drafters:
                _, s = cell(bb, ["--draft", drafter, "--draft-k", a.batch_k], a.reps, f"{t} {name} batch {b}")
                rows.append(spec_row(t, name, b, a.batch_k, p, s, a.n * b))
    lines += [md_table(SPEC_COLUMNS, rows), ""]
    if a.openings:
        opening_ks = ints(a.opening_ks)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            f.write("\n".join(openings(a.valid, a.openings)) + "\n")
            f.flush()
            orows = held_out_acceptance(targets, drafters, opening_ks, f.name, a.n, a.threads, a.reps)
        lines += [f"## Acceptance and speed over {a.openings} held-out openings", "",
                  f"The speedups above draft from one prompt, \"{PROMPT}\", which opens most training stories. "
                  f"Here the first 3 to 8 words of the first {a.openings} stories of `{os.path.basename(a.valid)}` "
                  f"(`--valid`: text no model trained on) are served one at a time (`--prompts FILE --batch 1`), {a.n} greedy tokens each; "
                  "acceptance and tokens a verifying pass over all of them, and decode tokens/s of the whole run "
                  f"against plain decoding's (medians of {a.reps} runs after a warm-up).", "",
                  md_table(["target", "drafter", "K", "openings", "accepted", "tokens a verifying pass", "plain tok/s",
                            "spec tok/s", "speedup"], orows), ""]
    lines += ["## Sampled: top-k 40, temperature 1, batch 1", "",
              "Rejection sampling keeps the target's distribution, not its tokens: a sampled speculative "
              "run's text differs from the plain run's of the same seed, so the two runs generate different "
              "stories of the same length (`--ignore-eos`).", ""]
    srows = []
    for t in targets:
        ck = os.path.join(ROOT, "weights", f"{t}.bin")
        base = [ck, "-p", PROMPT, "-k", 40, "--temp", 1, "-s", 7, "-n", a.n, "--kv", "--ignore-eos", "-q",
                "--threads", a.threads]
        _, plain = cell(base, [], a.reps, f"{t} sampled plain")
        for name, drafter, _ in drafters:
            for k in sampled_ks:
                _, med = cell(base, ["--draft", drafter, "--draft-k", k], a.reps, f"{t} {name} sampled K={k}")
                srows.append(spec_row(t, name, 1, k, plain, med, a.n))
    lines += [md_table(SPEC_COLUMNS, srows), ""]
    lines += ["## The cost of verifying K+1 positions against one cached step", "",
              "A prefill of K+1 positions (BOS and K tokens) over the median cached step of the same run: the "
              "first pass of a run, its weights not yet in the caches. \"inside table runs\": the median pass "
              "of the corpus table's runs above (its drafting costs microseconds, and it drafts K tokens at "
              "nearly every pass) over plain decoding's median step, so a pass over K+1 positions among "
              "passes alike, as speculation runs them.", ""]
    vrows = []
    vks = sorted(set(ks) | set(ngram_ks) | set(table_ks))
    for t in targets:
        r = verify_ratio([os.path.join(ROOT, "weights", f"{t}.bin")], vks, a.reps, a.threads, t)
        vrows.append([t] + [f"{r[k]:.2f}" for k in vks])
        if any((t, k) in in_runs for k in vks):
            vrows.append([f"{t}, inside table runs"] + [f"{in_runs[(t, k)]:.2f}" if (t, k) in in_runs else ""
                                                        for k in vks])
    if a.shape:
        shape_ks = ints(a.shape_ks)
        # one seed: generated weights follow it, and the runs of a cell must be one model
        shape_r, shape_step = verify_ratio(["--shape", a.shape, "-s", 7], shape_ks, a.reps, a.threads, a.shape,
                                           with_step=True)
        vrows.append([f"{a.shape} (generated)"] + [f"{shape_r[k]:.2f}" if k in shape_r else "" for k in vks])
    lines += [md_table(["model"] + [f"K={k}" for k in vks], vrows), ""]
    if not a.shape:
        return write(a, lines)
    lines += [f"## Projection for {a.shape} (not measured end to end)", "",
              "Speedup = (tokens a verifying pass, mean over the trained targets at that K) / "
              f"(verify-cost ratio of {a.shape} at that K + the drafting ms a verifying pass measured beside "
              f"the trained targets over {a.shape}'s median step of {shape_step:.1f} ms). A projection from "
              "measurements, not a run.", ""]
    prow = []
    for name, _, dks in drafters:
        for k in (k for k in dks if k in shape_r):
            tpp = statistics.mean(x for x, _ in accept[(name, k)])
            cost = statistics.mean(y for _, y in accept[(name, k)]) / shape_step
            prow.append([name, k, f"{tpp:.2f}", f"{shape_r[k]:.2f}", f"{cost:.3f}",
                         f"{tpp / (shape_r[k] + cost):.2f}x"])
    lines += [md_table(["drafter", "K", "tokens a verifying pass", "verify cost", "drafting cost",
                        "projected speedup"], prow), ""]
    write(a, lines)


def write(a, lines):
    log(f"wrote {rel(write_machine_report(a.out, a.threads, 'spec', lines))}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"bench/spec.py: {e}", file=sys.stderr)
        sys.exit(1)
