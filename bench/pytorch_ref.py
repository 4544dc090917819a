"""The PyTorch reference (train/model.py, eager) timed the way the engine times itself: the
same greedy sequence, every step from building the input to the argmax, with the oneDNN
Linear path where a plain eager run would take too long."""
import os
import statistics
import sys
import time
import traceback

from bench.common import (BenchError, MODES, PROMPT, ROOT, log, log_rep, median, rel, representative, spread,
                          summarize_run, warn)


PT_TOLERANCE = 1e-4        # max |logit difference| allowed for the oneDNN Linear path


def pytorch_checkpoint(b, pt, ck):
    """PyTorch's runs of one checkpoint, on the engine's greedy sequence."""
    info, v = ck.info, ck.info["variant"]
    log(f"bench: PyTorch, {v}")
    model, prompt = pt.load(info["checkpoint"])
    c_rep = representative(ck.runs[("c", "kv")]) or representative(ck.runs[("c", "no-kv")])
    if c_rep is None:
        raise BenchError("no C run to compare with")
    if len(prompt) != c_rep["prompt_tokens"]:
        raise BenchError(f"PyTorch's prompt is {len(prompt)} tokens, the engine's {c_rep['prompt_tokens']}")
    n_total = min(info["context"], len(prompt) + b.n_gen(info) - 1)
    seq = (prompt + c_rep["tokens"])[:n_total]   # the tokens every greedy run feeds back
    paths, choice = pt.choose_paths(model, prompt, seq, n_total, b.args, v)
    ck.pt["choice"] = choice
    agree = []
    for mode in MODES:
        tag = " oneDNN" if choice["path"][mode] != "eager" else ""
        out = ck.runs[("pytorch", mode)]
        pt.runs(paths[mode], prompt, n_total, mode == "kv", b.args.pt_reps, v, out, tag=tag)
        c = representative(ck.runs[("c", mode)])
        agree.append("—" if c is None else str(common_prefix(out[0]["tokens"], c["tokens"])))
    ck.pt["agree"] = " / ".join(agree)
    nokv = representative(ck.runs[("c", "no-kv")])
    dec = [x["n_tokens"] for x in nokv["rows"] if x["phase"] == "decode"] if nokv else []
    ck.pt["head_ms"] = spread(pt.head_ms(model, round(statistics.fmean(dec)) if dec else len(prompt)))


def pytorch_part(b):
    b.phase = "loading PyTorch"
    log("bench: loading PyTorch")
    try:
        pt = PyTorchBench(b.args.threads, b.args.torch_device)
    except Exception as e:   # not installed or broken: the C results must still be written
        b.pt_error = f"cannot load PyTorch: {type(e).__name__}: {e}"
        warn(f"{b.pt_error}; the report will have the C engine only")
        return
    b.machine["torch"] = (f"torch {pt.torch.__version__}, {pt.threads} thread{'s' if pt.threads > 1 else ''}, "
                          f"fp32 products on {blas_in_use() if pt.device == 'cpu' else pt.device_name}; "
                          f"path per mode and checkpoint below")
    for ck in b.ok():
        b.phase = f"the PyTorch reference ({ck.name})"
        try:
            pytorch_checkpoint(b, pt, ck)
        except Exception as e:   # a crash inside torch or train/: keep everything else, name the failure
            path = os.path.join(b.tmpdir, f"pytorch-{ck.info['variant']}-error.txt")
            with open(path, "w") as f:
                f.write(traceback.format_exc())
            ck.part_errors["pytorch"] = f"PyTorch failed: {type(e).__name__}: {e} (traceback in {rel(path)})"
            warn(f"{ck.name}: {ck.part_errors['pytorch']}")


