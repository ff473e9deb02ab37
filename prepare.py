"""prepare.py: your own corpus into nanoGPT's train.bin / val.bin / meta.pkl, which --data DIR reads.

    python prepare.py notes/ papers.jsonl --tokenizer gpt2 --out_dir data/mine      # GPT-2's BPE
    python prepare.py corpus.parquet --column body --tokenizer tok/tokenizer.json --out_dir data/mine
    python prepare.py input.txt --tokenizer char --out_dir data/chars               # nanoGPT's char level

INPUT: text files (one document each), directories (every file under them, in sorted order),
JSONL (one document per line, its --field) and parquet (its --column; needs pyarrow). Each
document's tokens are followed by the end-of-text token. A document goes to val when a hash
of (--seed, its index) falls below --val_fraction, the same on every run; if none does, val is
the last --val_fraction of the tokens (nanoGPT's split of one text). Tokens are uint16, or
uint32 where the vocabulary is larger (meta.pkl's dtype says which; --data honours it).

Tokenizers: char (the corpus's characters, one token each, + end-of-text); gpt2 (tiktoken's;
it downloads its files once: on compute nodes without internet run it once on a login node and
point TIKTOKEN_CACHE_DIR at a shared directory); or PATH/tokenizer.json (a Hugging Face
tokenizer, read with the `tokenizers` package). Work is done in shards of --shard_docs
documents over --workers processes; a shard's tokens are kept under OUT_DIR/.shards, so a
killed prepare restarted does only the shards it had not finished, and no .bin is ever
half-written under its final name (each is written to a temporary name, then renamed).
"""

import argparse
import hashlib
import json
import os
import pickle
import shutil
import sys
import zlib

import numpy as np

EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")  # what tokenizer.json files call it
TEXT_SUFFIXES = (".jsonl", ".parquet")  # everything else is read as one text document


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, directories, .jsonl or .parquet files")
    p.add_argument("--tokenizer", required=True, help="char | gpt2 | PATH/tokenizer.json")
    p.add_argument("--out_dir", required=True, help="where train.bin, val.bin and meta.pkl go")
    p.add_argument("--field", default="text", help="the JSONL field that holds a document's text")
    p.add_argument("--column", default="text", help="the parquet column that holds a document's text")
    p.add_argument("--eot", default=None, help="tokenizer.json's end-of-text token, if not one of " + ", ".join(EOT_NAMES))
    p.add_argument("--val_fraction", type=float, default=0.1, help="the share of documents (or tokens) for val")
    p.add_argument("--seed", type=int, default=2357, help="the split's seed (nanoGPT's openwebtext uses 2357)")
    p.add_argument("--shard_docs", type=int, default=10_000, help="documents per shard (the unit of resuming)")
    p.add_argument("--workers", type=int, default=1, help="processes that tokenize shards in parallel")
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        fail(f"--val_fraction must be between 0 and 1, got {args.val_fraction}")
    if args.shard_docs < 1 or args.workers < 1:
        fail(f"--shard_docs and --workers must be positive, got {args.shard_docs} and {args.workers}")
    return args


def input_files(inputs):
    """Every input file in order: a directory's files sorted, hidden ones skipped."""
    files = []
    for path in inputs:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, and our own .shards
                found += [os.path.join(root, name) for name in names if not name.startswith(".")]
            files += sorted(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            fail(f"{path}: no such file or directory")
    if not files:
        fail(f"{' '.join(inputs)}: no files to read")
    return files


def documents(files, args):
    """Every document's text, in order."""
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        fail(f"{path}:{number} is not JSON ({e})")
                    if not isinstance(record, dict) or args.field not in record:
                        keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                        fail(f"{path}:{number} has no field {args.field!r} (it has {keys}): pass --field")
                    if not isinstance(record[args.field], str):
                        fail(f"{path}:{number}: {args.field!r} is a {type(record[args.field]).__name__}, not text")
                    yield record[args.field]
        elif path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                fail(f"{path}: reading parquet needs pyarrow (pip install pyarrow), which is not installed")
            table = pq.ParquetFile(path)
            if args.column not in table.schema_arrow.names:
                fail(f"{path} has no column {args.column!r} (it has {table.schema_arrow.names[:8]}): pass --column")
            for batch in table.iter_batches(columns=[args.column]):
                for text in batch.column(0).to_pylist():
                    yield text or ""
        else:
            try:
                with open(path, encoding="utf-8") as f:
                    yield f.read()
            except UnicodeDecodeError as e:
                fail(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})")


