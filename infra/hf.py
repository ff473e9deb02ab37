"""Hugging Face GPT-2 in and out, without a dependency: a transformers directory (config.json,
model.safetensors) written from nanoGPT's names and read back into them. The safetensors format
is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}}),
then the raw little-endian tensors, so it is written and read here by hand. GPT-2's Conv1D
stores its weight as (in, out), the transpose of nn.Linear's (out, in): the four matrices of a
block are transposed each way. transformers' GPT-2 always has biases and a tied head; nanoGPT's
names are its names. docs/data.md says what is exported and imported and how."""

import json
import os
import struct
import sys

import torch

# safetensors' dtype names (its format's spec) and torch's
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # (in, out) in GPT-2
GPT2_VOCAB, GPT2_PADDED = 50257, 50304  # GPT-2's tokens, and nanoGPT's padding of them to a multiple of 64
GPT2_EOT = 50256  # <|endoftext|>
HEADER_MAX = 100 << 20  # a header longer than 100 MiB is not a model's (a foreign or damaged file)


class HFError(Exception):
    """One line: why a Hugging Face directory cannot be read or written."""


def write_safetensors(tensors, path):
    """`tensors` ({name: CPU tensor}) to `path` in the safetensors format, through a temporary
    name renamed at the end: a killed write never leaves a half file under the final name."""
    assert sys.byteorder == "little", "safetensors' tensors are little-endian; this host is not"
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format recommends
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for t in tensors.values():
                f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_safetensors(path):
    """{name: tensor} of a safetensors file, its header checked against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(HEADER_MAX, size - 8):
            raise HFError(f"{path} is not a safetensors file (its header length reads {n}, the file is {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise HFError(f"{path}: its safetensors header is not JSON ({e})") from None
        data = f.read()
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HFError(f"{path}: {name}'s entry {str(entry)[:80]} is not a safetensors tensor "
                          f"(dtypes: {', '.join(DTYPES)})") from None
        count = 1
        for s in shape:
            count *= s
        if not 0 <= begin <= end <= len(data) or end - begin != count * torch.empty((), dtype=dtype).element_size():
            raise HFError(f"{path}: {name} ({entry['dtype']} {shape}) lies outside the file or has the wrong length "
                          "(truncated?)")
        tensors[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(shape) if count else \
            torch.empty(shape, dtype=dtype)
    return tensors


def hf_config(model_args, vocab_size):
    """transformers' GPT2Config of our model: the same sizes, exact GELU (nn.GELU(), not
    GPT-2's tanh approximation "gelu_new"), LayerNorm's eps 1e-5, the head tied to wte."""
    dropout = model_args.get("dropout", 0.0)
    eot = GPT2_EOT if vocab_size == GPT2_VOCAB else None  # other vocabularies: no end-of-text id known here
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
            "n_positions": model_args["block_size"], "n_ctx": model_args["block_size"],
            "n_embd": model_args["n_embd"], "n_layer": model_args["n_layer"], "n_head": model_args["n_head"],
            "n_inner": None, "activation_function": "gelu", "resid_pdrop": dropout, "embd_pdrop": dropout,
            "attn_pdrop": dropout, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "bos_token_id": eot, "eos_token_id": eot, "dtype": "float32",
            "use_cache": True}


def export_hf(state, model_args, directory):
    """Our model's consolidated state dict (nanoGPT's names) to `directory` as transformers'
    GPT-2: config.json and model.safetensors. Returns what the export changed, in words.
    GPT-2's 50257 tokens padded to 50304 (nanoGPT's, for --data without meta.pkl) are written
    as 50257 rows: the padding is never a token. A model without biases gets zero biases (GPT-2
    always has them): the same function."""
    if model_args.get("n_expert", 0):
        raise HFError(f"--export_hf: a mixture-of-experts model ({model_args['n_expert']} experts) has no GPT-2 form")
    vocab, notes = model_args["vocab_size"], []
    if vocab == GPT2_PADDED:
        vocab = GPT2_VOCAB
        notes.append(f"GPT-2's {GPT2_VOCAB} tokens (the {GPT2_PADDED - GPT2_VOCAB} rows of nanoGPT's padding dropped)")
    elif vocab != GPT2_VOCAB:
        notes.append(f"a {vocab}-token vocabulary, not GPT-2's: use the tokenizer of the run's --data (meta.pkl)")
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            continue  # tied to wte; transformers ties it again on load
        t = t.float()
        if name == "transformer.wte.weight":
            t = t[:vocab]
        out[name] = t.t().contiguous() if name.endswith(CONV1D) else t.contiguous()
    if not model_args.get("bias", True):
        for name in list(out):
            if name.endswith((".weight",)) and not name.endswith(("wte.weight", "wpe.weight")):
                bias = name[:-len("weight")] + "bias"
                out[bias] = torch.zeros(out[name].shape[-1] if name.endswith(CONV1D) else out[name].shape[0])
        notes.append("zero biases (this model has none; GPT-2 always has them)")
    os.makedirs(directory, exist_ok=True)
    write_safetensors(dict(sorted(out.items())), os.path.join(directory, "model.safetensors"))
    tmp = os.path.join(directory, f"config.json.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(hf_config(model_args, vocab), f, indent=2)
    os.replace(tmp, os.path.join(directory, "config.json"))
    return notes


def read_hf_weights(directory, load_tensors):
    """{name: tensor} of a transformers directory: model.safetensors, a sharded one (its
    index.json), or pytorch_model.bin if it holds tensors only (`load_tensors`, weights-only)."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        return read_safetensors(single)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
        tensors = {}
        for name in files:
            tensors.update(read_safetensors(os.path.join(directory, name)))
        return tensors
    legacy = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(legacy):
        obj, problem = load_tensors(legacy)
        if problem:
            raise HFError(f"{legacy} {problem}")
        return obj
    raise HFError(f"{directory} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def import_hf(directory, config, load_tensors):
    """A transformers GPT-2 directory as (vocab_size, nanoGPT state dict, notes): the sizes
    checked against `config` (ours, from the flags and --data), Conv1D's matrices transposed, wpe
    cut to our block_size, the tied head restored. The vocabularies must agree, but for GPT-2's
    50257 where --data without meta.pkl says nanoGPT's padded 50304: the model takes the 50257."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"--init_from hf:{directory}: no config.json there (a directory of save_pretrained's?)")
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type") != "gpt2":
        raise HFError(f"--init_from hf:{directory} is a {hf.get('model_type')!r} model; only GPT-2 ('gpt2') is read")
    ours = {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd}
    theirs = {k: hf.get(k) for k in ours}
    if theirs != ours:
        raise HFError(f"--init_from hf:{directory} holds another model: {theirs}, this run builds {ours} "
                      "(pass --n_layer --n_head --n_embd, or the --model preset, to match)")
    odd = {k: hf.get(k, default) for k, default, want in (
        ("n_inner", None, (None, 4 * config.n_embd)), ("layer_norm_epsilon", 1e-5, (1e-5,)),
        ("scale_attn_weights", True, (True,)), ("scale_attn_by_inverse_layer_idx", False, (False,)),
        ("tie_word_embeddings", True, (True,))) if hf.get(k, default) not in want}
    if odd:
        raise HFError(f"--init_from hf:{directory}: {odd} differ from nanoGPT's GPT-2 (this model cannot hold them)")
    if hf.get("n_positions", 0) < config.block_size:
        raise HFError(f"--init_from hf:{directory} has {hf.get('n_positions')} positions; --block_size "
                      f"{config.block_size} needs as many (lower --block_size)")
    vocab, notes = hf.get("vocab_size"), []
    if vocab != config.vocab_size and not (vocab == GPT2_VOCAB and config.vocab_size == GPT2_PADDED):
        raise HFError(f"--init_from hf:{directory} has {vocab} tokens, --data's vocabulary {config.vocab_size}: "
                      "prepare the data with the model's tokenizer (prepare.py --tokenizer)")
    if vocab != config.vocab_size:
        notes.append(f"the model takes GPT-2's {vocab} tokens, not the {config.vocab_size} of nanoGPT's padding "
                     "(--data without meta.pkl), never a token")
    if hf.get("activation_function", "gelu_new") != "gelu":
        notes.append(f"its activation is {hf.get('activation_function', 'gelu_new')!r}, ours exact GELU (as nanoGPT "
                     "loads GPT-2): logits differ slightly (the approximation is within 1e-3 of GELU)")
    raw = read_hf_weights(directory, load_tensors)
    state = {}
    for name, t in raw.items():
        name = name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"  # GPT2Model's
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old versions' causal-mask buffers
        state[name] = t.float().t().contiguous() if name.endswith(CONV1D) else t.float()
    head = state.pop("lm_head.weight", None)
    if "transformer.wte.weight" not in state:
        raise HFError(f"--init_from hf:{directory} holds no transformer.wte.weight (not GPT-2's names)")
    if head is not None and not torch.equal(head, state["transformer.wte.weight"]):
        raise HFError(f"--init_from hf:{directory}: lm_head.weight differs from wte (untied); this model ties them")
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:config.block_size]
    state["lm_head.weight"] = state["transformer.wte.weight"]
    if not config.bias:
        biases = [k for k in state if k.endswith(".bias")]
        if any(state[k].any() for k in biases):
            raise HFError(f"--init_from hf:{directory} has biases, this run's model none: pass --bias True")
        for k in biases:
            del state[k]
    return vocab, state, notes
