"""Every output of ./run is checked (docs/ROBUSTNESS.md, Outputs): a stdout, --log or
--dump-logits that cannot be written gives one line on stderr and a non-zero exit; SIGINT
and SIGTERM stop a generation at a step boundary with whole CSV lines; an output that is
one of the run's inputs is refused before anything is truncated; a FIFO never hangs."""
import hashlib
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import PROMPT, RUN, run

COLUMNS = "step,phase,sequences,n_tokens,pos,token,ms".split(",")
# a generation that runs far longer than any test waits: a window lets it pass the context
ENDLESS = ["--kv", "--window", 32, "-n", 1000000, "--ignore-eos", "-q"]


def args_of(args):
    return [RUN] + [str(a) for a in args]


def one_error_line(p, code, message):
    err = p.stderr.decode()
    assert p.returncode == code, (p.returncode, err)
    assert err.endswith(f"run: {message}\n") and err.count("run: ") == 1, err


@pytest.fixture(scope="module")
def ckpt(small_checkpoints):
    return small_checkpoints["gqa"][0]


# ---- outputs that cannot be written ----

@pytest.mark.parametrize("mode", [[], ["--json"], ["--info"], ["--check-kv"], ["--batch", 2, "--kv"]])
def test_full_stdout(ckpt, mode):
    with open("/dev/full", "wb") as full:
        p = subprocess.run(args_of([ckpt, "-p", PROMPT, "-n", 5, "-q"] + mode), stdout=full, stderr=subprocess.PIPE,
                           timeout=120)
    one_error_line(p, 1, "cannot write standard output: No space left on device")


def test_full_stdout_for_ppl(ckpt, tmp_path):
    text = tmp_path / "stories.txt"
    text.write_text("The cat sat.\n<|endoftext|>\n")
    with open("/dev/full", "wb") as full:
        p = subprocess.run(args_of([ckpt, "--ppl", text]), stdout=full, stderr=subprocess.PIPE, timeout=120)
    one_error_line(p, 1, "cannot write standard output: No space left on device")


@pytest.mark.parametrize("flag", ["--log", "--dump-logits"])
def test_full_output_file(ckpt, flag):
    p = run([ckpt, "-p", PROMPT, "-n", 5, "-q", flag, "/dev/full"], check=False)
    one_error_line(p, 1, "cannot write /dev/full: No space left on device")