def blas_in_use():
    """The BLAS this process's torch runs fp32 products on, from its mappings: Debian's torch
    calls the system libblas.so.3, which the alternatives point at the reference BLAS or at
    OpenBLAS (libopenblas0-pthread, which scripts/install-deps.sh installs)."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "blas" in os.path.basename(line.split()[-1])})
    except OSError:
        return "unknown"
    if any("openblas" in lib for lib in libs):
        return "OpenBLAS (" + ", ".join(os.path.realpath(lib) for lib in libs if "openblas" in lib) + ")"
    return ("the reference BLAS (" + ", ".join(libs) + ")") if libs else "unknown"


class PyTorchBench:
    def __init__(self, threads, device="cpu"):
        import torch
        sys.path.insert(0, os.path.join(ROOT, "train"))
        import export
        import model as ptmodel
        self.torch, self.export, self.ptmodel = torch, export, ptmodel
        torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise BenchError("--torch-device cuda: this torch sees no CUDA device")
        self.device = device
        self.device_name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"

    def tensor(self, ids):
        return self.torch.tensor(ids, device=self.device)

    def sync(self):
        """Waits for the device's queued work, so that a clock read after it covers that work."""
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def load(self, ckpt):
        import sentencepiece as spm
        model = self.export.load_engine_checkpoint(ckpt).to(self.device)
        hdr = self.export.read_header(ckpt)
        with open(ckpt, "rb") as f:
            f.seek(hdr["tokenizer_offset"])
            proto = f.read(hdr["tokenizer_size"])
        sp = spm.SentencePieceProcessor(model_proto=proto)
        prompt = [hdr["bos_id"]] + sp.encode(PROMPT)
        return model, prompt

    def timed_generate(self, model, prompt, n_total, kv):
        """Transformer.generate with top_k=1, timed: the prefill and every decode step, each from
        building the input tensor to the argmax of the logits (what the engine's step times)."""
        torch, perf = self.torch, time.perf_counter
        rows = []
        with torch.no_grad():
            model.eval()
            model.set_absorb(kv)
            tokens = list(prompt)
            caches = [self.ptmodel.KVCache() for _ in model.layers] if kv else None
            t0 = perf()
            logits = model(self.tensor([tokens]), start_pos=0, caches=caches, last_only=True)[0, -1]
            nxt = int(torch.argmax(logits))
            rows.append({"step": 0, "phase": "prefill", "pos": len(tokens) - 1, "n_tokens": len(tokens),
                         "token": nxt, "ms": (perf() - t0) * 1e3})
            while len(tokens) < n_total:
                tokens.append(nxt)
                t0 = perf()
                if kv:
                    logits = model(self.tensor([[nxt]]), start_pos=len(tokens) - 1, caches=caches, last_only=True)[0, -1]
                else:
                    logits = model(self.tensor([tokens]), last_only=True)[0, -1]
                nxt = int(torch.argmax(logits))
                rows.append({"step": len(rows), "phase": "decode", "pos": len(tokens) - 1, "n_tokens": len(tokens),
                             "token": nxt, "ms": (perf() - t0) * 1e3})
            model.set_absorb(False)
        return rows

    def onednn_model(self, model):
        return self.ptmodel.onednn_copy(model)

    def max_logit_diff(self, a, b, seq, prompt_len, kv_steps):
        """Largest |logit difference| of two models: all positions of one uncached forward of seq,
        and a cached prefill + kv_steps decode steps (MLA absorbed, as in the cached runs)."""
        torch = self.torch
        with torch.no_grad():
            x = self.tensor([seq])
            d = float((a(x) - b(x)).abs().max())
            outs = []
            for m in (a, b):
                m.set_absorb(True)
                caches = [self.ptmodel.KVCache() for _ in m.layers]
                ls = [m(self.tensor([seq[:prompt_len]]), start_pos=0, caches=caches)[0, -1]]
                for i in range(prompt_len, min(prompt_len + kv_steps, len(seq))):
                    ls.append(m(self.tensor([[seq[i]]]), start_pos=i, caches=caches)[0, -1])
                m.set_absorb(False)
                outs.append(torch.stack(ls))
            return max(d, float((outs[0] - outs[1]).abs().max()))

    def time_forward(self, model, seq, reps=2, warm=True):
        torch = self.torch
        with torch.no_grad():
            x = self.tensor([seq])
            if warm:
                model(x, last_only=True)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                model(x, last_only=True)
                self.sync()
                ts.append(time.perf_counter() - t0)
        return min(ts)

    def time_kv_steps(self, model, seq, prompt_len, steps=8):
        """Median ms of a cached decode step (after a cached prefill of the prompt)."""
        torch = self.torch
        ts = []
        with torch.no_grad():
            model.set_absorb(True)
            caches = [self.ptmodel.KVCache() for _ in model.layers]
            model(self.tensor([seq[:prompt_len]]), start_pos=0, caches=caches, last_only=True)
            for i in range(prompt_len, min(prompt_len + steps, len(seq))):
                t0 = time.perf_counter()
                model(self.tensor([[seq[i]]]), start_pos=i, caches=caches, last_only=True)
                self.sync()
                ts.append(time.perf_counter() - t0)
            model.set_absorb(False)
        return median(ts) if ts else 0.0

    def choose_paths(self, model, prompt, seq, n_total, args, variant):
        """The PyTorch path of each mode: plain eager fp32 (Transformer.forward as written), unless a
        run of that mode would take over args.pt_budget seconds; then the oneDNN Linear path, if its
        logits match plain eager within PT_TOLERANCE and it is faster at that mode's step.
        Returns {"no-kv": model, "kv": model} and a dict that says what was decided and why."""
        T0, T1 = len(prompt), len(seq)
        n_dec = n_total - T0
        t_small = self.time_forward(model, prompt)
        t_full = self.time_forward(model, seq, reps=1, warm=False)
        t_step = self.time_kv_steps(model, seq, T0)
        est = {"no-kv": sum(t_small + (t_full - t_small) * (T - T0) / max(1, T1 - T0) for T in range(T0, n_total + 1)),
               "kv": t_small + n_dec * t_step}
        info = {"est_eager_s": est, "eager_fwd_ms": (t_small * 1e3, t_full * 1e3), "eager_kv_step_ms": t_step * 1e3,
                "T": (T0, T1)}
        log(f"  [PyTorch] {variant}: plain eager forward {t_small * 1e3:.1f} ms at T={T0}, {t_full * 1e3:.1f} ms at "
            f"T={T1}, cached step {t_step * 1e3:.2f} ms: a run would take about {est['no-kv']:.0f} s without the "
            f"cache, {est['kv']:.0f} s with it")
        want = {m: self.device == "cpu" and (args.pt_path == "mkldnn" or (args.pt_path == "auto" and
                                                                           est[m] > args.pt_budget))
                for m in ("no-kv", "kv")}   # oneDNN's Linear layers are a CPU path
        paths = {m: model for m in want}
        info["path"] = {m: "eager" for m in want}
        info["why"] = {m: ("--pt-path eager" if args.pt_path == "eager" else
                           f"a plain eager run takes about {est[m]:.0f} s, within the {args.pt_budget:.0f} s budget")
                       for m in want}
        if not any(want.values()):
            return paths, info
        fast, converted = self.onednn_model(model)
        diff = self.max_logit_diff(model, fast, seq, T0, kv_steps=16)
        info.update(max_logit_diff=diff, converted=len(converted))
        t_full_fast = self.time_forward(fast, seq, reps=1)
        t_step_fast = self.time_kv_steps(fast, seq, T0)
        info["onednn_fwd_ms"], info["onednn_kv_step_ms"] = t_full_fast * 1e3, t_step_fast * 1e3
        log(f"  [PyTorch] {variant}: oneDNN Linear path ({len(converted)} layers): forward {t_full_fast * 1e3:.1f} ms "
            f"at T={T1}, cached step {t_step_fast * 1e3:.2f} ms; max |logit diff| vs eager {diff:.2e} "
            f"(tolerance {PT_TOLERANCE:g})")
        faster = {"no-kv": t_full_fast < t_full, "kv": t_step_fast < t_step}
        for m in want:
            if not want[m]:
                continue
            if args.pt_path == "mkldnn":
                if diff > PT_TOLERANCE:
                    raise BenchError(f"{variant}: the oneDNN Linear path differs from eager by {diff:.2e} "
                                     f"> {PT_TOLERANCE:g}")
                paths[m], info["path"][m], info["why"][m] = fast, "onednn-linear", "--pt-path mkldnn"
            elif diff > PT_TOLERANCE:
                info["why"][m] = (f"plain eager (about {est[m]:.0f} s a run) kept: the oneDNN Linear logits differ "
                                  f"by {diff:.1e} > {PT_TOLERANCE:g}")
            elif not faster[m]:
                info["why"][m] = f"plain eager (about {est[m]:.0f} s a run) kept: the oneDNN Linear path is not faster"
            else:
                paths[m], info["path"][m] = fast, "onednn-linear"
                info["why"][m] = (f"a plain eager run would take about {est[m]:.0f} s, over the "
                                  f"{args.pt_budget:.0f} s budget")
        return paths, info

    def head_ms(self, model, T, reps=3):
        """The tied head as Transformer.forward computes it (F.linear on all T positions): the ms
        of each of reps timed calls."""
        torch = self.torch
        F = torch.nn.functional
        x = torch.randn(1, T, model.cfg.dim, device=self.device)
        w = model.tok_embeddings.weight
        with torch.no_grad():
            F.linear(x, w)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                F.linear(x, w)
                self.sync()
                ts.append((time.perf_counter() - t0) * 1e3)
        return ts

    def runs(self, model, prompt, n_total, kv, reps, variant, out, tag=""):
        """One warm-up run, then reps timed runs appended to out as each ends (an interrupted
        bench keeps the runs already done)."""
        mode = "kv" if kv else "no-kv"
        expect = n_total - len(prompt)
        for rep in range(reps + 1):
            rows = self.timed_generate(model, prompt, n_total, kv)
            s = summarize_run(rows, expect, f"PyTorch {variant} {mode}")
            log_rep(f"PyTorch{tag}", variant, mode, rep, reps, s)
            if rep:
                out.append(s)


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