class Tokenizer:
    """encode(text) -> list of ids, `eot` (its end-of-text id), vocab_size and what meta.pkl
    records of it; built in each worker from its spec (char: the vocabulary found first)."""

    def __init__(self, spec, eot=None, chars=None):
        self.spec, self.meta = spec, {"tokenizer": spec}
        if spec == "char":
            self.stoi = {c: i for i, c in enumerate(chars)}
            self.eot, self.vocab_size = len(chars), len(chars) + 1
            self.meta.update(stoi=self.stoi, itos={i: c for c, i in self.stoi.items()} | {self.eot: "<|endoftext|>"})
        elif spec == "gpt2":
            try:
                import tiktoken
            except ImportError:
                fail("--tokenizer gpt2 needs tiktoken (pip install tiktoken), which is not installed")
            self.enc = tiktoken.get_encoding("gpt2")  # cached under TIKTOKEN_CACHE_DIR after its first download
            self.eot, self.vocab_size = self.enc.eot_token, self.enc.n_vocab
        else:
            if not os.path.isfile(spec):
                fail(f"--tokenizer {spec}: not char, gpt2, or an existing tokenizer.json")
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                fail(f"--tokenizer {spec} needs the tokenizers package (pip install tokenizers), which is not installed")
            try:
                self.enc = HFTokenizer.from_file(spec)
            except Exception as e:
                fail(f"--tokenizer {spec} is not a tokenizer.json that `tokenizers` reads ({str(e)[:120]})")
            names = [eot] if eot else EOT_NAMES
            found = [self.enc.token_to_id(name) for name in names]
            self.eot = next((i for i in found if i is not None), None)
            if self.eot is None:
                fail(f"--tokenizer {spec} has no end-of-text token {names[0] if eot else 'among ' + ', '.join(names)}"
                     ": name it with --eot")
            self.vocab_size = self.enc.get_vocab_size(with_added_tokens=True)
        self.meta.update(vocab_size=self.vocab_size, eot=self.eot,
                         dtype="uint16" if self.vocab_size <= 1 << 16 else "uint32")

    def encode(self, text):
        if self.spec == "char":
            return [self.stoi[c] for c in text]
        if self.spec == "gpt2":
            return self.enc.encode_ordinary(text)
        return self.enc.encode(text, add_special_tokens=False).ids


WORKER = {}


def start_worker(spec, eot, chars):
    WORKER["tokenizer"] = Tokenizer(spec, eot, chars)


def encode_shard(job):
    """A shard's documents to (index, train tokens, val tokens): each document, then end-of-text."""
    index, first, texts, seed, val_fraction = job
    tok, parts = WORKER["tokenizer"], {"train": [], "val": []}
    for n, text in enumerate(texts, first):
        ids = tok.encode(text)
        if ids and max(ids) >= tok.vocab_size:  # an added token the vocabulary does not count
            return index, f"document {n} holds token id {max(ids)}, outside the vocabulary of {tok.vocab_size}", None
        chosen = zlib.crc32(f"{seed}:{n}".encode()) / 2**32 < val_fraction
        parts["val" if chosen else "train"].append(np.array(ids + [tok.eot], dtype=tok.meta["dtype"]))
    return index, None, {split: np.concatenate(p) if p else np.zeros(0, tok.meta["dtype"]) for split, p in parts.items()}


