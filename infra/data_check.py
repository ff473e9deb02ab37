"""The data checked before the run: every token file of --data scanned once per job, each
rank its slice, for ids outside the vocabulary and files too short for one window
(start.agree makes every rank act on what any rank found)."""

import os

import numpy as np

from common import Data, token_dtype, SHAKESPEARE_MISSING, SHAKESPEARE_TRAIN_FRACTION, SHAKESPEARE_TXT, SPLITS, SYNTHETIC_TOKENS


DATA_SCAN_CHUNK = 1 << 24  # tokens per read when scanning a file for out-of-vocabulary ids (32 MiB)


def data_problem(spec, block_size, rank=0, world_size=1):
    """The reason this --data cannot be used with this block size, or None. Each rank
    scans its 1/world_size slice of every token file once for ids outside the vocabulary
    (a chunked pass over the memmap), so the whole of every file is checked once per job;
    `agree` then makes every rank act on whatever any rank found."""
    if spec in ("shakespeare_char", "synthetic"):
        if spec == "shakespeare_char" and not os.path.exists(SHAKESPEARE_TXT):
            return SHAKESPEARE_MISSING  # a script copied without data/
        if spec == "synthetic":
            lengths = SYNTHETIC_TOKENS
        else:
            n = len(open(SHAKESPEARE_TXT, encoding="utf-8").read())
            lengths = {"train": int(SHAKESPEARE_TRAIN_FRACTION * n), "val": n - int(SHAKESPEARE_TRAIN_FRACTION * n)}
        for split, n in lengths.items():
            if n < block_size + 2:
                return (f"--data {spec}: its {split} split holds {n} tokens; block_size {block_size} "
                        f"needs at least block_size+2 = {block_size + 2} (lower --block_size)")
        return None
    vocab, source, problem = Data.vocabulary(spec)
    if problem:
        return problem
    for split in SPLITS:
        path = os.path.join(spec, f"{split}.bin")
        if os.path.isdir(path):
            return f"--data {spec}: {path} is a directory, not a token file"
        if not os.path.exists(path):
            return f"--data {spec}: {split}.bin is missing"
        if not os.path.isfile(path):  # a FIFO, a socket, a device: token files are read at random positions
            return f"--data {spec}: {path} is not a regular file (a FIFO, socket or device): token files must be files"
        size, dtype = os.path.getsize(path), token_dtype(spec)
        if size % dtype.itemsize:
            return f"{path} is {size} bytes, not a whole number of {dtype} tokens (truncated or not nanoGPT's format?)"
        if size // dtype.itemsize < block_size + 2:
            return (f"{path} holds {size // dtype.itemsize} tokens, fewer than block_size+2 = {block_size + 2} "
                    "(the batch sampler needs one window of block_size+1 tokens and a choice of start)")
        try:
            tokens = np.memmap(path, dtype=dtype, mode="r")
        except OSError as e:  # unreadable: permissions, a stale network mount
            return f"{path} cannot be read: {e.strerror or e}"
        lo, hi = rank * len(tokens) // world_size, (rank + 1) * len(tokens) // world_size
        for a in range(lo, hi, DATA_SCAN_CHUNK):
            chunk = np.asarray(tokens[a:min(hi, a + DATA_SCAN_CHUNK)])
            if chunk.max() >= vocab:
                at = a + int(np.argmax(chunk >= vocab))
                return (f"{path} holds token id {int(tokens[at])} at position {at}, outside the vocabulary: "
                        f"ids must be below {vocab}, {source}")
    return None
