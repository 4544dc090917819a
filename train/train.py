"""Trains one attention variant on the CPU for a budget of steps.

    python3 train/train.py --variant mha                 # the protocol: 4,656 steps of 16 x 256 tokens
    python3 train/train.py --variant mha --resume        # continue it after a stop

AdamW; linear warmup over the first 2% of the steps, then a cosine to --min-lr at the
last step, so the schedule depends on the budget, never on the machine's speed. bf16
autocast where the CPU has bf16 instructions, fp32 otherwise (--precision; a resumed run
keeps the precision it started with); both cores. The validation loss (nats/token, each
story scored within the context, as the C engine's --ppl does) is measured every
--eval-tokens and at the end; the best-validation weights are kept in OUT/best.pt.
OUT/last.pt is saved every --save-minutes, at each validation and on Ctrl-C or SIGTERM
(once the step or validation batch under way ends), with the data sampler's state, so a
run continues across sittings (--resume) on the same data order. A CSV loss log
(OUT/log.csv) and its plot (OUT/loss.png) are written at every validation. The
checkpoints hold tensors and plain values only, and are read back without a general
unpickler (train/checkpoint.py: weights_only where PyTorch can).
"""
import argparse
import csv
import ctypes
import math
import os
import signal
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint  # noqa: E402
from model import VARIANTS, Config, Transformer, story_windows  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOS_ID = 1
# The equal-training protocol: 4,656 steps of 16 x 256 tokens = 19,070,976 tokens.
PROTOCOL_STEPS = 4656
# The training loss on the progress bar and in log.csv: an exponential moving average
# with a time constant of this many steps (a weight of 1/EMA_STEPS on each new step).
EMA_STEPS = 50


def keep_freed_memory():
    """glibc gives each allocation above 32 MB its own fresh mapping and unmaps it on free, so
    every step page-faults and zero-fills its large activations and gradients again (measured:
    ~80k page faults/s and about two thirds of the CPU time in the kernel). Serve them from the
    heap and keep freed memory for the next step instead."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def split_stories(tokens):
    """uint16 stream of BOS ... EOS stories -> list of int arrays (one per story)."""
    starts = np.flatnonzero(tokens == BOS_ID)
    ends = np.append(starts[1:], len(tokens))
    return [tokens[a:b].astype(np.int64) for a, b in zip(starts, ends)]


def validation_batches(tokens, ctx, batch_size):
    """Every story's windows (model.story_windows), padded to ctx, targets -1 where padded."""
    rows = []
    for story in split_stories(tokens):
        for x, y in story_windows(story, ctx):
            xi = np.zeros(ctx, dtype=np.int64)
            yi = np.full(ctx, -1, dtype=np.int64)
            xi[:len(x)] = x
            yi[:len(y)] = y
            rows.append((xi, yi))
    for i in range(0, len(rows), batch_size):
        xs, ys = zip(*rows[i:i + batch_size])
        yield torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


class Stop:
    """Ctrl-C and SIGTERM. Until arm() they end the process at once with one line (nothing
    to save yet); after it they are only noted, and check() raises KeyboardInterrupt at the
    run's next safe point (between steps, between validation batches), so a stop never
    lands half-way through a library call and last.pt is always a whole step's state."""

    def __init__(self):
        self.armed, self.signum = False, None
        signal.signal(signal.SIGTERM, self.handle)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job ignores Ctrl-C: keep that
            signal.signal(signal.SIGINT, self.handle)

    def handle(self, signum, frame):
        if not self.armed:
            sys.exit("train.py: stopped before the run started; nothing saved")
        self.signum = signum

    def arm(self):
        self.armed = True

    def check(self):
        if self.signum is not None:
            raise KeyboardInterrupt