def test_closed_stdout(ckpt):
    p = subprocess.run(args_of([ckpt, "-n", 5, "-q"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       preexec_fn=lambda: os.close(1), timeout=120)
    one_error_line(p, 1, "cannot write standard output: it is closed")


def test_broken_pipe_with_sigpipe_ignored(ckpt):
    p = subprocess.Popen(args_of([ckpt, "-p", PROMPT] + ENDLESS), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGPIPE, signal.SIG_IGN))
    assert p.stdout.read(64).startswith(PROMPT.encode())
    p.stdout.close()                        # the reader goes away; the next write fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1, err
    assert err.endswith("run: cannot write standard output: Broken pipe\n"), err


# ---- a signal stops the generation at a step boundary ----

@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("form", [[], ["--json"]])
def test_signal_leaves_whole_csv_lines(ckpt, tmp_path, sig, code, form):
    log, out = tmp_path / "steps.csv", tmp_path / "story.txt"
    with open(out, "wb") as story:
        p = subprocess.Popen(args_of([ckpt, "-p", PROMPT, "--log", log] + ENDLESS + form), stdout=story,
                             stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while (not log.exists() or log.read_text().count("\n") < 20) and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(sig)
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == code, err
    text = log.read_text()
    assert text.endswith("\n")
    lines = text.split("\n")[:-1]
    assert lines[0].split(",") == COLUMNS and len(lines) > 20
    for i, line in enumerate(lines[1:]):
        cells = line.split(",")
        assert len(cells) == len(COLUMNS) and int(cells[0]) == i and float(cells[6]) >= 0, line
    assert out.read_bytes().endswith(b"\n")
    if not form:   # the story, its line ended
        assert out.read_bytes().startswith(PROMPT.encode())
        return
    # the summary counts the steps the log holds, and says why the run ended
    [sequence, summary] = [json.loads(line) for line in out.read_text().splitlines()]
    assert sequence["text"].startswith(PROMPT) and sequence["stop"] == "interrupted"
    assert summary["type"] == "summary" and summary["decode_steps"] == len(lines) - 2, (summary, len(lines))
    assert summary["stops"]["interrupted"] == 1, summary


def test_a_signal_ignored_at_start_stays_ignored(ckpt, tmp_path):
    """A run started with SIGINT ignored, as a shell starts a background job, goes on through
    SIGINT (the terminal's Ctrl-C meant the foreground); SIGTERM still ends it."""
    log = tmp_path / "steps.csv"

    def lines():
        return log.read_text().count("\n") if log.exists() else 0

    def wait_for(n):
        deadline = time.monotonic() + 120
        while lines() < n and time.monotonic() < deadline:
            time.sleep(0.05)

    p = subprocess.Popen(args_of([ckpt, "-p", PROMPT, "--log", log] + ENDLESS), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    wait_for(20)
    p.send_signal(signal.SIGINT)
    wait_for(lines() + 20)
    assert p.poll() is None, p.stderr.read().decode()
    p.send_signal(signal.SIGTERM)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 143, err


# ---- an output that is an input, or a file that is no file ----

def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_output_that_is_an_input_is_refused(ckpt, tmp_path):
    before = digest(ckpt)
    p = run([ckpt, "-n", 3, "--log", ckpt], check=False)
    one_error_line(p, 2, f"cannot write {ckpt}: it is the checkpoint")
    link = tmp_path / "link.bin"                    # another name for it: the inode decides
    link.symlink_to(ckpt)
    p = run([ckpt, "-n", 3, "--dump-logits", link], check=False)
    one_error_line(p, 2, f"cannot write {link}: it is the checkpoint")
    assert digest(ckpt) == before
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT + "\n")
    hard = tmp_path / "hard.txt"
    os.link(prompt, hard)
    p = run([ckpt, "-f", prompt, "-n", 3, "--log", hard], check=False)
    one_error_line(p, 2, f"cannot write {hard}: it is the prompt file")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    p = run([ckpt, "--prompts", prompts, "-n", 3, "--log", prompts], check=False)
    one_error_line(p, 2, f"cannot write {prompts}: it is the --prompts file")
    assert prompt.read_text() == PROMPT + "\n" and prompts.read_text() == "a\nb\n"
    both = tmp_path / "both.out"
    p = run([ckpt, "-n", 3, "--log", both, "--dump-logits", both], check=False)
    one_error_line(p, 2, f"cannot write {both}: it is the --log file")
    p = run([ckpt, "-n", 3, "--log", tmp_path], check=False)
    one_error_line(p, 2, f"cannot write {tmp_path}: it is a directory")


def test_output_that_is_a_draft_or_peaks_file_is_refused(ckpt, tmp_path):
    """--draft's checkpoint or table and --profile-peaks' file are inputs too; --dump-attn
    may not share a file with --dump-logits."""
    draft = tmp_path / "draft.bin"
    draft.write_bytes(open(ckpt, "rb").read())
    before = digest(draft)
    p = run([ckpt, "-n", 3, "--kv", "--draft", draft, "--log", draft], check=False)
    one_error_line(p, 2, f"cannot write {draft}: it is the --draft file")
    assert digest(draft) == before
    peaks = tmp_path / "peaks.txt"
    peaks.write_text("bandwidth_best_GBps 50\npeak_best_GFLOPs 400\nroofline_threads 2\n")
    p = run([ckpt, "-n", 3, "--profile", "--profile-peaks", peaks, "--dump-logits", peaks], check=False)
    one_error_line(p, 2, f"cannot write {peaks}: it is the --profile-peaks file")
    assert peaks.read_text().startswith("bandwidth_best_GBps 50")
    both = tmp_path / "both.out"
    p = run([ckpt, "-n", 3, "--dump-logits", both, "--dump-attn", both], check=False)
    one_error_line(p, 2, f"cannot write {both}: it is the --dump-logits file")


@pytest.mark.parametrize("bad,code,message", [
    (["--dump-attn", "{attn}", "--dump-attn-layers", 99], 2, None),
    (["--dump-attn", "{attn}", "--dump-attn-heads", 99], 2, None),
    (["--profile", "--profile-peaks", "{missing}"], 1, None)])
def test_a_refused_run_leaves_its_outputs_alone(ckpt, tmp_path, bad, code, message):
    """What can refuse a run (the layers and heads to dump, the peaks file) is read before any
    output is opened: an existing --log, --dump-logits or --dump-attn file keeps its bytes."""
    files = {name: tmp_path / name for name in ("log.csv", "logits.bin", "attn.bin")}
    for f in files.values():
        f.write_bytes(b"keep me")
    bad = [str(a).replace("{attn}", str(files["attn.bin"])).replace("{missing}", str(tmp_path / "none"))
           for a in bad]
    p = run([ckpt, "-n", 3, "--log", files["log.csv"], "--dump-logits", files["logits.bin"]] + bad, check=False)
    assert p.returncode == code and p.stderr.decode().count("\n") == 1, p.stderr
    assert all(f.read_bytes() == b"keep me" for f in files.values())


def test_peaks_file_that_is_not_regular_or_not_sane(ckpt, tmp_path):
    """--profile-peaks: a FIFO is refused at once (it blocked before), and a value that is not
    a positive finite number in range is named."""
    fifo = tmp_path / "peaks.fifo"
    os.mkfifo(fifo)
    p = run([ckpt, "-n", 2, "-q", "--profile", "--profile-peaks", fifo], check=False, timeout=60)
    assert p.returncode == 1 and p.stderr.decode().count("\n") == 1 and "FIFO" in p.stderr.decode(), p.stderr
    for line, says in (("roofline_threads 1e30", "roofline_threads = 1e+30 is out of range (over 0, under 257)"),
                       ("roofline_threads 1.5", "roofline_threads = 1.5 is not a whole number"),
                       ("bandwidth_best_GBps nan", "bandwidth_best_GBps = nan is out of range (over 0, under 1e+06)"),
                       ("peak_best_GFLOPs inf", "peak_best_GFLOPs = inf is out of range (over 0, under 1e+09)")):
        peaks = tmp_path / "peaks.txt"
        peaks.write_text("bandwidth_best_GBps 50\npeak_best_GFLOPs 400\n" + line + "\n")
        p = run([ckpt, "-n", 2, "-q", "--profile", "--profile-peaks", peaks], check=False)
        one_error_line(p, 1, f"{peaks}: {says}")


def test_file_size_limit_is_one_line(ckpt, tmp_path):
    """ulimit -f: a write past it fails (./run ignores SIGXFSZ) and the run says so, exit 1."""
    import resource

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    log = tmp_path / "steps.csv"
    p = subprocess.run(args_of([ckpt, "--kv", "--window", 32, "-n", 2000, "-q", "--ignore-eos", "--log", log]), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, preexec_fn=limited, timeout=300)
    one_error_line(p, 1, f"cannot write {log}: File too large")


def test_fifo_never_hangs(ckpt, tmp_path):
    fifo = tmp_path / "steps.fifo"
    os.mkfifo(fifo)
    p = run([ckpt, "-n", 3, "-q", "--log", fifo], check=False, timeout=60)   # no reader
    one_error_line(p, 1, f"cannot write {fifo}: it is a FIFO no process reads")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)                     # with one: written as a file
    try:
        p = run([ckpt, "-n", 3, "-q", "--log", fifo], timeout=60)
        got = b""
        while True:
            try:
                chunk = os.read(reader, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(reader)
    assert got.decode().split("\n")[0].split(",") == COLUMNS and got.count(b"\n") == 4
    null = run([ckpt, "-n", 3, "-q", "--log", "/dev/null", "--dump-logits", "/dev/null"])
    assert null.returncode == 0


def test_output_that_a_standard_stream_writes_is_refused(ckpt, tmp_path):
    """--log F > F, --dump-logits F 2> F, --log F 2> F: refused with exit 2 before anything
    is written, rather than two writers interleaving in one file."""
    for flag, stream in (("--log", "stdout"), ("--dump-logits", "stderr"), ("--log", "stderr")):
        target = tmp_path / f"{flag[2:]}-{stream}.out"
        with open(target, "wb") as f:
            p = subprocess.run(args_of([ckpt, "-n", 3, flag, target]), stdout=f if stream == "stdout" else subprocess.PIPE,
                               stderr=f if stream == "stderr" else subprocess.PIPE, timeout=120)
        assert p.returncode == 2
        said = target.read_bytes() if stream == "stderr" else p.stderr
        name = "output" if stream == "stdout" else "error"
        assert said == f"run: cannot write {target}: standard {name} already writes to it\n".encode(), said
    # /dev/null for both is fine: it is no regular file
    p = subprocess.run(args_of([ckpt, "-n", 3, "--log", "/dev/null"]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=120)
    assert p.returncode == 0, p.stderr
