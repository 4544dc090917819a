"""Hostile input from outside the flags (docs/ROBUSTNESS.md): special files, files that
change while they are read, memory out of proportion to the input, messages that say what
went wrong, non-finite numbers, and limits set through the environment or the shell. Every
input is crafted here, from the small random checkpoints of conftest.py."""
import json
import os
import resource
import shutil
import socket
import struct
import subprocess

import pytest

from conftest import RUN, run, run_measured, sanitized

SPM_MAX_TEXT_BYTES = 1 << 18


def one_line_error(p, code, needle):
    """Exit code `code`, one line `run: ...` on stderr holding needle, nothing on stdout."""
    err = p.stderr.decode()
    assert p.returncode == code, (p.returncode, err)
    assert err.startswith("run: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert needle in err, err
    assert p.stdout == b""
    return err


@pytest.fixture(scope="module")
def ckpt(small_checkpoints):
    return small_checkpoints["gqa"][0]


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "stories.txt"
    path.write_text("Once upon a time there was a cat.\n<|endoftext|>\nTom had a red ball.\n<|endoftext|>\n")
    return path


def patched(path, dst, edits):
    """A copy of the checkpoint at path, written to dst, with edits {offset: bytes} applied;
    an offset of ("w", i) is the i-th byte of the weights."""
    data = bytearray(open(path, "rb").read())
    w_off = struct.unpack_from("<Q", data, 88)[0]
    for at, value in edits.items():
        at = w_off + at[1] if isinstance(at, tuple) else at
        data[at:at + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


# ---- 3: special files and sizes ----

def test_special_files_never_hang(ckpt, tmp_path, stories):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "sock"))
    try:
        for path, what in [(fifo, "is a FIFO, not a regular file"), ("/dev/zero", "is a character device, not a regular file"),
                           (tmp_path, "is a directory, not a regular file"),
                           (tmp_path / "sock", "No such device or address")]:
            one_line_error(run([path, "-n", "2"], check=False, timeout=30), 1, what)
            one_line_error(run([ckpt, "--ppl", path], check=False, timeout=30), 1, what)
            one_line_error(run([ckpt, "--prompts", path], check=False, timeout=30), 1, what)
    finally:
        sock.close()


SHRINK_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* After the first fstat of the file named by SHRINK_FILE, the file is cut to SHRINK_TO bytes:
 * the caller has taken the size it will believe. */
