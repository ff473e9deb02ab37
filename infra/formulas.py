"""Cost formulas: one expression gives both the text printed beside a number and the number
(formula, plus), and the terms every script's costs() is built from: the training FLOPs per
token (PaLM's 6N + 12LHQT), Muon's matrices (hidden_matrix_shapes) and their Newton-Schulz
FLOPs, the activations this model saves for backward (Korthikanti et al.'s count, op by op for
common.py's model and PyTorch's kernels), the transients of a step's phases, the peaks by phase;
and format_bytes, bytes as a reader reads them. Pure arithmetic on a config: no process group,
no tensor of the run."""

import ast
import math
from fractions import Fraction

import torch

from common import pick_device


def flops_per_token(config, n_params):
    """Training FLOPs per token, PaLM appendix B (as nanoGPT's estimate_mfu): 6N for the
    matrix multiplies forward and backward, plus 12·L·H·Q·T for attention."""
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, config.block_size
    if config.n_expert:  # a token runs through top_k of the E experts: count only the active ones
        n_params -= L * (config.n_expert - config.top_k) * expert_params(config)
    return 6 * n_params + 12 * L * H * Q * T


def newton_schulz_flops(shapes):
    """Muon's Newton-Schulz FLOPs per step on the matrices of full `shapes` (those one rank
    orthogonalises), as one formula. common.orthogonalize turns a tall matrix on its wide side,
    so X is r x c with r <= c, and each of its NS_STEPS steps runs three matrix products:

        A = X·Xᵀ      2r²c        (r x c times c x r)
        A·A           2r³         inside B = b·A + c·A·A (one addmm)
        B·X           2r²c        inside X <- a·X + B·X (one addmm)

    NS_STEPS·(4Σr²c + 2Σr³) over the matrices: what torch.utils.flop_counter counts of
    orthogonalize (2 per multiply-add; the normalisation and the additions are not counted)."""
    from common import NS_STEPS
    wide = [(min(shape), max(shape)) for shape in shapes]
    return formula("NS*(4*Σr2c + 2*Σr3)", show="NS", NS=NS_STEPS, Σr2c=sum(r * r * c for r, c in wide),
                   Σr3=sum(r ** 3 for r, _ in wide))


def expert_params(config):
    """Parameters of one MLP (one expert): c_fc h x 4h and c_proj 4h x h, with their biases."""
    h = config.n_embd
    return 8 * h * h + (5 * h if config.bias else 0)


class Formula(tuple):
    """(text, bytes), the pair every reader of costs() takes; `expr` (Python) and `symbols`
    (the values of the letters left in the text) say where both came from, and `key` is all
    three, made once, for the memo of any formula that names this one."""


def formula(expr, show="", **symbols):
    """One cost, written once: `expr` is Python arithmetic over named symbols (Ψ, b, s, h,
    ...), evaluated exactly for the number (fractions; a result that is not whole is an
    error) and written as the papers write it for the text: 4*b*s*h -> 4bsh, s**2 -> s²,
    ceil(x) -> ⌈x⌉. A symbol keeps its letter unless `show` names it (e=2 bytes, m=4
    micro-batches): then its value is printed. A symbol may be a Formula: by name it stands
    for its bytes ("n·layer"); shown, its expression is written in place.
        formula("4*Ψ + 4*loss", Ψ=10, loss=1)             -> ("4Ψ + 4·loss", 44)
        formula("m*2*e*b*s*h", show="m e", m=3, e=2, ...)  -> ("3·2·2bsh", 12·b·s·h)
    Remembered: plan.py and the fit check ask for the same formula at the same values
    thousands of times (every rank of every layout, every micro-batch tried)."""
    key = (expr, show, tuple(sorted((name, v.key if isinstance(v, Formula) else v) for name, v in symbols.items())))
    if key not in _FORMULAS:
        if len(_FORMULAS) > 200_000:
            _FORMULAS.clear()
        _FORMULAS[key] = _formula(expr, show, symbols)
    return _FORMULAS[key]


_FORMULAS = {}


