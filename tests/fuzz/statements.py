"""The grammar's statement templates: each writes a few lines of the program's body from
the variables in scope, and tells the generator the kinds of what it defines.

Kinds of values the generator tracks (a kind decides which templates may use a value):
  tensors   "S" (0-d), "V" (shape (4,)), "M" (shape (R, 4), R set per call); any two
            broadcast, and an in-place op writes into the larger-or-equal rank only
  Python    "int", "float", "bool", "str"
  lists     "tlist" (of M tensors), "nlist" (of ints), "flist" (of floats), "ttuple"
  dicts     "tdict" (str -> M tensor), "odict" (OrderedDict, same), "argdict" (the argument
            d: {'w': M, 'h': tlist}), "ddict" (defaultdict(list) of M), "icount"
            (defaultdict(int)), "counter" (Counter of ints)
  others    "iset" (set of ints), "deque" (deque of M), "tuple" ((M, int)), "npV"/"npM"
            (numpy arrays), "fn:S"/"fn:V" (a closure over a tensor of that kind),
            "bump" (a nonlocal counter), "module" (the nn.Module), "any" (return only)
Options within a template are listed simplest first (hypothesis shrinks towards them).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tests.fuzz.program import ProgramGenerator

TENSOR = ("S", "V", "M")
RANK = {"S": 0, "V": 1, "M": 2}
LISTS = ("tlist", "ttuple")
DICTS = ("tdict", "odict")
SIZED = ("tlist", "ttuple", "nlist", "flist", "tdict", "odict", "argdict", "ddict", "icount", "counter", "iset",
         "deque", "str")


def broadcast(*kinds: str) -> str:
    return max(kinds, key=RANK.__getitem__)


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    tag: str  # the feature it exercises (a program's features list these)
    weight: int
    write: Callable[["ProgramGenerator"], list[str] | None]  # None: not possible here
    top_only: bool  # defines names later statements use (never inside a block)
    exact_only: bool  # random ops, or text of float values: not on weld
    needs: str | None  # a program-level feature (setup section) it reads


TEMPLATES: list[Template] = []


def template(tag: str, weight: int = 2, *, top_only: bool = False, exact_only: bool = False,
             needs: str | None = None):
    def register(write):
        TEMPLATES.append(Template(write.__name__, tag, weight, write, top_only, exact_only, needs))
        return write
    return register


def options(g: "ProgramGenerator", table: list[tuple[str, str]], **names: str | None) -> tuple[str, str] | None:
    """Pick one (expression, kind) row of `table` whose placeholders all have a value."""
    usable = [(expr, kind) for expr, kind in table
              if all(names.get(p) is not None for p in _placeholders(expr))]
    if not usable:
        return None
    expr, kind = g.draw.choice(usable)
    return expr.format(**{k: v for k, v in names.items() if v is not None}), kind


def _placeholders(expr: str) -> list[str]:
    import string
    return [field for _, field, _, _ in string.Formatter().parse(expr) if field]


def assign_from(g: "ProgramGenerator", table: list[tuple[str, str]], **names: str | None) -> list[str] | None:
    row = options(g, table, **names)
    if row is None:
        return None
    expr, kind = row
    kind = names.get("K", kind) if kind == "K" else kind  # "K": the kind of the operand
    line = g.assign(kind, expr)
    return None if line is None else [line]


# -- tensors -------------------------------------------------------------------------

UNARY = ["{a} + 1", "{a} * 2", "torch.sin({a})", "{a}.cos()", "torch.relu({a})", "{a}.abs()", "torch.tanh({a})",
         "{a}.sigmoid()", "-{a}", "{a}.exp().clamp(max=50.0)", "torch.clamp({a}, -1.0, 1.0)", "{a}.pow(2)",
         "{a}.sign()", "torch.nn.functional.gelu({a})"]
BINARY = ["{a} + {b}", "{a} - {b}", "{a} * {b}", "torch.maximum({a}, {b})", "{a} / ({b}.abs() + 1)",
          "torch.where({a} > 0, {a}, {b})", "torch.add({a}, {b}, alpha=2)", "{a}.lerp({b}, 0.25)"]
WITH_NUMBER = ["{a} * {n}", "{a} + {n}", "{n} - {a}", "{a} / (abs({n}) + 1)", "{a} * float({n})",
               "torch.clamp({a}, min={n})"]


@template("tensor", 6)
def unary(g):
    a = g.pick(*TENSOR)
    return a and g.assign_lines(g.kind(a), g.draw.choice(UNARY).format(a=a))


@template("tensor", 6)
def binary(g):
    a, b = g.pick(*TENSOR), g.pick(*TENSOR)
    return a and b and g.assign_lines(broadcast(g.kind(a), g.kind(b)), g.draw.choice(BINARY).format(a=a, b=b))


@template("tensor", 4)
def with_number(g):
    a, n = g.pick(*TENSOR), g.number()
    return a and g.assign_lines(g.kind(a), g.draw.choice(WITH_NUMBER).format(a=a, n=n))


@template("tensor", 3)
def reduction(g):
    a = g.pick(*TENSOR)
    if a is None:
        return None
    table = {
        "M": [("{a}.sum(0)", "V"), ("{a}.sum()", "S"), ("{a}.mean(0)", "V"), ("{a}.amax(0)", "V"),
              ("{a}.norm()", "S"), ("torch.softmax({a}, -1)", "M"), ("{a}.cumsum(0)", "M"), ("{a}.flip(0)", "M"),
              ("{a}.sort(dim=0).values", "M"), ("{a}.var(0, unbiased=False)", "V")],
        "V": [("{a}.sum()", "S"), ("{a}.max()", "S"), ("{a}.mean()", "S"), ("torch.softmax({a}, 0)", "V"),
              ("{a}.cumsum(0)", "V"), ("{a}.flip(0)", "V"), ("{a}.sort().values", "V"),
              ("{a}.topk(2).values.sum()", "S")],
        "S": [("{a} * {a}", "S"), ("{a}.abs().sqrt()", "S"), ("{a}.reshape(1).sum()", "S")],
    }[g.kind(a)]
    return assign_from(g, table, a=a)


@template("view", 3)
def view(g):
    a = g.pick("M", "V")
    if a is None:
        return None
    table = {
        "M": [("{a}[0]", "V"), ("{a}[-1]", "V"), ("{a}.select(0, 1)", "V"), ("{a}[:]", "M"), ("{a}.view(-1, 4)", "M"),
              ("{a}.t().t()", "M"), ("{a}.unsqueeze(0).squeeze(0)", "M"), ("{a}.narrow(1, 0, 4)", "M"),
              ("{a}.detach()", "M"), ("{a}.reshape({a}.shape)", "M")],
        "V": [("{a}[:]", "V"), ("{a}.view(4)", "V"), ("{a}.unsqueeze(0)[0]", "V"), ("{a}.detach()", "V"),
              ("{a}.view(2, 2).flatten()", "V")],
    }[g.kind(a)]
    return assign_from(g, table, a=a)


@template("sizes", 3)
def sizes(g):
    """Values computed from sizes: symbolic where a dim is dynamic (rows vary between calls)."""
    a = g.pick("M", "V")
    if a is None:
        return None
    table = {
        "M": [("{a} * {a}.shape[0]", "M"), ("{a}.view({a}.size(0), 2, 2).reshape({a}.shape[0], -1)", "M"),
              ("{a} + torch.arange({a}.shape[0]).unsqueeze(1)", "M"), ("{a}.sum(0) / {a}.shape[0]", "V"),
              ("{a}.reshape(-1)[: {a}.numel() // 2].sum()", "S"), ("{a}[: max(1, {a}.shape[0] // 2)].sum(0)", "V"),
              ("{a}.new_zeros({a}.shape) + {a}", "M"), ("{a} * len({a})", "M"),
              ("torch.cat([{a}, {a}[:1]])[: {a}.shape[0]]", "M"), ("{a}.flatten()[-4:]", "V"),
              ("{a}.expand({a}.shape[0], 4) * (1.0 / {a}.size(-1))", "M"),
              ("{a}.transpose(0, 1).reshape(4, -1).sum(1)", "V")],
        "V": [("{a} * {a}.shape[0]", "V"), ("{a}[: {a}.numel() // 2].sum()", "S"),
              ("{a}.unsqueeze(0).expand(2, {a}.shape[-1]).sum(0)", "V")],
    }[g.kind(a)]
    return assign_from(g, table, a=a)


@template("sizes", 1)
def size_branch(g):
    a = g.pick("M")
    if a is None:
        return None
    test = g.draw.choice([f"{a}.shape[0] > {g.draw.choice([1, 2, 3, 4])}", f"{a}.size(0) % 2 == 0",
                          f"{a}.numel() >= 12", f"len({a}) == 3"])
    lines = [f"if {test}:"] + g.block()
    if g.draw.chance(0.4):
        lines += ["else:"] + g.block()
    return lines


@template("tensor", 2)
def create(g):
    a, n, f = g.pick(*TENSOR), g.number(), g.number("float")
    table = [("torch.ones(4)", "V"), ("torch.arange(4.0)", "V"), ("torch.tensor([0.5, -1.0, 2.0, 0.0])", "V"),
             ("torch.linspace(-1, 1, 4)", "V"), ("torch.tensor({f})", "S"), ("torch.zeros_like({a})", "K"),
             ("torch.full_like({a}, {n})", "K"), ("torch.empty(4).fill_({n})", "V"),
             ("torch.ones_like({a}, dtype=torch.float64)", "K"), ("torch.tensor({n}) * 1.0", "S")]
    return assign_from(g, table, a=a, n=n, f=f, K=a and g.kind(a))


@template("tensor", 1)
def dtype_cast(g):
    a, b = g.pick(*TENSOR), g.pick(*TENSOR)
    table = [("{a}.double()", "K"), ("{a}.float()", "K"), ("{a}.to(torch.float64)", "K"), ("{a}.to({b}.dtype)", "K"),
             ("{a}.half().float()", "K"), ("{a}.to(torch.get_default_dtype())", "K"), ("{a}.type_as({b})", "K")]
    return assign_from(g, table, a=a, b=b, K=a and g.kind(a))


@template("random", 2, exact_only=True)
def random_op(g):
    a = g.pick(*TENSOR)
    table = [("torch.rand_like({a})", "K"), ("torch.randn(4)", "V"), ("torch.nn.functional.dropout({a}, 0.5, True)", "K"),
             ("{a} + torch.randn_like({a})", "K"), ("torch.bernoulli(torch.full_like({a}, 0.5))", "K"),
             ("int(torch.randint(0, 5, ()).item())", "int"), ("torch.randperm(4)[0].item()", "int")]
    return assign_from(g, table, a=a, K=a and g.kind(a))


# -- in-place changes ----------------------------------------------------------------------

@template("inplace", 5)
def inplace(g):
    a = g.pick_mutable(*TENSOR)
    if a is None:
        return None
    rank = RANK[g.kind(a)]
    b = g.pick(*[k for k in TENSOR if RANK[k] <= rank])
    smaller = g.pick(*[k for k in TENSOR if RANK[k] < rank])
    n = g.number()
    table = [("{a}.add_({b})", ""), ("{a}.mul_({n})", ""), ("{a}.clamp_(-1.0, 1.0)", ""), ("{a}.zero_()", ""),
             ("{a}.copy_({b})", ""), ("{a}.relu_()", ""), ("{a}.masked_fill_({a} > 1, 0.0)", ""),
             ("{a} += {b}", ""), ("{a} *= {n}", ""), ("torch.sin_({a})", ""), ("{a}.sub_({b}, alpha=0.5)", "")]
    if rank >= 1:
        table += [("{a}[0] = {s}", ""), ("{a}[0] = {n}", ""), ("{a}[0].mul_({n})", ""), ("{a}[-1].zero_()", ""),
                  ("{a}[{a} > 0] = 0.0", "")]
    if rank == 2:
        table += [("{a}[:, 0] = {n}", ""), ("{a}.t()[0].add_(1)", ""), ("{a}[1:] = {s}", "")]
    row = options(g, table, a=a, b=b, s=smaller, n=n)
    return row and [row[0]]


@template("inplace", 3)
def inplace_through_view(g):
    a = g.pick_mutable("M", "V")
    if a is None:
        return None
    views = {"M": ["{a}[0]", "{a}[:, :2]", "{a}.view(-1)", "{a}.t()", "{a}.diagonal()", "{a}[1:]"],
             "V": ["{a}[:2]", "{a}[1:]", "{a}.view(2, 2)", "{a}[::2]"]}[g.kind(a)]
    change = g.draw.choice([".add_(1)", ".mul_(-1)", ".zero_()", ".clamp_(min=0)", ".fill_(0.5)", "[0] = 7.0"])
    view_expr = g.draw.choice(views).format(a=a)
    if g.depth == 0 and g.draw.chance(0.4):  # keep the view in a local and change it later
        name = g.fresh("v")
        return [f"{name} = {view_expr}", f"{name}{change}"]
    return [f"{view_expr}{change}"]


# -- values leaving tensors --------------------------------------------------------------

@template("item", 4)
def item(g):
    a = g.pick(*TENSOR)
    table = [("{a}.sum().item()", "float"), ("float({a}.mean())", "float"), ("int({a}.argmax())", "int"),
             ("int(({a} > 0).sum())", "int"), ("{a}.max().item()", "float"), ("round({a}.sum().item(), 2)", "float"),
             ("bool(({a} > 0).all())", "bool"), ("{a}.numel()", "int"), ("{a}.dim()", "int"),
             ("len({a}.shape)", "int"), ("{a}.dtype == torch.float64", "bool"), ("{a}.requires_grad", "bool")]
    if a and g.kind(a) != "S":
        table += [("{a}.shape[0]", "int"), ("{a}.size(0) * 2", "int")]
    return assign_from(g, table, a=a)


@template("item", 2)
def tolist(g):
    a = g.pick(*TENSOR)
    if a is None:
        return None
    table = {"S": [("{a}.tolist()", "float"), ("[{a}.item()] * 2", "flist")],
             "V": [("{a}.tolist()", "flist"), ("{a}.argsort().tolist()", "nlist"),
                   ("[round(v, 3) for v in {a}.tolist()]", "flist")],
             "M": [("{a}[0].tolist()", "flist"), ("{a}.sum(0).tolist()", "flist"),
                   ("({a} > 0).long().sum(-1).tolist()", "nlist"), ("{a}.tolist()", "any")]}[g.kind(a)]
    return assign_from(g, table, a=a)


# -- control flow ----------------------------------------------------------------------------

def tensor_condition(g) -> str | None:
    a, b, f = g.pick(*TENSOR), g.pick(*TENSOR), g.number("float")
    row = options(g, [("{a}.sum() > 0", ""), ("({a} > 0.5).any()", ""), ("{a}.max().item() > {f}", ""),
                      ("{a}.mean() < 0", ""), ("bool(({a} < 0).all())", ""), ("{a}.sum() > {b}.sum()", ""),
                      ("{a}.abs().max() > 1", ""), ("not ({a} > 0).all()", "")], a=a, b=b, f=f)
    return row and row[0]


@template("data_if", 4)
def tensor_if(g):
    cond = tensor_condition(g)
    if cond is None:
        return None
    lines = [f"if {cond}:"] + g.block()
    if g.draw.chance(0.5):
        lines += ["else:"] + g.block()
    return lines


@template("data_if", 2)
def tensor_ternary(g):
    a = g.pick(*TENSOR)
    b = a and g.pick(g.kind(a))
    cond = tensor_condition(g)
    return a and cond and g.assign_lines(g.kind(a), f"{a} if {cond} else {b}")


@template("data_if", 1)
def number_from_condition(g):
    cond = tensor_condition(g)
    return cond and g.assign_lines("int", f"{g.number('int')} + (1 if {cond} else -1)")


@template("python_if", 3)
def python_if(g):
    i, f, b, c, s, st = (g.number("int"), g.number("float"), g.pick("bool"), g.pick(*SIZED),
                         g.pick("iset"), g.pick("str"))
    row = options(g, [("{i} > 2", ""), ("{i} % 2 == 0", ""), ("{b}", ""), ("not {b}", ""), ("{f} > 0.5", ""),
                      ("len({c}) > 1", ""), ("{i} in {s}", ""), ("{st} == 'a'", ""), ("x.dtype == torch.float64", ""),
                      ("x.shape[0] > 2", ""), ("torch.is_grad_enabled()", ""), ("x.requires_grad", ""),
                      ("{c}", "")], i=i, f=f, b=b, c=c, s=s, st=st)
    if row is None:
        return None
    lines = [f"if {row[0]}:"] + g.block()
    if g.draw.chance(0.4):
        lines += ["else:"] + g.block()
    return lines


@template("loop", 3)
def loop_range(g):
    i = g.number("int")
    idx = g.fresh("k")
    return [f"for {idx} in range({i} % 3 + 1):"] + g.block(extra={idx: "int"})


@template("loop", 3)
def loop_list(g):
    l = g.pick(*LISTS, "deque")
    if l is None:
        return None
    e, idx = g.fresh("e"), g.fresh("k")
    other = g.pick(*LISTS)
    form, extra = g.draw.choice([
        (f"for {e} in list({l}):", {e: "M"}),
        (f"for {idx}, {e} in enumerate(list({l})):", {e: "M", idx: "int"}),
        (f"for {e} in reversed(list({l})):", {e: "M"}),
        (f"for {e}, {idx} in zip(list({l}), range(2)):", {e: "M", idx: "int"}),
        (f"for {e} in list({l})[:2]:", {e: "M"}),
        (f"for {e}, {e}_2 in zip(list({l}), list({other})):", {e: "M", f"{e}_2": "M"}),
    ])
    return [form] + g.block(extra=extra, frozen={l, other})


@template("loop", 2)
def loop_dict(g):
    d = g.pick(*DICTS, "ddict")
    if d is None:
        return None
    key, e = g.fresh("key"), g.fresh("e")
    if g.kind(d) == "ddict":
        return [f"for {key}, {e} in sorted({d}.items(), key=lambda p: p[0]):"] + g.block(
            extra={key: "str", e: "tlist"}, frozen={d})
    form = g.draw.choice([f"for {key}, {e} in list({d}.items()):", f"for {key}, {e} in sorted({d}.items()):"])
    return [form] + g.block(extra={key: "str", e: "M"}, frozen={d})


@template("loop", 1)
def bounded_while(g):
    a = g.pick_local(*TENSOR)
    return a and ["for _ in range(3):", f"    if not bool({a}.abs().max() > 2):", "        break",
                  f"    {a} = {a} * 0.5"]


@template("grad_mode", 2)
def grad_mode_block(g):
    b = g.pick("bool")
    row = options(g, [("with torch.no_grad():", ""), ("with torch.enable_grad():", ""),
                      ("with torch.set_grad_enabled({b}):", "")], b=b)
    return [row[0]] + g.block()


# -- Python numbers, strings, print ----------------------------------------------------------

@template("python", 4)
def arithmetic(g):
    i, j, f, c = g.number("int"), g.number("int"), g.number("float"), g.pick(*SIZED)
    table = [("{i} + {j}", "int"), ("{i} * 2 - 1", "int"), ("abs({i}) % 5", "int"), ("{f} * {j}", "float"),
             ("{f} + {i}", "float"), ("len({c})", "int"), ("max({i}, {j})", "int"), ("min({f}, 1.5)", "float"),
             ("math.sqrt(abs({f}))", "float"), ("round({f}, 3)", "float"), ("int({f})", "int"),
             ("{i} > {j}", "bool"), ("{i} // 2 if {i} > 0 else -{i}", "int"), ("divmod({i}, 3)[0]", "int"),
             ("math.floor({f})", "int"), ("{i} ** 2", "int"), ("float({i}) / 4", "float")]
    return assign_from(g, table, i=i, j=j, f=f, c=c)


@template("fstring", 2)
def fstring(g):
    i, nl, c, a, st = g.number("int"), g.pick("nlist"), g.pick(*SIZED), g.pick("M", "V"), g.pick("str")
    f = g.number("float")
    table = [('f"{{{i}}}-{{len({c})}}"', "str"), ("'-'.join(str(v) for v in {nl})", "str"),
             ('f"{{{a}.shape[0]}}x{{{i}:02d}}"', "str"), ("str({i}) + 'k'", "str"), ("{st}.upper()", "str"),
             ("'%d-%s' % ({i}, {st})", "str"), ("format({i}, '03d')", "str"), ("repr({nl})", "str"),
             ("'a' if {i} % 2 else 'b'", "str"), ('f"{{{st}!r}}:{{{i}}}"', "str")]
    if g.exact:
        table += [('f"{{{f}:.2f}}"', "str"), ("str({f})", "str")]
    return assign_from(g, table, i=i, nl=nl, c=c, a=a, st=st, f=f)


@template("print", 3)
def print_(g):
    i, st, c, a, f, fl = (g.number("int"), g.pick("str"), g.pick(*SIZED), g.pick(*TENSOR), g.number("float"),
                          g.pick("flist"))
    table = [("print('tag', {i})", ""), ("print({st})", ""), ('print(f"i={{{i}}} n={{len({c})}}")', ""),
             ("print({a}.shape)", ""), ("print({a}.dtype, {a}.requires_grad)", ""),
             ("print(len({c}), {i}, sep=',', end='|\\n')", "")]
    if g.exact:
        table += [("print({a})", ""), ('print(f"{{{f}:.4f}}")', ""), ("print({fl})", "")]
    row = options(g, table, i=i, st=st, c=c, a=a, f=f, fl=fl)
    return row and [row[0]]


# -- builtins, heapq, functools.reduce -------------------------------------------------------

@template("builtins", 4)
def builtin_calls(g):
    nl, nl2, fl, l, a, b, i = (g.pick("nlist"), g.pick("nlist"), g.pick("flist"), g.pick(*LISTS), g.pick("M"),
                               g.pick(*TENSOR), g.number("int"))
    table = [("len({nl})", "int"), ("sum({nl})", "int"), ("max({nl}, default=0)", "int"), ("min({nl} + [{i}])", "int"),
             ("sorted({nl}, key=lambda v: -v)", "nlist"), ("list(filter(lambda v: v % 2 == 0, {nl}))", "nlist"),
             ("list(map(abs, {nl}))", "nlist"), ("[v * 2 for v in {nl}]", "nlist"), ("{nl}.count(1)", "int"),
             ("sum(v for v in {nl} if v > 1)", "int"), ("max(enumerate({nl}), key=lambda p: p[1], default=(0, 0))[0]", "int"),
             ("len(list(zip({nl}, {l})))", "int"), ("sum({fl})", "float"), ("min({fl}, default=0.0)", "float"),
             ("sorted({fl}, key=abs)", "flist"), ("len({fl})", "int"), ("math.fsum({fl})", "float"),
             ("sorted({l}, key=lambda z: z.sum().item())", "tlist"), ("max({l}, key=lambda z: z.mean().item())", "M"),
             ("list(map(lambda z: z + 1, {l}))", "tlist"), ("[z for z in {l} if z.sum() > 0]", "tlist"),
             ("sum([{a}, {b}])", "M"), ("any({nl})", "bool"), ("all(v > 0 for v in {nl})", "bool"),
             ("dict(enumerate({nl}))", "any"), ("list(zip({nl}, {nl2}))", "any"), ("isinstance({b}, torch.Tensor)", "bool"),
             ("{a} is {b}", "bool"), ("{a}.data_ptr() == {b}.data_ptr()", "bool"), ("type({b}).__name__", "str"),
             ("sum(z.numel() for z in {l})", "int"), ("any(z.sum() > 0 for z in {l})", "bool"),
             ("list(range({i} % 4))", "nlist"), ("[{i}, 3, 1]", "nlist"), ("[len({nl}), {i}]", "nlist")]
    return assign_from(g, table, nl=nl, nl2=nl2, fl=fl, l=l, a=a, b=b, i=i)


@template("heapq", 2)
def heap(g):
    nl, fl, i = g.pick_mutable("nlist"), g.pick("flist"), g.number("int")
    if nl is None:
        return None
    row = options(g, [("heapq.heappush({nl}, {i})", ""), ("heapq.heapify({nl})", ""), ("heapq.heappop({nl})", "int"),
                      ("heapq.nsmallest(2, {nl})", "nlist"), ("heapq.nlargest(2, {nl}, key=lambda v: v % 3)", "nlist"),
                      ("heapq.nsmallest({i} % 3 + 1, {fl})", "flist"), ("heapq.heappushpop({nl}, {i})", "int"),
                      ("list(heapq.merge(sorted({nl}), [1, 5]))", "nlist"), ("heapq.nlargest(1, {nl})", "nlist")],
                  nl=nl, fl=fl, i=i)
    if row is None:
        return None
    expr, kind = row
    if not kind or g.draw.chance(0.2):
        return [expr]
    return g.assign_lines(kind, expr)


@template("reduce", 2)
def reduce_(g):
    nl, l, a, fl = g.pick("nlist"), g.pick(*LISTS), g.pick("M"), g.pick("flist")
    return assign_from(g, [("functools.reduce(operator.add, {nl}, 0)", "int"),
                           ("functools.reduce(lambda p, q: p * q + 1, {nl}, 1)", "int"),
                           ("functools.reduce(torch.add, {l}, {a})", "M"),
                           ("functools.reduce(lambda p, q: torch.maximum(p, q), {l}, {a})", "M"),
                           ("functools.reduce(max, {nl}, -1)", "int"),
                           ("functools.reduce(lambda p, q: p + q, {fl}, 0.0)", "float")], nl=nl, l=l, a=a, fl=fl)


# -- containers -------------------------------------------------------------------------------

@template("list", 3)
def list_new(g):
    a, b, l, tup = g.pick("M"), g.pick("M"), g.pick(*LISTS, "deque"), g.pick("ttuple")
    return assign_from(g, [("[{a}, {b}]", "tlist"), ("[]", "tlist"), ("list({l})", "tlist"), ("[z * 2 for z in {l}]", "tlist"),
                           ("list({l})[::-1]", "tlist"), ("list({l}) + [{a}]", "tlist"), ("[{a}] * 2", "tlist"),
                           ("tuple({l})", "ttuple"), ("({a}, {b})", "ttuple"), ("list({tup})", "tlist")],
                       a=a, b=b, l=l, tup=tup)


@template("list", 4)
def list_mutate(g):
    l, a, b = g.pick_mutable("tlist"), g.pick("M"), g.pick("M")
    return (l and a) and [g.draw.choice([
        "{l}.append({a})", "{l}.insert(0, {a})", "{l}.extend([{a}, {b}])", "{l}.reverse()", "{l}.pop()",
        "del {l}[0]", "{l}[0] = {a}", "{l}.clear()", "{l} += [{a}]", "{l}.sort(key=lambda z: z.sum().item())",
        "{l}[:] = [{a}]", "{l}[-1] = {l}[0] * 2"]).format(l=l, a=a, b=b)]


@template("list", 3)
def list_read(g):
    l, a, i = g.pick(*LISTS), g.pick("M"), g.number("int")
    return assign_from(g, [("{l}[-1]", "M"), ("sum({l}, {a})", "M"), ("torch.stack(list({l})).sum(0)", "M"),
                           ("len({l})", "int"), ("{l}[{i} % len({l})]", "M"), ("torch.cat([{a}, *{l}]).sum(0)", "V"),
                           ("{l}[0] if {l} else {a}", "M")], l=l, a=a, i=i)


@template("list", 2)
def number_list_mutate(g):
    nl, nl2, i = g.pick_mutable("nlist"), g.pick("nlist"), g.number("int")
    if nl is None:
        return None
    table = ["{nl}.append({i})", "{nl}.sort()", "{nl}.insert(0, {i})", "{nl}.pop(0)", "{nl}.remove(3)",
             "{nl}.reverse()", "{nl} += [{i}]"]
    if nl2 is not None and nl2 != nl:
        table.append("{nl}.extend({nl2})")
    return [g.draw.choice(table).format(nl=nl, nl2=nl2, i=i)]


@template("tuple", 2)
def tuple_(g):
    tup = g.pick("tuple")
    if tup is not None and g.depth == 0 and g.draw.chance(0.5):
        t, i = g.fresh("t"), g.fresh("i")
        g.define(t, "M")
        g.define(i, "int")
        return [f"{t}, {i} = {tup}"]
    a, i = g.pick("M"), g.number("int")
    return assign_from(g, [("({a}, {i})", "tuple"), ("{tup}[0] * {tup}[1]", "M"), ("len({tup})", "int")],
                       a=a, i=i, tup=tup)


@template("dict", 3)
def dict_new(g):
    a, b, d, i, l = g.pick("M"), g.pick("M"), g.pick(*DICTS), g.number("int"), g.pick("tlist")
    return assign_from(g, [("{{'a': {a}, 'b': {b}}}", "tdict"), ("{{}}", "tdict"), ("dict({d}, c={a})", "tdict"),
                           ("{{k: v * 2 for k, v in {d}.items()}}", "tdict"), ("dict(zip(['p', 'q'], [{a}, {b}]))", "tdict"),
                           ("dict(sorted({d}.items(), reverse=True))", "tdict"), ("{{f'k{{{i}}}': {a}}}", "tdict"),
                           ("{d}.copy()", "tdict"), ("{{'h': {l}}}", "any")], a=a, b=b, d=d, i=i, l=l)


@template("dict", 4)
def dict_mutate(g):
    d, a, i, st = g.pick_mutable(*DICTS, "argdict"), g.pick("M"), g.number("int"), g.pick("str")
    if d is None or a is None:
        return None
    if g.kind(d) == "argdict":
        table = ["{d}['w'] = {a}", "{d}[f'k{{{i}}}'] = {a}", "{d}.update(extra={a})", "{d}.setdefault('h', []).append({a})",
                 "{d}['h'] = {d}['h'] + [{a}]", "{d}['h'].append({a})", "{d}['h'][0] = {a}", "{d}.pop('extra', None)"]
    else:
        table = ["{d}['c'] = {a}", "{d}[f'k{{{i}}}'] = {a}", "{d}.update({{'e': {a}}})", "{d}.pop('a', None)",
                 "del {d}['a']", "{d}.setdefault('z', {a})", "{d}.clear()", "{d} |= {{'u': {a}}}"]
        if st is not None:
            table.append("{d}[{st}] = {a}")
    return [g.draw.choice(table).format(d=d, a=a, i=i, st=st)]


@template("dict", 3)
def dict_read(g):
    d, a = g.pick(*DICTS, "argdict"), g.pick("M")
    if d is None:
        return None
    table = [("len({d})", "int"), ("'a' in {d}", "bool"), ("','.join({d})", "str"), ("list({d})", "any")]
    if g.kind(d) == "argdict":
        table += [("{d}['w']", "M"), ("{d}.get('extra', {a})", "M"), ("{d}['h']", "tlist"), ("len({d}['h'])", "int")]
    else:
        table += [("{d}.get('a', {a})", "M"), ("{d}['a']", "M"), ("sum({d}.values(), {a})", "M"),
                  ("list({d}.values())", "tlist"), ("next(iter({d}.values()), {a})", "M")]
    return assign_from(g, table, d=d, a=a)


@template("set", 3)
def set_new(g):
    i, nl, s = g.number("int"), g.pick("nlist"), g.pick("iset")
    return assign_from(g, [("{{{i}, 1, 2}}", "iset"), ("set({nl})", "iset"), ("set()", "iset"),
                           ("{{v % 3 for v in {nl}}}", "iset"), ("{s} | {{7}}", "iset"), ("{s} & {{1, 2, 3}}", "iset"),
                           ("{s} - {{1}}", "iset"), ("set(range({i} % 4))", "iset")], i=i, nl=nl, s=s)


@template("set", 3)
def set_mutate(g):
    s, i, nl = g.pick_mutable("iset"), g.number("int"), g.pick("nlist")
    row = s and options(g, [("{s}.add({i})", ""), ("{s}.discard(1)", ""), ("{s}.update({nl})", ""),
                            ("{s} |= {{5, {i}}}", ""), ("{s}.remove(2)", ""), ("{s}.clear()", ""),
                            ("{s}.intersection_update({{1, 2, {i}}})", "")], s=s, i=i, nl=nl)
    return row and [row[0]]


@template("set", 2)
def set_read(g):
    s, s2, i = g.pick("iset"), g.pick("iset"), g.number("int")
    return assign_from(g, [("len({s})", "int"), ("{i} in {s}", "bool"), ("sorted({s})", "nlist"),
                           ("max({s}, default=-1)", "int"), ("sum({s})", "int"), ("{s}.issubset({s2})", "bool"),
                           ("min({s} | {{100}})", "int"), ("[v for v in sorted({s}) if v > 0]", "nlist")],
                       s=s, s2=s2, i=i)


@template("defaultdict", 2)
def defaultdict_new(g):
    a = g.pick("M")
    return assign_from(g, [("collections.defaultdict(list)", "ddict"),
                           ("collections.defaultdict(list, {{'a': [{a}]}})", "ddict"),
                           ("collections.defaultdict(int)", "icount")], a=a)


@template("defaultdict", 3)
def defaultdict_use(g):
    dd, a, i, st = g.pick_mutable("ddict"), g.pick("M"), g.number("int"), g.pick("str")
    c = g.pick_mutable("icount")
    table = []
    if dd and a:
        table += ["{dd}['a'].append({a})", "{dd}[f'k{{{i} % 2}}'].append({a})", "{dd}.pop('a', None)"]
        if st:
            table.append("{dd}[{st}].append({a})")
    if c:
        table += ["{c}[{i} % 3] += 1", "{c}['x'] += {i}"]
    if not table:
        return None
    return [g.draw.choice(table).format(dd=dd, a=a, i=i, st=st, c=c)]


@template("defaultdict", 2)
def defaultdict_read(g):
    dd, c, i = g.pick("ddict"), g.pick("icount"), g.number("int")
    return assign_from(g, [("len({dd})", "int"), ("len({dd}['b'])", "int"), ("{dd}['a']", "tlist"),
                           ("'-'.join(sorted({dd}))", "str"), ("sum(len(v) for v in {dd}.values())", "int"),
                           ("{c}[{i}]", "int"), ("sum({c}.values())", "int"), ("max({c}.values(), default=0)", "int"),
                           ("len({c})", "int")], dd=dd, c=c, i=i)


@template("ordereddict", 2)
def ordereddict_(g):
    od, a, b, st = g.pick_mutable("odict"), g.pick("M"), g.pick("M"), g.pick("str")
    if od is None or g.draw.chance(0.3):
        return assign_from(g, [("collections.OrderedDict()", "odict"),
                               ("collections.OrderedDict([('a', {a}), ('b', {b})])", "odict")], a=a, b=b)
    table = [("{od}['a'] = {a}", ""), ("{od}.move_to_end('a')", ""), ("{od}.move_to_end('b', last=False)", ""),
             ("{od}.popitem()", ""), ("{od}.popitem(last=False)", ""), ("{od}[{st}] = {a}", "")]
    reads = [("list({od}.values())", "tlist"), ("next(reversed({od}.values()), {a})", "M"), ("'-'.join({od})", "str")]
    if g.draw.chance(0.4):
        return assign_from(g, reads, od=od, a=a)
    row = options(g, table, od=od, a=a, st=st)
    return row and [row[0]]


@template("deque", 2)
def deque_(g):
    dq, a, b, l = g.pick_mutable("deque"), g.pick("M"), g.pick("M"), g.pick("tlist")
    if dq is None or g.draw.chance(0.3):
        return assign_from(g, [("collections.deque([{a}], maxlen=3)", "deque"), ("collections.deque()", "deque"),
                               ("collections.deque({l})", "deque"), ("collections.deque({l}, maxlen=2)", "deque")],
                           a=a, l=l)
    if g.draw.chance(0.4):
        return assign_from(g, [("{dq}[0]", "M"), ("{dq}.popleft()", "M"), ("list({dq})", "tlist"), ("len({dq})", "int"),
                               ("sum({dq}, {a})", "M"), ("{dq}.pop()", "M")], dq=dq, a=a)
    row = options(g, [("{dq}.append({a})", ""), ("{dq}.appendleft({a})", ""), ("{dq}.rotate(1)", ""),
                      ("{dq}.extend([{a}, {b}])", ""), ("{dq}.clear()", "")], dq=dq, a=a, b=b)
    return row and [row[0]]


@template("counter", 2)
def counter_(g):
    c, nl, i = g.pick_mutable("counter"), g.pick("nlist"), g.number("int")
    if c is None or g.draw.chance(0.3):
        return assign_from(g, [("collections.Counter({nl})", "counter"), ("collections.Counter()", "counter"),
                               ("collections.Counter([{i}, {i}, 1])", "counter")], nl=nl, i=i)
    if g.draw.chance(0.5):
        return assign_from(g, [("{c}.most_common(1)[0][0]", "int"), ("len({c})", "int"), ("sum({c}.values())", "int"),
                               ("{c}[{i}]", "int"), ("sorted({c}.elements())", "nlist"), ("{c}.total()", "int")],
                           c=c, i=i)
    row = options(g, [("{c}[{i}] += 1", ""), ("{c}.update({nl})", ""), ("{c}.subtract([1])", "")], c=c, i=i, nl=nl)
    return row and [row[0]]


# -- numpy -----------------------------------------------------------------------------------

@template("numpy", 4)
def numpy_from_tensor(g):
    a = g.pick("M", "V")
    if a is None:
        return None
    kind = "np" + g.kind(a)
    return assign_from(g, [("{a}.detach().numpy()", kind), ("{a}.detach().numpy().copy()", kind),
                           ("np.asarray({a}.detach())", kind), ("{a}.detach().cpu().numpy() * 2", kind)], a=a)


@template("numpy", 3)
def numpy_ops(g):
    p = g.pick("npM", "npV")
    if p is None:
        return None
    kind = g.kind(p)
    table = [("np.tanh({p})", kind), ("{p} * 2 + 1", kind), ("np.maximum({p}, 0.0)", kind),
             ("np.cumsum({p}, axis=-1)", kind), ("{p}[::-1].copy()", kind), ("np.where({p} > 0, {p}, 0.0)", kind),
             ("np.sort({p}, axis=-1)", kind), ("{p}.astype(np.float64)", kind)]
    if g.has("numpy_global"):
        table.append(("{p} + NP_G", kind))
    if kind == "npM":
        table.append(("{p}.sum(axis=0)", "npV"))
    return assign_from(g, table, p=p)


@template("numpy", 4)
def numpy_to_python(g):
    p, a = g.pick("npM", "npV"), g.pick(*TENSOR)
    if p is None:
        return None
    t = g.kind(p)[2:]
    table = [("torch.from_numpy({p})", t), ("torch.from_numpy(np.ascontiguousarray({p}))", t), ("torch.as_tensor({p})", t),
             ("torch.tensor({p})", t), ("float({p}.sum())", "float"), ("int(np.argmax({p}))", "int"),
             ("float(np.mean({p}))", "float"), ("int(({p} > 0).sum())", "int"), ("bool(np.any({p} > 1))", "bool")]
    if a is not None:
        table.append(("{a} + torch.from_numpy({p}).to({a}.dtype)", broadcast(g.kind(a), t)))
    if t == "V":
        table.append(("{p}.tolist()", "flist"))
    return assign_from(g, table, p=p, a=a)


@template("numpy", 1)
def numpy_inplace(g):
    p = g.pick_mutable("npM", "npV")
    return p and [g.draw.choice(["{p}[0] = 0.0", "{p} *= 2", "np.clip({p}, -1, 1, out={p})"]).format(p=p)]


@template("numpy", 1, needs="numpy_global")
def numpy_global(g):
    a = g.pick("M", "V")
    return assign_from(g, [("float(NP_G.sum())", "float"), ("torch.from_numpy(NP_G)", "V"),
                           ("{a} * torch.from_numpy(NP_G).float()", "K"), ("int(NP_G.argmax())", "int")],
                       a=a, K=a and g.kind(a))


# -- closures, globals, attributes, defaults ---------------------------------------------------

@template("closure", 2, top_only=True)
def closure_def(g):
    a, n = g.pick("S", "V"), g.number()
    if a is None:
        return None
    name = g.fresh("fn")
    lines = g.draw.choice([
        [f"def {name}(z):", f"    return z * {n} + {a}"],
        [f"{name} = lambda z: z * {n} - {a}"],
        [f"def {name}(z, c={n}):", f"    return z * c + {a}"],
        [f"def {name}(z):", f"    if z.sum() > 0:", f"        return z + {a}", f"    return z - {a}"],
    ])
    g.define(name, "fn:" + g.kind(a))
    return lines


@template("closure", 3)
def closure_call(g):
    fn = g.pick("fn:S", "fn:V")
    z = g.pick(*TENSOR)
    return fn and z and g.assign_lines(broadcast(g.kind(z), g.kind(fn)[3:]), f"{fn}({z})")


@template("closure", 1, top_only=True)
def nonlocal_counter(g):
    count, bump = g.fresh("count"), g.fresh("bump")
    g.define(count, "int")
    g.define(bump, "bump")
    return [f"{count} = 0", f"def {bump}(step):", f"    nonlocal {count}", f"    {count} += step", f"    return {count}"]


@template("closure", 2)
def nonlocal_call(g):
    bump, i = g.pick("bump"), g.number("int")
    return bump and g.assign_lines("int", f"{bump}({i})")


@template("closure", 2, needs="scale_closure")
def global_closure_call(g):
    a = g.pick(*TENSOR)
    return a and g.assign_lines(g.kind(a), f"SCALE({a})")


@template("global", 2, needs="globals")
def global_write(g):
    i, f, a, v = g.number("int"), g.number("float"), g.pick(*TENSOR), g.pick("V", "S")
    row = options(g, [("G_N = G_N + {i}", ""), ("G_F = {f}", ""), ("G_LAST = {a}", ""), ("G_L.append({i})", ""),
                      ("G_T = G_T * 2", ""), ("G_T = {v} + 0", "")], i=i, f=f, a=a, v=v)
    return row and [row[0]]


@template("attribute", 2, needs="object")
def object_attribute(g):
    i, f, a, v = g.number("int"), g.number("float"), g.pick(*TENSOR), g.pick("V")
    if g.draw.chance(0.4):
        return assign_from(g, [("getattr(OBJ, 'k', 0)", "int"), ("hasattr(OBJ, 'last')", "bool"),
                               ("OBJ.double", "float"), ("OBJ.scaled({a})", "K")], a=a, K=a and g.kind(a))
    row = options(g, [("OBJ.k = OBJ.k + {i}", ""), ("OBJ.scale = {f}", ""), ("OBJ.last = {a}", ""),
                      ("OBJ.t = {v}", ""), ("setattr(OBJ, 'k', {i})", ""), ("OBJ.hist.append({i})", "")],
                  i=i, f=f, a=a, v=v)
    return row and [row[0]]


@template("attribute", 1, needs="pymodule")
def module_attribute(g):
    i = g.number("int")
    return [g.draw.choice(["cfgmod.count = cfgmod.count + 1", f"cfgmod.last = {i}", f"cfgmod.k = cfgmod.k + {i}"])]


@template("defaults", 3, needs="helper")
def helper_call(g):
    z, f, i = g.pick(*TENSOR), g.number("float"), g.number("int")
    nl = g.pick_mutable("nlist")
    table = [("helper({z})", "K"), ("helper({z}, {f})", "K"), ("helper({z}, b={i})", "K"),
             ("helper({z}, a={f}, b={i})", "K"), ("noisy({z})", "K"), ("noisy({z}, {f})", "K"),
             ("push({nl}, {i})", "int")]
    return assign_from(g, table, z=z, f=f, i=i, nl=nl, K=z and g.kind(z))


# -- nn.Module ---------------------------------------------------------------------------------

@template("nn_module", 4, needs="nn_module")
def module_call(g):
    m, a, v = g.pick("module"), g.pick("M"), g.pick("M", "V")
    table = [("{m}({a})", "M"), ("{m}.fc({v})", "K"), ("{m}.bn({a})", "M"), ("{m}.layers[-1]({v})", "K"),
             ("{v} * {m}.scale", "K"), ("{m}.fc.weight.sum()", "S"), ("{m}.bn.running_mean + {v}", "K"),
             ("{m}.steps + 0", "S"), ("sum(p.sum() for p in {m}.parameters())", "S"), ("{m}.training", "bool"),
             ("len({m}.layers)", "int"), ("{m}.layers[0].weight.requires_grad", "bool")]
    return assign_from(g, table, m=m, a=a, v=v, K=v and g.kind(v))


@template("modulelist", 3, needs="nn_module")
def module_list_loop(g):
    m, t = g.pick("module"), g.pick_local("M", "V")
    if m is None or t is None:
        return None
    return g.draw.choice([
        [f"for layer in {m}.layers:", f"    {t} = torch.relu(layer({t}))"],
        [f"for j, layer in enumerate({m}.layers):", f"    {t} = layer({t}) * (j + 1)"],
        [f"for layer in {m}.layers[:2]:", f"    {t} = layer({t})"],
        [f"if len({m}.layers) > 1:", f"    {t} = {m}.layers[1]({t})"],
    ])


@template("nn_module", 1, needs="nn_module")
def module_state_write(g):
    m = g.pick("module")
    return m and [g.draw.choice([f"{m}.calls = {m}.calls + 1", f"{m}.steps.add_(1)", f"{m}.last_shape = x.shape[0]"])]


@template("hooks", 1, needs="hooks", top_only=True)
def hook_in_frame(g):
    m, v = g.pick("module"), g.pick("M", "V")
    if m is None or v is None:
        return None
    handle, out = g.fresh("handle"), g.fresh("t")
    g.define(out, g.kind(v))
    return [f"{handle} = {m}.fc.register_forward_hook(fwd_hook)", f"{out} = {m}.fc({v})", f"{handle}.remove()"]


# -- exceptions ---------------------------------------------------------------------------------

@template("try", 3)
def try_except(g):
    a, l, d, nl, i = g.pick("M"), g.pick(*LISTS), g.pick(*DICTS, "argdict"), g.pick("nlist"), g.number("int")
    cond = tensor_condition(g)
    forms = []
    if a and l:
        forms.append(("M", ["try:", "    {T} = {l}[{i}]", "except IndexError:", "    {T} = {a}"]))
    if a and d:
        forms.append(("M", ["{T} = {a}", "try:", "    {T} = {d}['zz']", "except KeyError as e:",
                            "    print('missing', e)"]))
    if a and cond:
        forms.append(("M", ["try:", f"    if {cond}:", "        raise ValueError('positive')", "    {T} = {a} * 2",
                            "except ValueError as e:", "    {T} = {a} - 1", "    print('caught', str(e))"]))
    if nl:
        forms.append(("int", ["try:", "    {T} = {nl}.index({i})", "except ValueError:", "    {T} = -1"]))
    forms.append(("int", ["try:", "    {T} = 10 // {i}", "except ZeroDivisionError:", "    {T} = 0", "finally:",
                          "    print('finally')"]))
    kind, lines = g.draw.choice(forms)
    target = g.target(kind)
    if target is None:
        return None
    out = [line.format(T=target, l=l, i=i, a=a, d=d, nl=nl) for line in lines]
    g.define(target, kind)
    return out


@template("try", 2)
def try_block(g):
    body = g.block(size=2)
    handler = g.draw.choice(["except (RuntimeError, IndexError, KeyError, ValueError):",
                             "except Exception as e:", "except IndexError:"])
    lines = ["try:"] + body + [handler, "    print('error')"]
    if g.draw.chance(0.3):
        lines += ["finally:", "    print('finally')"]
    return lines


@template("raise", 1)
def raise_(g):
    i, a = g.number("int"), g.pick(*TENSOR)
    row = options(g, [("if {i} > 5:\n    raise ValueError(f'too big: {{{i}}}')", ""),
                      ("if {a}.sum() > 10:\n    raise RuntimeError('large sum')", ""),
                      ("assert {i} < 6, 'n too big'", "")], i=i, a=a)
    return row and row[0].split("\n")
