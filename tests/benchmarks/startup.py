"""Start-up to the first step, 01_single_gpu.py against nanoGPT's training script, side by side
(issue 48): whole-process time, from the launch of a fresh interpreter to the line each
prints after its first optimizer step ("step 0: ..." and "iter 0: ..."), at the same
configuration (nanoGPT's baby GPT, 6 x 384, on CPU in fp32, 12 sequences of 64 tokens, no
accumulation, one evaluation of one batch per split before the step, as nanoGPT's loop
makes at iteration 0). The runs alternate, so that the machine's load falls on both alike.

    python tests/benchmarks/startup.py [--nanogpt DIR] [--repeats N]

nanoGPT is run from its own files (DIR, default ../shared/anchors/nanoGPT), in a scratch
directory that links them and holds the same corpus tokenised as nanoGPT's data preparation does
(characters, uint16 train.bin / val.bin, meta.pkl). Prints each run's seconds and the
medians, their difference and ratio."""

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(n_layer=6, n_head=6, n_embd=384, block_size=64, dropout=0.2, bias=False)


def nanogpt_dir(anchor):
    """A scratch directory for nanoGPT: its three files linked, the corpus as nanoGPT's data preparation makes it."""
    work = tempfile.mkdtemp(prefix="nanogpt_")
    for name in ("train.py", "model.py", "configurator.py"):
        os.symlink(os.path.join(anchor, name), os.path.join(work, name))
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt")).read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = os.path.join(work, "data", "shakespeare_char")
    os.makedirs(data)
    cut = int(len(text) * 0.9)
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(os.path.join(data, f"{split}.bin"))
    with open(os.path.join(data, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return work


def first_step_seconds(command, cwd, marker):
    """Seconds from the launch to the first stdout line starting with `marker`; the process
    is then left to finish."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = None
    for line in proc.stdout:
        if seconds is None and line.startswith(marker):
            seconds = time.perf_counter() - t0
    if proc.wait() != 0 or seconds is None:
        sys.exit(f"{' '.join(command)} failed (status {proc.returncode}) or printed no '{marker}' line")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nanogpt", default=os.path.join(ROOT, "..", "..", "shared", "anchors", "nanoGPT"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ours", default=ROOT, help="the checkout whose 01_single_gpu.py runs (another to compare)")
    args = parser.parse_args()
    work = nanogpt_dir(os.path.abspath(args.nanogpt))
    ours = [sys.executable, os.path.join(args.ours, "01_single_gpu.py"), "--model", "shakespeare", "--device", "cpu",
            "--dtype", "float32", "--block_size", "64", "--global_batch_size", "12", "--micro_batch_size", "12",
            "--max_iters", "1", "--eval_interval", "1", "--eval_iters", "1", "--sample_tokens", "0",
            "--log_interval", "1"]
    theirs = [sys.executable, "train.py", "--dataset=shakespeare_char", "--device=cpu", "--compile=False",
              "--dtype=float32", "--batch_size=12", "--gradient_accumulation_steps=1", "--max_iters=0",
              "--eval_iters=1", "--log_interval=1", f"--out_dir={os.path.join(work, 'out')}",
              *(f"--{k}={v}" for k, v in SHAPE.items())]
    times = {"01_single_gpu.py": [], "nanoGPT train.py": []}
    for _ in range(args.repeats):
        times["01_single_gpu.py"].append(first_step_seconds(ours, args.ours, "step 0:"))
        times["nanoGPT train.py"].append(first_step_seconds(theirs, work, "iter 0:"))
    for name, seconds in times.items():
        print(f"{name:<18} " + " ".join(f"{s:.2f}" for s in seconds) + f"  median {statistics.median(seconds):.2f} s")
    a, b = (statistics.median(v) for v in times.values())
    print(f"01 - nanoGPT: {a - b:+.2f} s, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