def _formula(expr, show, symbols):
    """The formula at these values: its shape (the text, the expression, the compiled code) made
    once for each set of shown values, since the letters kept are only read for the number."""
    shown = set(show.split())
    key = (expr, show, tuple(sorted((name, type(v).__name__, v.expr if isinstance(v, Formula) else v)
                                    for name, v in symbols.items() if name in shown)))
    if key not in _SHAPES:
        if len(_SHAPES) > 50_000:
            _SHAPES.clear()
        _SHAPES[key] = _shape(expr, shown, symbols)
    text, unparsed, code, reads = _SHAPES[key]
    kept = {}
    for name, inlined in reads:  # the letters in the order the tree names them, as the shape read them
        value = symbols[name]
        pairs = value.symbols.items() if inlined else \
            [(name, int(value[1] if isinstance(value, Formula) else value))]
        for letter, v in pairs:
            if kept.setdefault(letter, v) != v:
                raise ValueError(f"{expr}: symbol {letter} is {kept[letter]} and {v}")
    value = _run(code, kept)
    if value.denominator != 1:
        raise ValueError(f"cost formula {expr} = {value} at {symbols}: not a whole number of bytes")
    out = Formula((text, int(value)))
    out.expr, out.symbols = unparsed, kept
    out.key = (tuple(out), unparsed, tuple(sorted(kept.items())))  # this formula as a symbol of another's key
    return out


_SHAPES = {}


def _shape(expr, shown, symbols):
    """(text, Python expression, compiled code, the letters it reads) of `expr` with the shown
    symbols written in: what a formula is at any values of the letters it keeps."""
    reads = []

    def inline(node):  # shown symbols by their value (a shown Formula: its own expression)
        if isinstance(node, ast.Name) and node.id in shown:
            value = symbols[node.id]
            if isinstance(value, Formula):
                reads.append((node.id, True))  # its letters and their values join this formula's
                return ast.parse(value.expr, mode="eval").body
            return ast.Constant(value, kind="shown")
        if isinstance(node, ast.Name) and node.id not in ("max", "min", "ceil"):
            reads.append((node.id, False))
        for field, child in ast.iter_fields(node):
            if isinstance(child, ast.AST):
                setattr(node, field, inline(child))
            elif isinstance(child, list):
                setattr(node, field, [inline(c) for c in child])
        if not isinstance(node, ast.BinOp):
            return node
        # shown values as the papers would write them: k - 1 at k = 3 is 2, 1·x is x, 0·x + y is y
        left, right = (c.value if getattr(c, "kind", None) == "shown" else None for c in (node.left, node.right))
        if isinstance(node.op, (ast.Add, ast.Sub)) and (left, right) != (None, None) and \
                isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant):
            return ast.Constant(int(_evaluate(node, {})), kind="shown")
        if isinstance(node.op, ast.Mult) and 0 in (left, right):
            return ast.Constant(0, kind="shown")
        if isinstance(node.op, ast.Mult) and 1 in (left, right):
            return node.right if left == 1 else node.left
        if isinstance(node.op, (ast.Add, ast.Sub)) and right == 0 or isinstance(node.op, ast.Add) and left == 0:
            return node.left if right == 0 else node.right
        return node

    tree = inline(ast.parse(expr, mode="eval").body)
    return _written(tree)[0], ast.unparse(tree), _compiled(tree), reads


def plus(*terms):
    """The sum of some formulas (None: a term that does not apply), each written in place."""
    terms = {f"t{i}": t for i, t in enumerate(terms) if t is not None}
    return formula(" + ".join(terms) or "0", show=" ".join(terms), **terms)


def _evaluate(tree, symbols):
    """The exact value of an expression tree: its symbols as fractions, so that / is exact."""
    return _run(_compiled(tree), symbols)


def _compiled(tree):
    return compile(ast.fix_missing_locations(ast.Expression(tree)), "<formula>", "eval")


def _run(code, symbols):
    scope = {"max": max, "min": min, "ceil": lambda x: Fraction(math.ceil(x)), "__builtins__": {}}
    return Fraction(eval(code, scope, {name: Fraction(v) for name, v in symbols.items()}))