static int shrunk;
static void maybe_shrink(int fd, int rc) {
    const char *victim = getenv("SHRINK_FILE");
    char link[64], target[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (rc != 0 || shrunk || !victim || n <= 0) return;
    target[n] = '\0';
    if (strcmp(target, victim) != 0) return;
    shrunk = 1;
    if (truncate(victim, atol(getenv("SHRINK_TO"))) != 0) abort();
}
int fstat(int fd, struct stat *st) {
    int (*real)(int, struct stat *) = (int (*)(int, struct stat *))dlsym(RTLD_NEXT, "fstat");
    int rc = real(fd, st);
    maybe_shrink(fd, rc);
    return rc;
}
int fstat64(int fd, struct stat64 *st) {
    int (*real)(int, struct stat64 *) = (int (*)(int, struct stat64 *))dlsym(RTLD_NEXT, "fstat64");
    int rc = real(fd, st);
    maybe_shrink(fd, rc);
    return rc;
}
"""


@pytest.fixture(scope="module")
def shrink_shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler: the project builds with one"
    d = tmp_path_factory.mktemp("shim")
    (d / "shrink.c").write_text(SHRINK_SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "shrink.so"), str(d / "shrink.c"), "-ldl"], check=True)
    return d / "shrink.so"


@pytest.mark.parametrize("keep", ["header", "tokenizer", "weights"])
def test_checkpoint_shrinking_while_loading(ckpt, tmp_path, shrink_shim, keep):
    """The file is cut right after the loader has taken its size: a mapping of it would
    die of SIGBUS on the first page past the new end; reads just come up short."""
    victim = tmp_path / "victim.bin"
    shutil.copy(ckpt, victim)
    w_off = struct.unpack_from("<Q", victim.read_bytes(), 88)[0]
    to = {"header": 64, "tokenizer": 4096, "weights": w_off + 10000}[keep]
    env = dict(os.environ, LD_PRELOAD=str(shrink_shim), SHRINK_FILE=str(victim.resolve()), SHRINK_TO=str(to),
               ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0")
    p = subprocess.run([RUN, str(victim), "-n", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=60)
    assert os.path.getsize(victim) == to  # the shim did cut it
    one_line_error(p, 1, "shrank while it was being read")


@pytest.mark.parametrize("how", ["-f", "--prompts", "--ppl"])
def test_text_files_that_grow_or_hide_their_size(ckpt, tmp_path, stories, shrink_shim, how):
    """A text file longer than its size said when it was opened (it grew; or, as in /proc, it
    reports 0) is refused, never read short."""
    victim = tmp_path / "grows.txt"
    shutil.copy(stories, victim)
    to = os.path.getsize(victim) + 100
    env = dict(os.environ, LD_PRELOAD=str(shrink_shim), SHRINK_FILE=str(victim.resolve()), SHRINK_TO=str(to),
               ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0")
    steps = [] if how == "--ppl" else ["-n", "2"]  # --ppl scores its file whole
    p = subprocess.run([RUN, ckpt, how, str(victim)] + steps, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                       timeout=60)
    assert os.path.getsize(victim) == to  # the shim did grow it
    one_line_error(p, 1, "grew while it was being read")
    one_line_error(run([ckpt, how, "/proc/self/status"] + steps, check=False, timeout=30), 1,
                   "/proc/self/status grew while it was being read, or does not report its size")


def test_ppl_memory_in_proportion_to_the_input(ckpt, tmp_path, stories):
    """A 10 MB story of one line once took the tokenizer 2 GB before it was refused. Now the
    file is read once, and a story longer than the tokenizer takes at once never reaches it."""
    big = tmp_path / "one-line.txt"
    big.write_text("abcdefghij" * (1 << 20) + "\n")
    code, err, rss_big = run_measured([ckpt, "--ppl", big])
    assert code == 1 and err.decode() == f"run: {big}: story 1 is over {SPM_MAX_TEXT_BYTES} bytes, more than the tokenizer encodes at once\n"
    code, err, rss_small = run_measured([ckpt, "--ppl", stories])
    assert code == 0, err
    assert rss_big - rss_small < 64 * 1024, (rss_big, rss_small)  # the file is 10 MB


def test_ppl_story_at_the_byte_limit_is_encoded(ckpt, tmp_path):
    text = tmp_path / "limit.txt"
    text.write_text("a " * (SPM_MAX_TEXT_BYTES // 2 - 1) + "b\n<|endoftext|>\n")
    # SPM_MAX_TEXT_BYTES - 1 bytes after stripping: encoded, then too many tokens
    one_line_error(run([ckpt, "--ppl", text], check=False), 1, "story 1 is longer than 65535 tokens")


# ---- 4: honest messages ----

def test_out_of_memory_is_reported_as_such(ckpt, stories):
    """Under every address-space limit from too small to enough, the run either succeeds or
    says it ran out of memory: never that the tokenizer is corrupt or the text is not UTF-8,
    never a signal. (Below the first limits the program never reaches main: the dynamic
    loader cannot map it, or a library's static initializer (SentencePiece's flags) cannot
    allocate and aborts; where --version does not start either, there is nothing to test.)"""
    if sanitized():
        pytest.skip("ASan reserves the whole address space")
    seen = set()
    for mb in range(6, 40):
        def limit(mb=mb):
            resource.setrlimit(resource.RLIMIT_AS, (mb << 20, resource.RLIM_INFINITY))
        p = subprocess.run([RUN, ckpt, "--threads", "1", "--ppl", str(stories)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, preexec_fn=limit, timeout=120)
        err = p.stderr.decode()
        if p.returncode == 127 and "error while loading shared libraries" in err:
            continue
        started = subprocess.run([RUN, "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 preexec_fn=limit, timeout=120)
        if started.returncode != 0:
            assert p.returncode == started.returncode, (mb, p.returncode, err)  # the same failure before main
            continue
        assert p.returncode in (0, 1), (mb, p.returncode, err)
        if p.returncode == 1:
            assert err.startswith("run: ") and err.count("\n") == 1 and "out of memory" in err, (mb, err)
            assert "corrupt" not in err and "UTF-8" not in err, (mb, err)
        seen.add("out of memory" if p.returncode else "ran")
    assert seen == {"out of memory", "ran"}, seen


def test_long_paths_keep_the_reason(ckpt, tmp_path):
    path = "/nonexistent" + "/d" * 1994  # 4000 bytes
    for args in ([path], [ckpt, "--ppl", path], [ckpt, "--prompts", path]):
        err = one_line_error(run(args, check=False), 1, "cannot open")
        assert err.endswith(": No such file or directory\n"), err
        assert len(err) < 300, err
    for args in ([ckpt, "-n", "2", "--log", path], [ckpt, "-n", "2", "--dump-logits", path]):
        err = one_line_error(run(args, check=False), 1, "cannot write")
        assert err.endswith(": No such file or directory\n"), err
        assert len(err) < 300, err


def test_header_numbers_are_the_files(ckpt, tmp_path):
    bad = patched(ckpt, tmp_path / "dim.bin", {16: struct.pack("<I", 0xFFFFFFFF)})
    one_line_error(run([bad], check=False), 1, "checkpoint: dim = 4294967295 is out of range (1..65536)")


def test_reserved_header_bytes_refused(ckpt, tmp_path):
    bad = patched(ckpt, tmp_path / "reserved.bin", {127: b"\x07"})
    one_line_error(run([bad], check=False), 1, "checkpoint: reserved header byte 127 is 7, not 0")


def test_info_checks_the_tokenizer(ckpt, tmp_path):
    """--info reads no weights, but it checks the embedded tokenizer as every other mode does:
    bytes that do not parse, or an EOS id the tokenizer does not have, are refused."""
    with open(ckpt, "rb") as f:
        tok_off = struct.unpack_from("<Q", f.read(128), 72)[0]
    garbled = patched(ckpt, tmp_path / "garbled.bin", {tok_off: b"\xff" * 64})
    eos = patched(ckpt, tmp_path / "eos.bin", {68: struct.pack("<I", 5)})
    for bad, says in ((garbled, "checkpoint: the embedded tokenizer: cannot load the SentencePiece model"),
                      (eos, "checkpoint: the embedded tokenizer (4096 pieces, bos 1, eos 2) does not match the model "
                            "(4096, bos 1, eos 5)")):
        for mode in ([], ["--info"], ["--info", "--json"]):
            p = run([bad, "-n", 2] if not mode else [bad] + mode, check=False)
            err = p.stderr.decode()
            assert p.returncode == 1 and p.stdout == b"" and err.count("\n") == 1 and says in err, (mode, err)


# ---- 5: non-finite numbers ----

def header_u32(path, offset):
    with open(path, "rb") as f:
        return struct.unpack_from("<I", f.read(128), offset)[0]


@pytest.mark.parametrize("bits,word", [(b"\xc0\x7f", "NaN"), (b"\x80\xff", "infinite")])
def test_nonfinite_weights_refused(ckpt, tmp_path, stories, bits, word):
    dim = header_u32(ckpt, 16)
    bad = patched(ckpt, tmp_path / "nonfinite.bin", {("w", 2 * (dim + 5)): bits})  # row 1, column 5
    for args in ([bad, "-n", "4"], [bad, "--ppl", stories], [bad, "--check-kv", "-n", "4"]):
        one_line_error(run(args, check=False), 1, f"checkpoint: weight [1][5] of tok_embeddings is {word}")
    # --info sizes a model from its header alone and reads no weight (a model larger than the
    # machine can be sized): the weights are checked when a run loads them
    assert run([bad, "--info"], check=False).returncode == 0


def test_overflowing_weights_give_no_garbage(small_checkpoints, tmp_path, stories):
    """Finite weights whose products overflow (a final norm of 3.4e38) give NaN logits: no
    token is sampled from them and no perplexity printed."""
    path = small_checkpoints["gqa"][0]
    size, dim = os.path.getsize(path), header_u32(path, 16)
    bad = patched(path, tmp_path / "overflow.bin", {size - 2 * dim + 2 * i: b"\x7f\x7f" for i in range(dim)})
    message = "the model computes logits that are not finite numbers"
    for args in ([bad, "-n", "4", "-q"], [bad, "-n", "4", "-q", "--kv"], [bad, "--kv", "--batch", "2", "-n", "4", "-q"],
                 [bad, "--ppl", stories], [bad, "--check-kv", "-n", "4"]):
        p = run(args, check=False)
        assert p.returncode == 1 and message in p.stderr.decode() and p.stdout == b"", (args, p.stderr.decode())
        assert "nan" not in p.stdout.decode().lower()



def test_overflowing_draft_model_named(small_checkpoints, tmp_path):
    """A draft model whose logits overflow ends the run in one line that names the draft, not
    the target's line."""
    target, draft = small_checkpoints["gqa"][0], small_checkpoints["mqa"][0]
    size, dim = os.path.getsize(draft), header_u32(draft, 16)
    bad = patched(draft, tmp_path / "overflow.bin", {size - 2 * dim + 2 * i: b"\x7f\x7f" for i in range(dim)})
    for args in (["-k", "1"], ["-k", "40", "-s", "3"], ["--batch", "2", "--draft-k", "8"]):
        p = run([target, "--kv", "-n", "8", "-q", "--draft", bad] + args, check=False)
        err = p.stderr.decode().strip().splitlines()
        assert p.returncode == 1, (args, p.stderr.decode())  # stdout holds the target's tokens before drafting
        assert err[-1] == ("run: --draft: the draft model computes logits that are not finite numbers (NaN or "
                           "infinity): its weights overflow float arithmetic"), (args, err)