@torch.no_grad()
def evaluate(model, val_batches, bf16, leave=False, check=lambda: None):
    """Mean NLL per predicted token (nats) over the validation set, with a progress bar on
    stderr (left on screen if leave); check() is called before every batch."""
    model.eval()
    total, count = 0.0, 0
    for x, y in tqdm(val_batches, desc="validation", unit="batch", leave=leave, dynamic_ncols=True,
                     mininterval=1):
        check()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        nll = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                                ignore_index=-1, reduction="sum")
        total += float(nll)
        count += int((y >= 0).sum())
    model.train()
    return total / count


def cpu_has_bf16():
    """Whether the CPU has bf16 dot-product instructions (AVX512_BF16 or AMX). Without them
    oneDNN emulates bf16 products: 5 GFLOP/s on 2 AVX2 cores, against ~110 GFLOP/s for fp32
    through OpenBLAS, so training then runs in fp32 (train/README.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def lr_at(step, args):
    """Linear warmup over the first args.warmup of the steps, then cosine from lr to min_lr at the last step."""
    warmup = max(1, round(args.warmup * args.steps))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min((step - warmup) / max(1, args.steps - warmup), 1.0)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def refuse_other_run(ck, cfg, args, last_path):
    """Exits with one line if last.pt (ck) was saved by a run other than the one args describe:
    another variant or model shape, batch or budget. Its weights would not load, or the
    schedule and data order would silently differ from the run's."""
    needed = {"config", "model", "optim", "rng", "step", "tokens", "elapsed", "best_val"}
    if not isinstance(ck, dict) or not needed <= set(ck) or not isinstance(ck["config"], dict):
        sys.exit(f"train.py: --resume: {last_path} is not a last.pt saved by train.py; start afresh with --force")
    saved = ck["config"]
    if saved.get("variant") != cfg.variant:
        sys.exit(f"train.py: --resume: {last_path} is a {saved.get('variant')} run, not {cfg.variant}; "
                 f"resume it with --variant {saved.get('variant')}")
    # a key added to Config after the run started is missing from its last.pt: it had the default
    defaults = type(cfg)().__dict__
    diff = [f"{k} {saved.get(k, defaults[k])} (last.pt) vs {v}" for k, v in cfg.__dict__.items()
            if saved.get(k, defaults[k]) != v]
    if diff:
        sys.exit(f"train.py: --resume: {last_path} holds another model config ({', '.join(diff)}); "
                 "resume with the options it started with (--small, --ctx, --dropout, the shape's)")
    per_step = args.batch_size * args.ctx
    if ck["step"] > 0 and ck["tokens"] != ck["step"] * per_step:
        sys.exit(f"train.py: --resume: the run's steps are {ck['tokens'] // ck['step']} tokens, not "
                 f"{args.batch_size} x {args.ctx}; resume with the --batch-size it started with")
    if ck.get("budget_steps", args.steps) != args.steps:
        sys.exit(f"train.py: --resume: the run's budget is {ck['budget_steps']} steps, not {args.steps}")


