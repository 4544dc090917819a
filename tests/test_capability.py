"""train/capability.py, the capability table of weights/README.md: every cell comes from its
source (./run --info's shape, PyTorch's NLL, the validation tables of the README's checkpoint
sections, the bench report), on small random checkpoints and a README and bench report
written here."""
import math
import os
import re
import subprocess
import sys

import report
from conftest import ROOT, RUN, TOKENIZER

STORIES = ["Once upon a time, a little fox named Pip lived near a big green hill.",
           "Tom had a red ball. He liked to throw it to his dog every day.",
           "The sun was hot. Lily went to the pond to look at the ducks."]


def test_capability_table(small_checkpoints, tmp_path):
    valid = tmp_path / "valid.txt"
    valid.write_text("\n<|endoftext|>\n".join(STORIES) + "\n")
    readme = tmp_path / "README.md"
    bench = tmp_path / "bench.csv"
    rows = ["section,variant,mode,quantity,value,unit"]
    sections = ["# weights/\n\n| minutes | tokens | validation loss |\n|---:|---:|---:|\n| 1.0 | 2,002,944 | 9.9999 |\n"]
    for i, v in enumerate(("mha", "mla64")):
        sections.append(f"## {v}.bin\n\n| | |\n|---|---|\n| tokens seen | 4,001,792 |\n\n"
                        "| minutes | tokens | validation loss |\n|---:|---:|---:|\n"
                        f"| 38.0 | 2,002,944 | {2.5 + i:.4f} |\n| 80.0 | 4,001,792 | {2.25 + i:.4f} |\n")
        rows += [f"c,{v},kv,step_ms_median,{0.5 + i},ms", f"c,{v},no-kv,step_ms_median,99,ms",
                 f"batch,{v},B=64,tokens_per_s_median,{1000 * (i + 2)},tokens/s",
                 f"batch,{v},B=1,tokens_per_s_median,7,tokens/s"]
    bench.write_text("\n".join(rows) + "\n")
    readme.write_text("\n".join(sections))
    paths = [small_checkpoints[v][0] for v in ("mha", "mla64")]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train", "capability.py"), "--valid", str(valid),
                        "--bench", str(bench), "--readme", str(readme), "--prompts", "3"] + paths,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, RUN_BINARY=RUN),
                       timeout=600)
    assert p.returncode == 0, p.stderr
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in p.stdout.splitlines() if re.match(r"\| (mha|mla64) \| [\d,]+ \|", line)}
    assert set(table) == {"mha", "mla64"}
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    for i, v in enumerate(("mha", "mla64")):
        model = small_checkpoints[v][1]
        cfg = model.cfg
        kv, params, nll, ppl, agreement, ms, tps = table[v]
        per_token = 4 * cfg.n_layers * (2 * cfg.n_kv_heads * cfg.head_dim if v == "mha" else cfg.kv_latent + cfg.rope_dim)
        assert int(kv.replace(",", "")) == per_token
        assert params == f"{sum(t.numel() for t in model.state_dict().values()) / 1e6:.2f} M"
        assert abs(float(nll) - report.pytorch_nll(model, STORIES, sp)[0]) < 1e-3
        assert abs(float(ppl) - math.exp(float(nll))) < 2e-3 * float(ppl)
        assert agreement.startswith("3/3, "), agreement
        assert float(ms) == 0.5 + i and tps == f"{1000 * (i + 2):,}"
    curves = [line for line in p.stdout.splitlines() if re.match(r"\| (mha|mla64) \| \d\.\d{4} \|", line)]
    assert curves == ["| mha | 2.5000 | 2.2500 |", "| mla64 | 3.5000 | 3.2500 |"], p.stdout
    assert "| variant | 2M | 4M |" in p.stdout
    assert p.stdout.count("- mha: Once upon a time") == 1 and p.stdout.count("- mla64: Once upon a time") == 1