def atomic_write(path, write):
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def shards(files, args, done, total):
    """(index, first document, texts) of every shard not done yet; total[0] counts them all."""
    texts, first = [], 0
    for text in documents(files, args):
        texts.append(text)
        if len(texts) == args.shard_docs:
            if total[0] not in done:
                yield total[0], first, texts
            texts, first, total[0] = [], first + len(texts), total[0] + 1
    if texts:
        if total[0] not in done:
            yield total[0], first, texts
        total[0] += 1


def main(argv=None):
    args = parse_args(argv)
    files = input_files(args.inputs)
    chars = None
    if args.tokenizer == "char":  # the vocabulary is the corpus's characters: one pass first
        chars = sorted(set().union(*(set(text) for text in documents(files, args))))
        if len(chars) >= 1 << 16:
            fail(f"the corpus has {len(chars)} distinct characters: too many for a char vocabulary")
    tok = Tokenizer(args.tokenizer, args.eot, chars)
    # what the shards were made from: a restart with other inputs or settings starts afresh
    recipe = {"files": [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in files],
              **{k: getattr(args, k) for k in ("tokenizer", "field", "column", "eot", "val_fraction", "seed",
                                               "shard_docs")}, "chars": chars}
    key = hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]
    work = os.path.join(args.out_dir, ".shards", key)
    os.makedirs(work, exist_ok=True)
    for other in os.listdir(os.path.dirname(work)):  # shards of other inputs or settings: stale
        if other != key:
            shutil.rmtree(os.path.join(os.path.dirname(work), other))
    done = {int(name.split(".")[0]) for name in os.listdir(work) if name.endswith(".npz")}
    if done:
        print(f"resuming: {len(done)} shard(s) already tokenized in {work}", flush=True)
    total = [0]
    jobs = ((i, first, texts, args.seed, args.val_fraction) for i, first, texts in shards(files, args, done, total))
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda it, **kw: it  # noqa: E731
    pool = None
    if args.workers > 1:
        import multiprocessing
        pool = multiprocessing.get_context("spawn").Pool(args.workers, start_worker, (args.tokenizer, args.eot, chars))
        results = pool.imap(encode_shard, jobs)
    else:
        start_worker(args.tokenizer, args.eot, chars)
        results = map(encode_shard, jobs)
    for index, problem, parts in tqdm(results, desc="shards", unit="shard", disable=None):
        if problem:
            fail(f"{problem} (--tokenizer {args.tokenizer})")
        atomic_write(os.path.join(work, f"{index:06d}.npz"), lambda f, parts=parts: np.savez(f, **parts))
    if pool:
        pool.close()
    count = total[0]
    if count == 0:
        fail(f"{' '.join(args.inputs)}: the corpus is empty (no documents)")
    splits = {"train": [], "val": []}
    for index in range(count):
        with np.load(os.path.join(work, f"{index:06d}.npz")) as shard:
            for split in splits:
                splits[split].append(shard[split])
    splits = {split: np.concatenate(parts) for split, parts in splits.items()}
    if not any((tokens != tok.eot).any() for tokens in splits.values()):  # end-of-text tokens only
        fail(f"{' '.join(args.inputs)}: the corpus is empty (its documents hold no text)")
    if not len(splits["val"]):  # no document drawn for val: the last tokens are (nanoGPT's split of one text)
        cut = len(splits["train"]) - max(1, int(args.val_fraction * len(splits["train"])))
        splits = {"train": splits["train"][:cut], "val": splits["train"][cut:]}
    for split, tokens in splits.items():
        atomic_write(os.path.join(args.out_dir, f"{split}.bin"), lambda f, tokens=tokens: f.write(tokens.tobytes()))
    atomic_write(os.path.join(args.out_dir, "meta.pkl"), lambda f: pickle.dump(tok.meta, f))
    shutil.rmtree(os.path.dirname(work))  # done: the shards are in the .bin files
    print(f"{args.out_dir}: train.bin {len(splits['train']):,} tokens, val.bin {len(splits['val']):,} tokens "
          f"({tok.meta['dtype']}), vocab_size {tok.vocab_size}, end-of-text {tok.eot}; train with --data {args.out_dir}")


if __name__ == "__main__":
    main()