def progress_text(train_ema, val, best_val, tok_s, lr):
    """The training bar's postfix: what each figure is, and "-" for a validation loss not
    measured yet (in this sitting; the best so far is shown once there is one)."""
    val_text = "-" if math.isnan(val) else f"{val:.3f}"
    best_text = f" (best {best_val:.3f})" if math.isfinite(best_val) else ""
    return (f"train loss {train_ema:.3f} (EMA of {EMA_STEPS} steps), val {val_text}{best_text}, "
            f"{tok_s:.0f} tok/s, lr {lr:.1e}")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def plot_log(log_path, png_path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = list(csv.DictReader(open(log_path)))
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = [(float(r["tokens"]) / 1e6, float(r["train_loss"])) for r in rows if r["train_loss"]]
    va = [(float(r["tokens"]) / 1e6, float(r["val_loss"])) for r in rows if r["val_loss"]]
    if tr:
        ax.plot(*zip(*tr), label=f"train (EMA of {EMA_STEPS} steps)", alpha=0.8)
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help=f"training steps (default {PROTOCOL_STEPS})")
    budget.add_argument("--tokens", type=int, help="training tokens, rounded up to whole steps")
    ap.add_argument("--out", help="output folder (default out/VARIANT)")
    ap.add_argument("--data", default=os.path.join(ROOT, "data"), help="folder with train.bin, valid.bin")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=float, default=0.02, help="warmup, as a fraction of the steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-tokens", type=int, default=2_000_000, help="tokens between validations")
    ap.add_argument("--save-minutes", type=float, default=5.0, help="minutes between saves of OUT/last.pt")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="bf16 autocast or plain fp32; auto: bf16 where the CPU has bf16 instructions "
                         "(a resumed run keeps the precision it started with)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--resume", action="store_true", help="continue the run in OUT from OUT/last.pt")
    ap.add_argument("--init", metavar="CKPT", help="start from these weights (an engine .bin or a train.py .pt of "
                    "the same variant and shape, e.g. from train/convert.py) instead of random ones")
    ap.add_argument("--force", action="store_true", help="start afresh in an OUT that holds an earlier run")
    ap.add_argument("--small", action="store_true", help="tiny model for smoke tests")
    shape = ap.add_argument_group("the model's shape, for a model other than the protocol's (a speculative "
                                  "decoding draft, for one); default: the variant's")
    shape.add_argument("--layers", type=int, help="layers (default 4)")
    shape.add_argument("--dim", type=int, help="model width (default 512)")
    shape.add_argument("--heads", type=int, help="query heads (default 16)")
    shape.add_argument("--head-dim", type=int, help="width of a head (default 32)")
    shape.add_argument("--kv-heads", type=int, help="KV heads of mha/gqa/mqa (default: the variant's)")
    shape.add_argument("--hidden", type=int, help="FFN width (default 1344)")
    args = ap.parse_args()
    stop = Stop()
    out = args.out or os.path.join(ROOT, "out", args.variant)
    B, T = args.batch_size, args.ctx
    if args.tokens is not None:
        args.steps = -(-args.tokens // (B * T))
    elif args.steps is None:
        args.steps = PROTOCOL_STEPS
    if args.steps < 1:
        sys.exit("train.py: the budget must be at least one step")
    if not 0 <= args.warmup < 1:
        sys.exit(f"train.py: --warmup is a fraction of the steps, from 0 to below 1 (default 0.02), not {args.warmup}")
    last_path = os.path.join(out, "last.pt")
    for name in ("train.bin", "valid.bin"):
        if not os.path.isfile(os.path.join(args.data, name)):
            sys.exit(f"train.py: {os.path.join(args.data, name)} is missing; run train/prepare.py first")
    if args.resume and not os.path.isfile(last_path):
        sys.exit(f"train.py: --resume: {last_path} is missing; start the run without --resume")
    if not args.resume and not args.force and os.path.exists(os.path.join(out, "log.csv")):
        sys.exit(f"train.py: {out} holds an earlier run; continue it with --resume or overwrite it with --force")

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    train_tokens = np.fromfile(os.path.join(args.data, "train.bin"), dtype=np.uint16)
    valid_tokens = np.fromfile(os.path.join(args.data, "valid.bin"), dtype=np.uint16)
    if len(train_tokens) < T + 2:  # a batch draws windows of T + 1 tokens from [0, len - T - 1)
        sys.exit(f"train.py: {os.path.join(args.data, 'train.bin')} holds {len(train_tokens)} tokens, too few "
                 f"for windows of --ctx {T}; run train/prepare.py on more text")
    overrides = dict(dropout=args.dropout, max_seq_len=args.ctx)
    if args.small:
        overrides.update(dim=64, n_layers=2, hidden_dim=96)
    for flag, field in (("layers", "n_layers"), ("dim", "dim"), ("heads", "n_heads"), ("head_dim", "head_dim"),
                        ("kv_heads", "n_kv_heads"), ("hidden", "hidden_dim")):
        value = getattr(args, flag)
        if value is not None:
            if value < 1:
                sys.exit(f"train.py: --{flag.replace('_', '-')} must be at least 1, not {value}")
            overrides[field] = value
    if args.kv_heads is not None and args.variant.startswith("mla"):
        sys.exit("train.py: --kv-heads is for mha, gqa and mqa: MLA caches a latent")
    heads = overrides.get("n_heads", 16)
    kv_heads = overrides.get("n_kv_heads", VARIANTS[args.variant][0])
    if args.heads is not None and args.kv_heads is None and args.variant == "mha":
        overrides["n_kv_heads"] = kv_heads = heads
    if kv_heads and heads % kv_heads:
        sys.exit(f"train.py: {heads} query heads cannot be shared among {kv_heads} KV heads")
    cfg = Config.for_variant(args.variant, **overrides)
    model = Transformer(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    val_batches = list(validation_batches(valid_tokens, args.ctx, 32))
    if not val_batches:
        sys.exit(f"train.py: {os.path.join(args.data, 'valid.bin')} holds no story (BOS ... EOS) to validate on; "
                 "run train/prepare.py")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)

    step, tokens_seen, elapsed, best_val, sittings = 0, 0, 0.0, float("inf"), []
    evals_done = 0  # validations on the eval_tokens grid so far: one cut short by a stop runs on resume
    precision = "bf16" if args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16()) else "fp32"
    stop.arm()  # from here on a stop waits for a safe point and saves last.pt
    os.makedirs(out, exist_ok=True)  # only now, so that a refused run leaves no folder behind
    log_path = os.path.join(out, "log.csv")
    if args.resume:
        try:
            ck = checkpoint.load(last_path)
        except checkpoint.CheckpointError as e:
            reason = str(e).removeprefix(f"{last_path}: ")
            sys.exit(f"train.py: --resume: {last_path} cannot be read: {reason}; start afresh with --force")
        refuse_other_run(ck, cfg, args, last_path)
        try:
            model.load_state_dict(ck["model"])
            optim.load_state_dict(ck["optim"])
            rng.bit_generator.state = ck["rng"]
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:  # a damaged last.pt
            sys.exit(f"train.py: --resume: {last_path} holds state that does not fit the run "
                     f"({' '.join(str(e).split())[:120]}); start afresh with --force")
        step, tokens_seen, elapsed, best_val = ck["step"], ck["tokens"], ck["elapsed"], ck["best_val"]
        sittings = ck.get("sittings", [])
        evals_done = ck.get("evals_done", tokens_seen // args.eval_tokens)
        started = ck.get("precision_name")
        if started and args.precision == "auto":
            precision = started
            if precision == "bf16" and not cpu_has_bf16():
                sys.exit("train.py: --resume: this run trains in bf16 and this CPU has no bf16 instructions "
                         "(emulated bf16 runs ~100x slower); pass --precision fp32 to continue in fp32")
        with open(log_path) as f:  # drop what was logged after the last save: those steps run again
            kept = [line for line in f if line.startswith("step") or int(line.split(",")[0]) <= step]
        with open(log_path, "w") as f:
            f.writelines(kept)
    else:
        if args.init:
            import export  # noqa: E402
            try:
                init = export.load_input(args.init)[0]
                if init.cfg.variant != cfg.variant:
                    raise ValueError(f"a {init.cfg.variant} model, not {cfg.variant}")
                model.load_state_dict(init.state_dict())   # strict: a model of another shape is refused
            except (OSError, ValueError, RuntimeError) as e:
                sys.exit(f"train.py: --init: {args.init}: {' '.join(str(e).split())[:160]}")
        with open(log_path, "w") as f:
            f.write("step,minutes,tokens,lr,train_loss,val_loss\n")
    bf16 = precision == "bf16"
    sitting = {"cpu": cpu_name(), "precision": precision, "first_step": step, "last_step": step, "seconds": 0.0}
    sittings.append(sitting)

    def save(path, kind):  # plain values and tensors only (checkpoint.plain), loadable with weights_only
        checkpoint.save({"model": model.state_dict(), "config": cfg.__dict__, "step": step, "tokens": tokens_seen,
                         "elapsed": elapsed, "best_val": best_val, "kind": kind, "budget_steps": args.steps,
                         "precision": "bf16 autocast" if bf16 else "fp32", "precision_name": precision,
                         "sittings": sittings, "evals_done": evals_done,
                         **({"optim": optim.state_dict(), "rng": rng.bit_generator.state} if kind == "last" else {})},
                        path)

    def log(train_loss, val_loss):
        with open(log_path, "a") as f:
            f.write(f"{step},{elapsed / 60:.3f},{tokens_seen},{lr:.3e},"
                    f"{'' if train_loss is None else f'{train_loss:.4f}'},"
                    f"{'' if val_loss is None else f'{val_loss:.4f}'}\n")

    def validate(final=False):
        nonlocal best_val, evals_done
        val = evaluate(model, val_batches, bf16, leave=final, check=stop.check)
        evals_done = tokens_seen // args.eval_tokens
        if val < best_val:
            best_val = val
            save(os.path.join(out, "best.pt"), "best")
        log(None, val)
        save(last_path, "last")
        plot_log(log_path, os.path.join(out, "loss.png"), f"{args.variant}: loss")
        return val

    bar = None
    try:
        print(f"{args.variant}: {n_params:,} parameters, {len(train_tokens):,} training tokens, "
              f"{len(valid_tokens):,} validation tokens, budget {args.steps:,} steps of {B}x{T} "
              f"({args.steps * B * T:,} tokens), {'bf16 autocast' if bf16 else 'fp32'}, "
              f"{'resumed at step ' + format(step, ',') if args.resume else 'from scratch'}", flush=True)
        model.train()
        bar = tqdm(total=args.steps, initial=step, unit="step", dynamic_ncols=True, mininterval=5)
        smooth, lr, val = None, args.lr, float("nan")
        t_sitting = time.time()
        last_log = last_save = elapsed
        if step < args.steps and tokens_seen // args.eval_tokens > evals_done:
            val = validate()   # the last sitting stopped during this validation
        while step < args.steps:
            stop.check()
            lr = lr_at(step, args)
            for g in optim.param_groups:
                g["lr"] = lr
            ix = rng.integers(0, len(train_tokens) - T - 1, B)
            batch = torch.from_numpy(np.stack([train_tokens[i:i + T + 1] for i in ix]).astype(np.int64))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(batch[:, :-1], batch[:, 1:])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optim.step()
            step += 1
            tokens_seen += B * T
            now = time.time()
            elapsed += now - t_sitting - sitting["seconds"]
            sitting["seconds"], sitting["last_step"] = now - t_sitting, step
            bar.update(1)
            smooth = float(loss) if smooth is None else smooth + (float(loss) - smooth) / EMA_STEPS
            bar.set_postfix_str(progress_text(smooth, val, best_val,
                                              (step - sitting["first_step"]) * B * T / sitting["seconds"], lr))
            if elapsed - last_log >= 30:
                log(smooth, None)
                last_log = elapsed
            if tokens_seen // args.eval_tokens > evals_done and step < args.steps:
                val = validate()
                last_save = elapsed
            elif elapsed - last_save >= args.save_minutes * 60:
                save(last_path, "last")
                last_save = elapsed
        bar.close()
        print("final validation ...", flush=True)
        val = validate(final=True)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        save(last_path, "last")
        where = "during the final validation" if step == args.steps else f"at step {step:,} of {args.steps:,}"
        sys.exit(f"train.py: stopped {where}; {last_path} saved, continue with --resume")
    rate = (step - sitting["first_step"]) * B * T / max(sitting["seconds"], 1e-9)
    print(f"done: {step} steps, {tokens_seen:,} tokens ({tokens_seen / len(train_tokens):.2f} epochs), "
          f"{elapsed / 60:.1f} min in {len(sittings)} sitting(s), {rate:.0f} tok/s in this one; "
          f"final val {val:.4f}, best val {best_val:.4f}")


if __name__ == "__main__":
    main()
