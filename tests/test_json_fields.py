"""docs/JSON.md lists every field of every --json object: each object of each mode
carries exactly the fields its table lists (the `common` table's too), with the type
given there. The tables are parsed here, so the page and the output cannot drift."""
import os
import re

import pytest

from conftest import PROMPT, ROOT, json_one, run_json

DOC = os.path.join(ROOT, "docs", "JSON.md")
TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def documented():
    """{section: {path: (types, nullable)}} from the page's tables."""
    sections, section = {}, None
    for line in open(DOC, encoding="utf-8"):
        m = re.match(r"## (\S+)", line)
        if m:
            section = sections.setdefault(m.group(1), {})
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if section is None or len(cells) != 5 or cells[0] in ("field", "---") or not line.startswith("|"):
            continue
        kinds = cells[1].split(" or ")
        assert all(k in TYPES or k == "null" for k in kinds), line
        section[cells[0]] = ([k for k in kinds if k != "null"], "null" in kinds)
    return sections


def fields_of(obj, prefix=""):
    """{path: value} of every field, nested objects and arrays of objects included."""
    out = {}
    for key, value in obj.items():
        path = prefix + key
        out[path] = value
        if isinstance(value, dict):
            out.update(fields_of(value, path + "."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for v in value:
                out.update(fields_of(v, path + "[]."))
    return out


def type_ok(value, kinds, nullable):
    if value is None:
        return nullable
    return any(isinstance(value, TYPES[k]) and not (k in ("integer", "number") and isinstance(value, bool))
               for k in kinds)


def check(obj, section_names):
    docs = documented()
    want = {}
    for name in section_names:
        want.update(docs[name])
    got = fields_of(obj)
    # a member of a null object is not there to check
    absent_parents = {p for p, v in got.items() if v is None}
    expected = {p for p in want if not any(p.startswith(a + ".") for a in absent_parents)}
    assert set(got) == expected, f"not documented: {sorted(set(got) - expected)}; missing: {sorted(expected - set(got))}"
    for path, value in got.items():
        kinds, nullable = want[path]
        assert type_ok(value, kinds, nullable), f"{path}: {value!r} is not {kinds}{' or null' if nullable else ''}"


def test_the_page_parses():
    docs = documented()
    assert {"common", "sequence", "summary", "info", "ppl", "check-kv", "check-batch", "check-spec"} <= set(docs)
    assert docs["summary"]["kv_saved_bytes_peak"] == (["integer"], False)
    assert docs["common"]["mla_form"] == (["string"], True)


def test_check_sees_a_missing_field_and_a_wrong_type():
    with pytest.raises(AssertionError):
        check({"type": "info"}, ["common", "info"])
    obj = {"type": "sequence", "index": "0", "prompt": "", "seed": 1, "text": "", "prompt_tokens": 1, "fill": 0,
           "tokens": [], "generated": 0, "stop": "eos", "first_token_ms": 0.1, "prefill_ms": 0.1,
           "decode_ms_per_token_mean": 0.0, "preemptions": 0}
    with pytest.raises(AssertionError, match="index"):
        check(obj, ["sequence"])
    obj["index"] = 0
    check(obj, ["sequence"])


@pytest.mark.parametrize("variant,args", [("gqa", ["--kv", "--batch", 3]), ("mla64", []),
                                          ("mqa", ["--kv", "--profile", "--profile-peaks", "PEAKS"])])
def test_generation(small_checkpoints, variant, args, tmp_path):
    peaks = tmp_path / "roofline.txt"
    peaks.write_text("roofline_threads 2\nbandwidth_best_GBps 50\npeak_best_GFLOPs 400\n")
    args = [str(peaks) if a == "PEAKS" else a for a in args]
    _, objs = run_json([small_checkpoints[variant][0], "-p", PROMPT, "-n", 6, "-s", 1, "-q", "--profile=layers"] + args)
    for obj in objs[:-1]:
        check(obj, ["sequence"])
    check(objs[-1], ["common", "summary"])


def test_info(small_checkpoints):
    check(json_one([small_checkpoints["mla128"][0], "--info"])[1], ["common", "info"])


def test_ppl(small_checkpoints, tmp_path):
    text = tmp_path / "stories.txt"
    long_story = " ".join(["Once upon a time there was a little dog who liked to run."] * 12)
    text.write_text(long_story + "\n<|endoftext|>\nThe cat sat on the mat and slept.\n")
    _, obj = json_one([small_checkpoints["gqa"][0], "--ppl", text])
    assert obj["past_context"] is not None and obj["mean_nll_stderr"] is not None
    check(obj, ["common", "ppl"])


def test_check_kv(small_checkpoints):
    check(json_one([small_checkpoints["mla64"][0], "--check-kv", "-n", 4])[1], ["common", "check-kv"])


def test_check_batch(small_checkpoints):
    check(json_one([small_checkpoints["gqa"][0], "--check-batch", "--batch", 2, "--kv", "-n", 4])[1],
          ["common", "check-batch"])


def test_check_spec(small_checkpoints):
    """A draft model (the small gqa, whose tokenizer is the target's) beside the target."""
    check(json_one([small_checkpoints["gqa"][0], "--check-spec", "--batch", 2, "--kv", "-n", 4,
                    "--draft", small_checkpoints["mqa"][0]])[1], ["common", "check-spec"])