def _written(node):
    """(text, precedence, first atom, last atom) of an expression tree: products juxtaposed
    where the papers would (4bsh, 2(...), L·layer), a quotient's divisor always a single atom."""
    if isinstance(node, ast.Constant):
        return str(node.value), 9, "num", "num"
    if isinstance(node, ast.Name):
        atom = "short" if len(node.id) == 1 else "psi" if node.id.startswith("Ψ") else "long"
        return node.id, 9, atom, "long" if atom == "psi" else atom
    if isinstance(node, ast.Call):
        inner = ", ".join(_written(a)[0] for a in node.args)
        return (f"⌈{inner}⌉", 9, "paren", "paren") if node.func.id == "ceil" else (
            f"{node.func.id}({inner})", 9, "long", "paren")
    op = type(node.op)
    prec = {ast.Add: 1, ast.Sub: 1, ast.Mult: 2, ast.Div: 2, ast.Pow: 3}[op]
    left, right = _written(node.left), _written(node.right)
    lt = f"({left[0]})" if left[1] < prec else left[0]
    rt = f"({right[0]})" if right[1] < prec + (op in (ast.Sub, ast.Div, ast.Pow)) else right[0]
    first = "paren" if left[1] < prec else left[2]
    last = "paren" if right[1] < prec + (op in (ast.Sub, ast.Div)) else right[3]
    if op is ast.Pow:
        return lt + rt.translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")), prec, first, "long"
    if op is ast.Mult:
        juxtapose = (left[3] if left[1] >= prec else "paren") in ("num", "short", "paren") and \
            (right[2] if right[1] >= prec else "paren") in ("short", "psi", "paren")
        return lt + ("" if juxtapose else "·") + rt, prec, first, last
    return f"{lt}{' + ' if op is ast.Add else ' - ' if op is ast.Sub else '/'}{rt}", prec, first, \
        "long" if op is ast.Div else last


def activation_device_type(args):
    """The device whose kernels decide what is saved: --device, or for auto the GPU a dry
    run plans for, and in a live run the device this machine has."""
    if args.device != "auto":
        return args.device
    return "cuda" if args.dry_run else pick_device("auto", 0)[0].type


def sdpa_logsumexp(heads, tokens, dtype, device_type):
    """The expression of the fp32 logsumexp SDPA's flash / memory-efficient kernels save for
    backward, b x heads x tokens; in fp32 on GPUs the memory-efficient kernel pads the tokens
    to a multiple of 32."""
    padded = device_type in ("cuda", "xpu") and torch.tensor([], dtype=dtype).element_size() == 4
    return f"4*b*{heads}*" + (f"32*ceil({tokens}/32)" if padded else tokens)