# ---- 7: limits, however they are set ----

@pytest.mark.parametrize("value,message", [
    ("100000", "OMP_NUM_THREADS=100000 is out of range (1..256)"),
    ("257", "OMP_NUM_THREADS=257 is out of range (1..256)"),
    ("0", "OMP_NUM_THREADS=0 is out of range (1..256)"),
    ("abc", "OMP_NUM_THREADS needs a thread count (1..256), got 'abc'"),
    ("4x", "OMP_NUM_THREADS needs a thread count (1..256), got '4x'"),
    ("", "OMP_NUM_THREADS needs a thread count (1..256), got ''"),
    ("2,99999", "OMP_NUM_THREADS=2,99999 is out of range (1..256)"),
])
def test_omp_num_threads_refused(ckpt, value, message):
    env = dict(os.environ, OMP_NUM_THREADS=value)
    p = subprocess.run([RUN, ckpt, "-n", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=120)
    assert p.stderr.decode() == f"run: {message}\n" and p.returncode == 2 and p.stdout == b""  # no libgomp line either


@pytest.mark.parametrize("value", ["abc", "0", "", "-2"])
def test_omp_thread_limit_refused(ckpt, value):
    """A thread limit that is no positive count is refused as OMP_NUM_THREADS is (it was ignored)."""
    env = dict(os.environ, OMP_THREAD_LIMIT=value)
    p = subprocess.run([RUN, ckpt, "-n", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=120)
    assert p.stderr.decode() == f"run: OMP_THREAD_LIMIT needs a positive thread count, got '{value}'\n"
    assert p.returncode == 2 and p.stdout == b""


def test_omp_thread_limit_caps_the_team(ckpt):
    """A limit caps the threads; one past the team's most is no limit."""
    for value, threads in [("1", 1), ("1000", 3)]:
        env = dict(os.environ, OMP_THREAD_LIMIT=value)
        p = subprocess.run([RUN, ckpt, "-n", "2", "--threads", "3", "--json", "-q"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=env, timeout=120)
        assert p.returncode == 0 and json.loads(p.stdout.decode().splitlines()[-1])["threads"] == threads, p.stderr


def test_omp_num_threads_in_range(ckpt):
    outs = set()
    for value in ["1", "256", " 2 ", "2,2"]:
        env = dict(os.environ, OMP_NUM_THREADS=value)
        p = subprocess.run([RUN, ckpt, "-k", "1", "-n", "6", "-q", "--ignore-eos"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=env, timeout=300)
        assert p.returncode == 0, (value, p.stderr.decode())
        outs.add(p.stdout)
        p = subprocess.run([RUN, ckpt, "-k", "1", "-n", "6", "-q", "--ignore-eos", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=env, timeout=300)
        summary = json.loads(p.stdout.decode().splitlines()[-1])
        assert p.returncode == 0 and summary["threads"] == int(value.split(",")[0]), (value, summary)
    assert len(outs) == 1
    # --threads wins: OMP_NUM_THREADS is then never used, so a bad one is no error
    env = dict(os.environ, OMP_NUM_THREADS="abc")
    p = subprocess.run([RUN, ckpt, "--threads", "1", "-k", "1", "-n", "6", "-q", "--ignore-eos"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout in outs and "libgomp" not in p.stderr.decode()


def test_omp_thread_limit_caps_the_team(ckpt, tmp_path):
    """OMP_THREAD_LIMIT below --threads: the settings line names the threads that run, and
    the logits are those of any other thread count."""
    dumps = []
    for limit in ("1", "2"):
        dump = tmp_path / f"limit{limit}.bin"
        env = dict(os.environ, OMP_THREAD_LIMIT=limit)
        p = subprocess.run([RUN, ckpt, "--threads", "2", "-k", "1", "-n", "6", "-q", "--ignore-eos", "--dump-logits", dump,
                            "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=300)
        assert p.returncode == 0, (limit, p.stderr.decode())
        summary = json.loads(p.stdout.decode().splitlines()[-1])
        assert summary["type"] == "summary" and summary["threads"] == int(limit), (limit, summary)
        dumps.append(dump.read_bytes())
    assert dumps[0] == dumps[1] and len(dumps[0]) > 0


def run_with_stack(args, kb, env=None):
    def limit():
        resource.setrlimit(resource.RLIMIT_STACK, (kb << 10, resource.RLIM_INFINITY))
    return subprocess.run([RUN] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          preexec_fn=limit, env=env, timeout=300)


@pytest.mark.parametrize("variant", ["gqa", "mla64"])
def test_small_stacks(small_checkpoints, variant):
    """A 64 KB stack (ulimit -s 64, which the team's threads inherit) runs as usual:
    attention's scratch is on the heap."""
    if sanitized():
        pytest.skip("ASan's frames and fake stacks need far more stack")
    path = small_checkpoints[variant][0]
    prompt = "Once upon a time there was a little girl who liked to play in the park with her dog"
    for kv in ([], ["--kv"]):
        args = [path, "-p", prompt, "-k", "1", "-n", "30", "-q", "--ignore-eos", "--threads", "2"] + kv
        want = run(args).stdout
        p = run_with_stack(args, 64)
        assert p.returncode == 0 and p.stdout == want, p.stderr.decode()


def test_small_stack_and_a_wide_filled_row():
    """--fill generated a cache row in a stack array of the row's width: a head of 32,768
    (128 KB of floats) under a 64 KB stack ended in SIGSEGV. The row is on the heap now."""
    if sanitized():
        pytest.skip("ASan's frames and fake stacks need far more stack")
    args = ["--shape", "layers=1,dim=64,heads=1,head_dim=32768,vocab=256,ffn=64,ctx=64", "--kv", "--fill", 16, "-n", 2,
            "-k", 1, "-s", 1, "-q"]
    want = run(args).stdout
    p = run_with_stack(args, 64)
    assert p.returncode == 0 and p.stdout == want and want, p.stderr.decode()


def test_too_small_a_stack_is_refused(ckpt):
    if sanitized():
        pytest.skip("ASan's frames and fake stacks need far more stack")
    p = run_with_stack([ckpt, "-n", "2"], 24)
    assert p.returncode == 2 and p.stdout == b""
    assert p.stderr.decode() == "run: the stack limit (ulimit -s) is 24 KB, below the 32 KB this program needs\n"