def activation_terms(config, b, s, dtype, device_type, tp=1, sp=False, param_dtype=torch.float32,
                     attention=None, expert_rows=None):
    """Bytes this model's ops save for backward for one micro-batch of b sequences of s
    tokens (h = n_embd, a = n_head, V = vocab), counted op by op for common.py's model and
    PyTorch's kernels, with tensor parallelism over tp ranks (Megatron's split: the
    attention heads and the MLP's 4h are sharded, LayerNorms and the residual stream are
    not) and sequence parallelism (the replicated parts are sharded along s instead, and the
    column-parallel Linears keep only their input's sequence shard: every term of a block is
    /T, so a block holds 1/T of what it holds without tensor parallelism).
    Returns {term: formula (text, bytes)} with `layer` (one transformer block), `block_input`
    (what --recompute keeps of a block), `embedding` (dropout's mask) and `head` (ln_f,
    the head's input, the log-softmax of the logits; with tp the caller adds its own
    vocabulary-parallel head). Per block, with e = bytes of the compute dtype (fp32 or
    bf16 under autocast; LayerNorm, the residual stream and softmax stay fp32). Where the
    parameters themselves are stored in the compute dtype (`param_dtype`: ZeRO-3's and
    FSDP's gathered bf16 units) the residual stream is bf16 too: the LayerNorms save it as
    it is on CPU (input and mean, rstd in bf16) and an fp32 copy on GPUs (autocast's fp32 list):

      LayerNorm x2: input 4bsh + mean, rstd 8bs each; its output, the next Linear's input, ebsh
      attention:    q, k, v (one storage, c_attn's output) 3ebsh, output ebsh (also c_proj's
                    input), logsumexp 4bas (flash / CPU flash: no s x s scores)
      MLP:          GELU input 4ebsh, c_proj input 4ebsh
      dropout p>0:  a mask per dropout (residual x2, embedding): bool on GPUs (1 byte), the
                    input's dtype on CPU; attention dropout on CPU falls back to the math
                    kernel: q, k, v copies 12bsh and three s x s tensors 12bas^2 (softmax,
                    mask, dropped) instead of q, k, v, output and logsumexp
      fp32, dropout 0:  64bsh + 16bs + 4bas   (Korthikanti et al.'s 34sbh + 5as^2b in 16 bits)
      bf16, dropout 0:  36bsh + 16bs + 4bas
    `attention`, a formula over these symbols, replaces the attention term where a script
    runs another attention than common's (09's ring attention and Ulysses, which also apply no dropout
    to the attention probabilities)."""
    h, a, V = config.n_embd, config.n_head, config.vocab_size
    e = torch.tensor([], dtype=dtype).element_size()
    gpu = device_type in ("cuda", "xpu")
    dropout = config.dropout > 0
    r = torch.tensor([], dtype=param_dtype).element_size()  # the residual stream's bytes
    n = 4 if gpu else r  # what a LayerNorm saves of its input, and of its mean and rstd
    d = 1 if gpu else e  # a dropout mask: bool on GPUs, the input's dtype on CPU
    sp_T = "/T" if sp else ""  # sequence parallelism: the replicated parts are /T too

    def term(expr, **more):
        return formula(expr, show="e r n d R", b=b, s=s, h=h, a=a, V=V, T=tp, e=e, r=r, n=n, d=d, **more)

    # with sequence parallelism the LayerNorms work on sequence shards, and the
    # column-parallel Linears after them keep only that shard of their input (they gather
    # it again in backward), so the whole term is /T
    terms = {"layernorms": term(f"2*(n*b*s*h + 2*n*b*s + e*b*s*h){sp_T}")}
    if attention is not None:
        terms["attention"] = attention
    elif dropout and not gpu:  # CPU's math kernel
        terms["attention"] = term("(12*b*s*h + 12*b*a*s**2 + e*b*s*h)/T")
    else:
        terms["attention"] = term(f"(4*e*b*s*h + {sdpa_logsumexp('a', 's', dtype, device_type)})/T")
    terms["mlp"] = term("8*e*b*s*h/T")
    if dropout:  # residual dropouts: after c_proj (compute dtype) in attention and MLP
        terms["dropout masks"] = term(f"2*d*b*s*h{sp_T}")
    if config.n_expert:  # a mixture of experts (no tp): R rows through the experts (k·b·s, or
        # `expert_rows`: those a rank's experts received), each an MLP's 9e·h (its input cast,
        # GELU's and c_proj's inputs); the combine keeps the k·b·s outputs and the fp32 weights;
        # the router its probabilities (bsE), the top-k (2bsk), their sum (bs), f_e (bE)
        k, E = config.top_k, config.n_expert
        R = expert_rows if expert_rows is not None else k * b * s
        terms["mlp"] = term("9*e*R*h + e*k*b*s*h + 4*b*s*(E + 2*k + 1) + 4*b*E", k=k, E=E, R=R)
        if dropout:  # each expert's output dropout, instead of the MLP's
            terms["dropout masks"] = term("d*b*s*h + d*R*h", R=R)
        if config.shared_experts:  # S MLPs on every token: GELU's and c_proj's inputs 8e·bsh, and under
            # autocast the input's own cast c = e (in fp32 the input is the router's, counted above)
            terms["shared experts"] = term("S*(8*e + c)*b*s*h" + (" + S*d*b*s*h" if dropout else ""),
                                           S=config.shared_experts, c=0 if e == 4 else e)
    return {"layer": plus(*terms.values()),
            "block_input": term(f"r*b*s*h{sp_T}"),
            "embedding": term(f"{'d' if gpu else 'r'}*b*s*h{sp_T}" if dropout else "0"),
            "head": term("n*b*s*h + 2*n*b*s + e*b*s*h + 4*b*s*V + 4")}


def activation_phases(terms, n_layers, recompute, first=True, last=True):
    """(kept, during_backward): the bytes one micro-batch through n_layers blocks (with the
    embedding if first, the head if last) holds from the end of its forward until its
    backward, and the most it holds while its backward runs. Without recompute backward
    only frees: during = kept. With --recompute only block inputs are kept, and the
    backward of the last block holds the other inputs and that block's internals."""
    emb = terms["embedding"][1] if first else 0
    head = terms["head"][1] if last else 0
    layer, block_in = terms["layer"][1], terms["block_input"][1]
    if not recompute:
        kept = emb + n_layers * layer + head
        return kept, kept
    return emb + n_layers * block_in + head, emb + (n_layers - 1) * block_in + layer


def activations_of_layers(terms, n_layers, recompute, first=True, last=True, in_flight=1):
    """The formula of the peak this rank holds for backward: `in_flight` micro-batches through
    n_layers blocks have run their forward, and the oldest runs its backward (see
    activation_phases; 1F1B's stage holds min(p - stage, m) of them)."""
    emb, head = "embedding + " * first, " + head" * last
    if not recompute:  # backward only frees
        expr = f"k*({emb}L*layer{head})"
    else:  # the others keep their block inputs; the oldest's backward holds a whole layer
        expr = f"(k - 1)*({emb}L*input{head}) + {emb}max(L*input{head}, (L - 1)*input + layer)"
    return formula(expr, show="k L", k=in_flight, L=n_layers, layer=terms["layer"], input=terms["block_input"],
                   embedding=terms["embedding"], head=terms["head"])


def transient_terms(config, b, s, dtype, device_type, optimizer="adamw", update=None, matrix=None, tp=1, last=True,
                    casts=None, kept=True):
    """The model's own short-lived tensors (common's GPT, one micro-batch of b sequences of s
    tokens, V = vocab (V/T where the head is vocabulary-parallel), e the compute dtype's
    bytes), each a formula: what a step's peak holds besides the model state, the gathered
    units and the saved activations (activation_terms), and what start-up holds besides the
    state it keeps. Counted against every live tensor (LiveStorage) by tests/test_peaks.py.

      logits     forward, on the last stage: the head's logits e·bsV, in bf16 the loss's fp32
                 copy (cross_entropy runs in fp32 under autocast), and where the loop still
                 names the previous micro-batch's logits (`_, loss = model(x, y)`: `kept`)
                 those too; the last micro-batch's stay into the optimizer step
                     (e + c + k·e)·bsV,  c = 4 in bf16, 0 in fp32, k = 1 if kept
      casts      bf16 only: autocast's copies of the weights its matmuls use (`casts`
                 elements: every Linear's weight and the tied head, not wpe), made in forward
                 and kept by autograd for backward (the meter leaves them out of the
                 activations, as parameters)
                     e·Ψ_c
      gradients  backward: the logits' fp32 gradient (last stage) and an MLP-wide (4h/T)
                 gradient in flight (GELU's input and output gradients overlap the block's
                 saved tensors, which backward frees as it goes)
                     4bsV + 4ebsh/T
      update     the optimizer step: AdamW on CPU (torch's single-tensor loop) makes √v̂ and its
                 quotient `denom` for each tensor, while the previous tensor's `denom` is still
                 named: three temporaries of the largest tensor it updates (`update`
                 elements); fused AdamW (GPUs) none. Muon orthogonalises its largest matrix (`matrix`:
                 (M, r), M = m·n elements, r = min(m, n)): the fp32 Nesterov update 4M, X and the
                 next X in the Newton-Schulz dtype 2eM, the Gram matrix and its product 2er².
                 Unsharded (None): the model's largest parameter and hidden matrix
                     AdamW (CPU): 3·4·P     Muon: max(AdamW's, 4M + 2eM + 2er²)
      init       start-up: param_init draws each parameter whole in fp32 before it is copied
                 or sliced into place: the largest parameter's 4·P_max
    Remembered, as formula() is: plan.py asks for every rank of thousands of layouts."""
    key = (repr(config), b, s, dtype, device_type, optimizer, update, matrix, tp, last, casts, kept)
    if key not in _TRANSIENTS:
        if len(_TRANSIENTS) > 100_000:
            _TRANSIENTS.clear()
        _TRANSIENTS[key] = _transient_terms(config, b, s, dtype, device_type, optimizer, update, matrix, tp, last,
                                            casts, kept)
    return _TRANSIENTS[key]


_TRANSIENTS = {}


def _transient_terms(config, b, s, dtype, device_type, optimizer, update, matrix, tp, last, casts, kept):
    T, h, e = tp, config.n_embd, dtype.itemsize
    V = math.ceil(config.vocab_size / T) * T  # a vocabulary-parallel head pads it to a multiple of T (06, 08)
    c = 4 if e == 2 else 0
    fused = device_type in ("cuda", "xpu")  # common.make_adamw: fused on GPUs
    largest, (M, r), model_casts = model_sizes(config)
    update = largest if update is None else update
    M, r = (M, r) if matrix is None else matrix
    casts = model_casts if casts is None else casts

    def term(expr, **more):
        return formula(expr.replace("/T", "/T" if T > 1 else ""), show="e c k adamw", b=b, s=s, h=h, V=V, T=T, e=e,
                       c=c, k=int(kept), **more)
    adamw = term("0" if fused else "3*4*P", P=update)
    return {"logits": term("(e + c + k*e)*b*s*V/T" if last else "0"),
            "casts": term("e*Ψ_c" if e == 2 else "0", Ψ_c=casts),
            "gradients": term(("4*b*s*V/T + " if last else "") + "4*e*b*s*h/T"),
            "last logits": term("e*b*s*V/T" if last and kept else "0"),
            "update": adamw if optimizer == "adamw" else
            term("max(adamw, 4*M + 2*e*M + 2*e*r**2)", adamw=adamw, M=M, r=r),
            "init": term("4*P_max", P_max=largest)}


def hidden_matrix_shapes(config):
    """The full shapes of the matrices Muon updates (from the shapes alone)."""
    from common import is_hidden_matrix, param_shapes
    return [shape for name, shape in param_shapes(config).items() if is_hidden_matrix(name, shape)]


def hidden_matrix_params(config):
    """Ψ_m, the parameters Muon updates (from the shapes alone)."""
    return sum(math.prod(shape) for shape in hidden_matrix_shapes(config))


def model_sizes(config):
    """(the largest parameter's elements, largest_matrix() of Muon's matrices, matmul_weights())
    of the whole model, from its shapes; remembered per config (plan.py asks for every rank
    of thousands of layouts)."""
    from common import param_shapes
    key = repr(config)
    if key not in _MODEL_SIZES:
        shapes = param_shapes(config)
        _MODEL_SIZES[key] = (max(map(math.prod, shapes.values())), largest_matrix(hidden_matrix_shapes(config)),
                             matmul_weights(shapes))
    return _MODEL_SIZES[key]


_MODEL_SIZES = {}


def matmul_weights(named_shapes):
    """The elements of the weights autocast casts for matmuls: every 2-D parameter but the
    position embedding (wte is the tied head's weight)."""
    return sum(math.prod(shape) for name, shape in named_shapes.items()
               if len(shape) == 2 and not name.endswith("wpe.weight"))


def largest_matrix(shapes):
    """(m·n, min(m, n)) of the largest 2-D shape in `shapes` (Muon's work), or (0, 0)."""
    return max(((math.prod(shape), min(shape)) for shape in shapes if len(shape) == 2), default=(0, 0))


def phase_peaks(cost, t, forward=None, backward=None, optimizer=None):
    """costs()'s "peak": the most bytes of live tensors on this rank in each phase of a step,
    each one formula of named terms: the model state held (all of costs()'s `held`, kept
    through the step), 05's and ZeRO-3's gathered units, the saved activations at their high
    point (`activations`), the model's transients (transient_terms `t`) and the strategy's
    own (`forward`, `backward`, `optimizer`: {name: formula}, the script's communication
    buffers and the like; a name of the model's replaces its term).

        forward    held + gathered + activations + casts + logits + ...
        backward   held + gathered + activations + casts + gradients + ...
        optimizer  held + the last logits + update + ...   (the units were given back)"""
    held, gathered = ("", sum(v for _, v in cost["held"].values())), cost.get("gathered")
    by_name = ("held", "gathered", "activations")

    def phase(**terms):  # the state and the saved activations by name (their bytes), the transients written out
        terms = {k: v[1] if k in by_name else v for k, v in terms.items() if v is not None and v[1]}
        return formula(" + ".join(terms), show=" ".join(sorted(set(terms) - set(by_name))), **terms)
    return {"forward": phase(**{"held": held, "gathered": gathered, "activations": cost["activations"],
                                "casts": t["casts"], "logits": t["logits"], **(forward or {})}),
            "backward": phase(**{"held": held, "gathered": gathered, "activations": cost["activations"],
                                 "casts": t["casts"], "gradients": t["gradients"], **(backward or {})}),
            "optimizer": phase(**{"held": held, "logits": t["last logits"], "update": t["update"],
                                  **(optimizer or {})})}


def format_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
