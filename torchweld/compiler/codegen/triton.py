"""Render one scheduled kernel as a Triton kernel: masked blocks of XBLOCK outer
elements; reductions in blocks of RBLOCK, one block when the row fits."""
from __future__ import annotations

import math
from typing import Iterator

import sympy
import torch

from torchweld import config
from torchweld.compiler import ir
from torchweld.compiler.codegen import size_args
from torchweld.compiler.codegen.common import C_LIKE_OPS, KernelRenderer, Scope
from torchweld.compiler.ir import Expr, Op
from torchweld.compiler.schedule import Kernel, Stage, map_exprs, structure
from torchweld.compiler.symbols import decide, hint, is_symbol_size, sympy_size
from torchweld.runtime.triton_launch import CONSTEXPRS, specialization_class
from torchweld.tuning import tuning

HALF_TYPES = (torch.float16, torch.bfloat16)
INT32_LIMIT = 1 << 31


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _once(kernel: Kernel, what: str, compute):
    """`compute(kernel)`, computed once per Kernel object: kernels are immutable, and the
    renderer, the launch configuration and the compile job each ask for what follows
    (each a walk over every expression of the kernel). Kept in the kernel's own
    __dict__, beside its (frozen) fields, so it lives as long as the kernel does."""
    memo = kernel.__dict__.setdefault("_triton_memo", {})
    if what not in memo:
        memo[what] = compute(kernel)
    return memo[what]


def size_generic(kernel: Kernel) -> bool:
    """Whether a pointwise kernel's code depends on its size only through its mask: every
    offset and value reads xindex alone (contiguous or broadcast-free accesses, after
    coalesce_indices). Such a kernel takes its element count as an argument (`xnumel`)
    and blocks that do not depend on it, so one compiled kernel serves every size:
    an optimizer's update of each parameter, a residual add at each resolution."""
    if not config.size_generic_kernels:
        return False
    return _once(kernel, "size_generic", _size_generic)


def _size_generic(kernel: Kernel) -> bool:
    numel = math.prod(kernel.outer)
    if kernel.is_reduction or not 1 < numel < INT32_LIMIT:
        return False
    coalesced = coalesce_indices(kernel)
    exprs = [st.index for st in coalesced.outer_stores] + kernel_values(coalesced)
    exprs += [st.index for stage in coalesced.stages for st in stage.stores]
    # (a symbolic size as a value, `x * 2 + n`: its code depends on a size beyond the mask)
    return all(ir.variables(e) <= {"xindex"} and not any(map(ir.is_symbolic_const, ir.walk(e))) for e in exprs)


def kernel_params(kernel: Kernel) -> tuple[str, ...]:
    """The names of the kernel function's parameters, in order: a pointer per argument
    (Kernel.args), the runtime_ints, then the CONSTEXPRS."""
    generic = ("xnumel",) if size_generic(kernel) else ()
    chosen = size_args.chosen(kernel)
    taken = chosen.params() if chosen else ()
    return tuple(f"ptr{i}" for i in range(len(kernel.args))) + generic + taken + CONSTEXPRS


def unspecialized_params(kernel: Kernel) -> tuple[str, ...]:
    """The integer parameters Triton is told not to specialize on (`do_not_specialize`): the
    symbolic sizes (one compile for all their values), and the
    divisors' magic numbers (size_args.packed_division), whose divisibility by 16 says nothing
    about any address. Specialized, they split a family's compiles by chance: densenet121's
    training forward 122 compiles, 104 without."""
    chosen = size_args.chosen(kernel)
    numel = ("xnumel",) if size_generic(kernel) and kernel.over_symbols else ()
    return (*numel, *chosen.divisors.values(), *chosen.symbolic_params()) if chosen else numel


def int_classes(kernel: Kernel) -> tuple[int, ...]:
    """The specialization class of each of `kernel`'s runtime_ints (triton_launch.specialization_class):
    kernels whose classes agree are one compile."""
    unspecialized = set(unspecialized_params(kernel))
    ints = kernel_params(kernel)[len(kernel.args):][:len(runtime_ints(kernel))]
    # a symbolic size is a 32-bit int: render_modules refuses a kernel over symbols that needs_int64
    values = tuple(17 if is_symbol_size(v) else v for v in runtime_ints(kernel))
    return specialization_class(values, tuple(name in unspecialized for name in ints))


def runtime_ints(kernel: Kernel) -> tuple[int, ...]:
    """The integer arguments `kernel` takes after its pointers: its element count where
    it is size_generic, its integers where it takes them as arguments (size_args.py),
    nothing otherwise (its sizes are in its source)."""
    chosen = size_args.chosen(kernel)
    if chosen:
        return chosen.values()
    return (math.prod(kernel.outer),) if size_generic(kernel) else ()


def block_sizes(kernel: Kernel) -> tuple[int, int]:
    """(XBLOCK, RBLOCK) from the kernel's sizes and how its loads run."""
    return _once(kernel, f"block_sizes{config.size_generic_kernels}", _block_sizes)


def _block_sizes(kernel: Kernel) -> tuple[int, int]:
    # over symbols, from the sizes of the call being compiled (hint): any blocks compute the
    # same; whether a reduction's block holds a whole row is the renderer's comparison of
    # SymInts (open_stage), which the ShapeEnv guards
    xnumel = max(hint(math.prod(kernel.outer)), 1)
    if size_generic(kernel) or kernel.over_symbols and not kernel.is_reduction:
        return tuning.pointwise_xblock, 1  # one block size, so that kernels of any size share one function
    if not kernel.is_reduction:
        return min(tuning.pointwise_xblock, next_power_of_2(xnumel)), 1
    rnumel = hint(math.prod(kernel.reduced))
    if reads_across_rows(kernel):
        # blocks of up to tuning.outer_xblock outputs side by side, each row's load one contiguous
        # segment; narrower (down to 8 outputs, a 32-byte sector) where that leaves too few programs
        xblock = tuning.outer_xblock
        while xblock > 8 and xnumel // xblock < tuning.outer_programs:
            xblock //= 2
        xblock = min(xblock, next_power_of_2(xnumel))
        return xblock, min(4096 // xblock, next_power_of_2(rnumel))
    rblock = next_power_of_2(rnumel) if rnumel <= tuning.max_persistent_rblock else tuning.looped_rblock
    if is_symbol_size(math.prod(kernel.reduced)):  # rows of any length: a loop (is_looped) of blocks this wide
        rblock = min(rblock, tuning.looped_rblock)
    xblock = max(1, min(next_power_of_2(xnumel), tuning.row_block_elements // rblock, 64))
    return xblock, rblock


def is_looped(kernel: Kernel) -> bool:
    """Whether a reduction's rows are walked in a loop of RBLOCK-wide steps (else one block holds
    a row): rows longer than a block, and rows whose length is a symbol."""
    rnumel = math.prod(kernel.reduced)
    return is_symbol_size(rnumel) or rnumel > block_sizes(kernel)[1]


# A looped reduction's floating sums add each RBLOCK-wide step into a partial sum of a chunk of
# tuning.chunk_steps steps, and the partials into a float64 running total (one add per chunk):
# one float32 running sum per lane over a row of 1.5M elements (1465 adds a lane) was 20x
# further from the exact sum than eager's (cpp_reduction.py does the same on the CPU).
def chunk_steps(rnumel: int, rblock: int) -> int:
    """RBLOCK-wide steps of a looped reduction per chunk, or 0 for one running sum (a row of few steps)."""
    if is_symbol_size(rnumel):  # rows of any length: chunked (a row of one chunk computes the same)
        return tuning.chunk_steps
    return tuning.chunk_steps if -(-rnumel // rblock) > 2 * tuning.chunk_steps else 0


def reads_across_rows(kernel: Kernel) -> bool:
    """Whether a reduction kernel reads its rows across, contiguous along its outputs
    (ir.contiguous_across): blocks then take many outputs and short stretches of rows."""
    xs = [f"x{k}" for k, size in enumerate(kernel.outer) if size != 1]
    rs = [f"r{k}" for k, size in enumerate(kernel.reduced) if size != 1]
    if not xs or not rs:
        return False
    offsets = [load.args[0] for value in kernel_values(kernel) for load in ir.loads(value)]
    # xindex/rindex: the kernel after coalesce_indices, which the renderer sees
    return ir.contiguous_across(offsets, rs + ["rindex"], xs + ["xindex"])


def launch_config(kernel: Kernel) -> dict:
    """The untuned launch: block sizes, plus num_warps where it is not Triton's default of 4."""
    xblock, rblock = block_sizes(kernel)
    config = {"XBLOCK": xblock, "RBLOCK": rblock}
    if kernel.is_reduction and xblock * rblock >= 1024 and draws_random(kernel):
        # Philox for each element a thread holds, unrolled: 4 a thread, not 8, halve the code
        # Triton compiles. GPT-2's dropout + residual + layer norm kernels, the slowest of its
        # training step to compile, 0.26 -> 0.21 s for sm_90; its step within noise
        # (bench/DECISIONS.md#random-warps).
        config["num_warps"] = 8
    return config


def draws_random(kernel: Kernel) -> bool:
    return _once(kernel, "draws_random",
                 lambda k: any(n.op is Op.RAND for value in kernel_values(k) for n in ir.walk(value)))


# =============================================================================
# Index coalescing: contiguous accesses read xindex itself, not x0..xn
# =============================================================================
# A kernel's loop variables x0..xn unravel the flat xindex over `outer` (div/mod per
# element). An access whose flat offset is sum(x_k * contiguous_stride_k) * s + c is
# xindex * s + c: no div/mod, and with s == 1 Triton sees a contiguous range it can
# load as 16-byte vectors. Likewise r0..rm and rindex.


def _coalesce(e: Expr, groups) -> Expr:
    terms = ir.affine_terms(e)
    if terms is None:
        return e
    coefs, offset = terms
    rest = {name: c for name, c in coefs.items() if c != 0}
    out = ir.const(offset)
    for prefix, sizes, flat in groups:
        strides = ir.contiguous_strides(sizes)
        own = {f"{prefix}{k}": st for k, (size, st) in enumerate(zip(sizes, strides)) if size != 1}
        if not own or not all(name in rest for name in own):
            continue
        first = next(iter(own))
        scale = _exact_quotient(rest[first], own[first])
        if scale is None or any(not _same(rest[name], _times(scale, st)) for name, st in own.items()):
            continue
        for name in own:
            del rest[name]
        out = ir.iadd(out, ir.imul(ir.var(flat), ir.const(scale)))
    if len(rest) == len([c for c in coefs.values() if c != 0]):
        return e
    for name, c in rest.items():
        out = ir.iadd(out, ir.imul(ir.var(name), ir.const(c)))
    return out


def _exact_quotient(a: object, b: object) -> object | None:
    """a / b where it divides exactly (for every value of the symbols, where they are sizes), else None."""
    if not (is_symbol_size(a) or is_symbol_size(b)):
        scale, remainder = divmod(a, b)
        return None if remainder else scale
    numerator, denominator = sympy.fraction(sympy.cancel(sympy.sympify(sympy_size(a)) / sympy_size(b)))
    if denominator != 1:
        return None
    if numerator.is_number:
        return int(numerator) if numerator.is_integer else None
    return numerator if all(c.is_integer for c in sympy.Poly(numerator).coeffs()) else None


def _times(a: object, b: object) -> object:
    return sympy.expand(sympy_size(a) * sympy_size(b)) if is_symbol_size(a) or is_symbol_size(b) else a * b


def _same(a: object, b: object) -> bool:
    """Equal for every value of the symbols (ints: equal)."""
    if is_symbol_size(a) or is_symbol_size(b):
        return sympy.expand(sympy_size(a) - sympy_size(b)) == 0
    return a == b


def coalesce_indices(kernel: Kernel) -> Kernel:
    """`kernel` with every load and store offset, and every random number's counter, that is
    contiguous in x (or r) written over xindex (rindex)."""
    return _once(kernel, "coalesced", _coalesce_indices)


def _coalesce_indices(kernel: Kernel) -> Kernel:
    groups = (("x", kernel.outer, "xindex"), ("r", kernel.reduced, "rindex"))
    memo: dict = {}

    def leaf(node: Expr):
        if node.op is Op.LOAD:
            return Expr(Op.LOAD, node.dtype, (_coalesce(node.args[0], groups),), node.arg)
        if node.op is Op.RAND:
            return Expr(Op.RAND, node.dtype, (node.args[0], _coalesce(node.args[1], groups)))
        return None

    return map_exprs(kernel, lambda e: ir.rewrite(e, leaf, memo), lambda e: _coalesce(e, groups))


# =============================================================================
# Branch loads: where(c, a, b) reads a's operands only where c holds, b's where it does not
# =============================================================================
# A torch.cat of n inputs is a chain of n-1 wheres over clamped loads of every input:
# without masks each output element reads all n inputs.


class _BranchLoads:
    """Per node of one expression (by identity): the (buffer, index) keys of the loads under it,
    all of them and the unmasked ones, computed once. A torch.cat of n inputs nests n-1 wheres,
    and asking each where for its branches' loads afresh walked the chain below it again
    (densenet121's 67 kernels: 0.6 s of its 1.1 s of rendering on the H100 host)."""

    def __init__(self):
        self._below: dict[int, tuple[Expr, frozenset, frozenset]] = {}
        self._keys: dict[int, tuple[Expr, tuple]] = {}

    def key(self, load: Expr) -> tuple:
        got = self._keys.get(id(load))
        if got is None:
            got = self._keys[id(load)] = (load, (load.arg, load.args[0].key()))
        return got[1]

    def below(self, e: Expr) -> tuple[frozenset, frozenset]:
        """(keys of every load under `e`, keys of the unmasked ones)."""
        got = self._below.get(id(e))
        if got is not None:
            return got[1], got[2]
        if e.op is Op.LOAD:
            every = unmasked = frozenset((self.key(e),))
        else:
            parts = [self.below(a) for a in e.args]
            every = frozenset().union(*(p[0] for p in parts))
            unmasked = frozenset().union(*(p[1] for p in parts))
            if e.op is Op.MASKED_LOAD:
                every = every | {self.key(e)}
        self._below[id(e)] = (e, every, unmasked)  # e kept alive, so its id stays its own
        return every, unmasked

    def add_mask(self, e: Expr, mask: Expr, keep: frozenset) -> Expr:
        """`e` with every unmasked load whose key is not in `keep` masked by `mask`.

        A load keeps the mask of the innermost where it sits in: masks only save reads
        (the where picks the value), and conditions that say their range exactly, as
        torch.cat's do, then cost O(1) each instead of a conjunction per level. Subtrees
        with nothing to mask are returned as they are, unvisited."""
        memo: dict[int, Expr] = {}

        def visit(node: Expr) -> Expr:
            got = memo.get(id(node))
            if got is not None:
                return got
            if self.below(node)[1] <= keep:
                out = node
            elif node.op is Op.LOAD:
                out = Expr(Op.MASKED_LOAD, node.dtype, (node.args[0], mask), node.arg)
            else:
                args = tuple(visit(a) for a in node.args)
                out = node if all(x is y for x, y in zip(args, node.args)) else Expr(node.op, node.dtype, args, node.arg)
            memo[id(node)] = out
            return out

        return visit(e)


def _mask_branches(e: Expr) -> Expr:
    branch_loads = _BranchLoads()

    def leaf(node: Expr):
        if node.op is not Op.WHERE:
            return None
        cond, a, b = node.args
        a_every, b_every = branch_loads.below(a)[0], branch_loads.below(b)[0]
        if not a_every and not b_every or _uniform(cond):
            return None
        in_cond = branch_loads.below(cond)[1]
        # a load the condition or the other branch needs anyway is read unmasked, once
        a = branch_loads.add_mask(a, cond, in_cond | b_every) if a_every else a
        not_cond = Expr(Op.LOGICAL_NOT, torch.bool, (cond,))
        b = branch_loads.add_mask(b, not_cond, in_cond | a_every) if b_every else b
        return Expr(Op.WHERE, node.dtype, (cond, a, b))

    return ir.rewrite(e, leaf)


def _uniform(e: Expr) -> bool:
    """Whether `e` is one value for the whole kernel (it reads only scalar loads, which
    render_load renders unmasked): no mask of a load needs it, and Triton's interpreter
    cannot combine a scalar mask with a block's."""
    return not any(n.op in (Op.VAR, Op.REDUCED) for n in ir.walk(e))


def mask_branch_loads(kernel: Kernel) -> Kernel:
    """`kernel` with the loads only one branch of a where needs masked by its condition."""
    if not any(n.op is Op.WHERE for e in kernel_values(kernel) for n in ir.walk(e)):
        return kernel
    return map_exprs(kernel, _mask_branches)


def prepared(kernel: Kernel) -> Kernel:
    """`kernel` as the renderer writes it: indices coalesced, branch loads masked."""
    return _once(kernel, "prepared", lambda k: mask_branch_loads(coalesce_indices(k)))


def kernel_values(kernel: Kernel) -> list[Expr]:
    """Every value `kernel` accumulates or stores."""
    values = [a.value for stage in kernel.stages for a in stage.reductions]
    values += [st.value for stage in kernel.stages for st in stage.stores]
    return values + [st.value for st in kernel.outer_stores]


def needs_int64(kernel: Kernel) -> bool:
    """Whether some index of `kernel` may reach 2**31 (Triton's program ids and aranges are int32)."""
    return _once(kernel, "needs_int64", _needs_int64)


def _needs_int64(kernel: Kernel) -> bool:
    sizes = {f"x{k}": s for k, s in enumerate(kernel.outer)} | {f"r{k}": s for k, s in enumerate(kernel.reduced)}
    sizes |= {"xindex": math.prod(kernel.outer), "rindex": math.prod(kernel.reduced)}
    if math.prod(kernel.outer) * math.prod(kernel.reduced) >= INT32_LIMIT:
        return True
    indexes = [st.index for stage in kernel.stages for st in stage.stores] + [st.index for st in kernel.outer_stores]
    indexes += [n.args[0] for v in kernel_values(kernel) for n in ir.loads(v)]
    for index in indexes:
        terms = ir.affine_terms(index)
        if terms is None:
            continue
        coefs, offset = terms
        if kernel.over_symbols:  # a bound over the symbols, decided (and guarded) at this call's sizes
            bound = abs(offset) + sum(abs(c) * (sympy_size(sizes.get(name, 1)) - 1) for name, c in coefs.items())
            if decide(sympy.Ge(bound, INT32_LIMIT)):
                return True
        elif abs(offset) + sum(abs(c) * max(sizes.get(name, 1) - 1, 0) for name, c in coefs.items()) >= INT32_LIMIT:
            return True
    return False


def family(kernel: Kernel) -> tuple:
    """What `kernel`'s members of a family share (render_modules): its structure with its numbers
    left out (floats too: kernels that differ in a size's mean, 1/N, are one family, whose
    later members share a source where their floats agree: 123 forward compiles of
    densenet121's step against 130 for integers alone), and the forms of code the renderer
    picks from its sizes (a row read whole or in a loop, in chunks; streamed reads)."""
    rnumel = math.prod(kernel.reduced)
    looped = is_looped(kernel)
    chunked = looped and chunk_steps(rnumel, block_sizes(kernel)[1]) > 0
    streams = not kernel.is_reduction and hint(math.prod(kernel.outer)) >= tuning.streaming
    return structure(prepared(kernel), numbers=False), looped, chunked, streams


def _written_variables(e: Expr) -> frozenset:
    """The variables `e`'s code names itself: index arithmetic is written inline, other
    values (a load, a cast) through a temporary whose code names its own."""
    if e.op is Op.VAR:
        return frozenset((e.arg,))
    if e.dtype is not ir.INDEX or e.op in (Op.LOAD, Op.MASKED_LOAD) or not e.args:
        return frozenset()
    return frozenset().union(*map(_written_variables, e.args))


def _loop_variable(name: str) -> bool:
    """Whether `name` is one of a kernel's loop variables (x0.., r0.., xindex, rindex), not a
    size it takes as an argument (ks0..)."""
    return name in ("xindex", "rindex") or name[:1] in ("x", "r") and name[1:].isdigit()


def _constant_index(e: Expr) -> bool:
    """Whether `e` is index arithmetic on integer constants alone (one element's offset)."""
    if e.op is Op.CONST:
        return not e.dtype.is_floating_point
    return e.op in (Op.ADD, Op.SUB, Op.MUL, Op.NEG) and e.dtype is ir.INDEX and all(map(_constant_index, e.args))


def _contiguous_in_x(e: Expr) -> bool:
    """Whether `e` reads xindex itself, or xindex plus one value (a constant, a size, a temporary)."""
    if e.op is Op.VAR:
        return e.arg == "xindex"
    if e.op is not Op.ADD or e.dtype is not ir.INDEX:
        return False
    first, offset = e.args
    return first.op is Op.VAR and first.arg == "xindex" and _one_name(offset)


def _one_name(e: Expr) -> bool:
    """Whether `e`'s code is one name or number: a leaf, or a value held in a temporary."""
    return e.op in (Op.CONST, Op.VAR, Op.REDUCED, Op.LOAD, Op.MASKED_LOAD) or e.dtype is not ir.INDEX


def _float(value: float) -> str:
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(float(value))


def _pow_code(base: str, exponent: str) -> str:
    """pow: of a constant positive base (Adam's bias corrections, beta ** step, where beta is
    a number) one exp2 of its log2 computed here; of any other base, _tw_pow (HELPERS)."""
    constant = _constant(base)
    if 0 < constant < math.inf:
        return f"tl.exp2({exponent} * {_float(math.log2(constant))})"
    if not math.isnan(_constant(exponent)):  # a block of it, for the element-wise tests of _tw_pow
        exponent = f"(tl.zeros_like({base}) + {exponent})"
    return f"_tw_pow({base}, {exponent})"


def _constant(code: str) -> float:
    """The number a rendered operand spells, or NaN for a value's name (or a constant spelled float("..."))."""
    try:
        return float(code)
    except ValueError:
        return math.nan


HELPERS = '''
@triton.jit
def _tw_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tw_min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tw_pow(a, b):
    # torch.pow of float tensors without libdevice (not in Triton's CPU interpreter):
    # |a| ** b as exp2(b * log2|a|) (within a few ulp), the sign of a negative base to an odd
    # integer power, NaN for a finite negative base to a fractional power, and pow(x, 0) =
    # pow(1, y) = pow(-1, +-inf) = 1, as C's pow has them
    magnitude = tl.exp2(b * tl.log2(tl.abs(a)))
    integral = b == tl.floor(b)
    odd = integral & (tl.abs(b) % 2 == 1)
    signed = tl.where(odd & ((a < 0) | (1.0 / a < 0)), -magnitude, magnitude)  # -0.0 too
    result = tl.where((a < 0) & ~integral & (a != float("-inf")), float("nan"), signed)
    one = (b == 0) | (a == 1) | ((a == -1) & (tl.abs(b) == float("inf")))
    return tl.where(one, 1.0, result)


@triton.jit
def _tw_tanh(x):
    # tanh without libdevice: 1 - 2 / (1 + exp(2|x|)) from |x| = 0.625 on, Cephes' tanhf
    # polynomial below, where that difference cancels (2 * sigmoid(2x) - 1 gave tanh(1e-7) = 0
    # and tanh(-0.0) = +0.0); within a few ulp of torch.tanh, the sign of zero and NaN kept
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * x + x
    large = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * tl.abs(x)))
    small = tl.where(x == 0, x, small)  # x + (-0.0 * ...) is +0.0
    return tl.where(tl.abs(x) < 0.625, small, tl.where(x < 0, -large, large))


@triton.jit
def _tw_divide(n, packed):
    # n // d for 0 <= n < 2**31, from d's magic number and shift (size_args.packed_division)
    magic = (packed & 0xFFFFFFFF).to(tl.uint32)
    shift = (packed >> 32).to(tl.uint32)
    return (tl.umulhi(n.to(tl.uint32), magic) >> shift).to(tl.int32)


@triton.jit
def _tw_max_rows(x, axis):
    return tl.reduce(x, axis, _tw_max)


@triton.jit
def _tw_min_rows(x, axis):
    return tl.reduce(x, axis, _tw_min)
'''


class TritonRenderer(KernelRenderer):
    name = "TritonRenderer"
    dtype_names = {
        torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
        torch.bfloat16: "tl.bfloat16", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
        torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
    }
    code_for_op = {
        **C_LIKE_OPS,
        Op.IDIV: lambda a, b: f"{a} // {b}",
        Op.ABS: lambda a: f"tl.abs({a})",
        Op.EXP: lambda a: f"tl.exp({a})",
        Op.LOG: lambda a: f"tl.log({a})",
        Op.LOG2: lambda a: f"tl.log2({a})",
        Op.SIN: lambda a: f"tl.sin({a})",
        Op.COS: lambda a: f"tl.cos({a})",
        Op.TANH: lambda a: f"_tw_tanh({a})",
        # IEEE square roots: torch's precision, and no libdevice to link into the kernel
        # (tl.sqrt and tl.rsqrt lower to libdevice calls: ~50 ms more compile per kernel)
        Op.SQRT: lambda a: f"tl.sqrt_rn({a})",
        Op.RSQRT: lambda a: f"(1.0 / tl.sqrt_rn({a}))",
        Op.SIGMOID: lambda a: f"tl.sigmoid({a})",
        Op.ERF: lambda a: f"tl.erf({a})",
        Op.FLOOR: lambda a: f"tl.floor({a})",
        Op.CEIL: lambda a: f"tl.ceil({a})",
        Op.TRUNC: lambda a: f"tl.where({a} < 0, tl.ceil({a}), tl.floor({a}))",
        Op.ISNAN: lambda a: f"{a} != {a}",
        Op.LOGICAL_NOT: lambda a: f"{a} == 0",
        Op.MAXIMUM: lambda a, b: f"tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
        Op.MINIMUM: lambda a, b: f"tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
        Op.LOGICAL_AND: lambda a, b: f"{a} & {b}",
        Op.LOGICAL_OR: lambda a, b: f"{a} | {b}",
        Op.LOGICAL_XOR: lambda a, b: f"{a} ^ {b}",
        Op.WHERE: lambda c, a, b: f"tl.where({c}, {a}, {b})",
        Op.FMA: lambda a, b, c: f"tl.fma({a}, {b}, {c})",
        Op.RAND: lambda seed, offset: f"tl.rand({seed}, ({offset}).to(tl.uint32))",
        Op.POW: lambda a, b: _pow_code(a, b),
    }
    # expm1, log1p, tan, atan, atan2, round need libdevice, which Triton's CPU interpreter
    # cannot run, so they stay extern; so does float64 math
    unsupported_dtypes = frozenset({torch.float64})
    reduce_init = {Op.SUM: "0", Op.PROD: "1", Op.MAX: 'float("-inf")', Op.MIN: 'float("inf")'}
    # max/min propagate NaN as torch's do (tl.max and tl.minimum by default return the other operand)
    reduce_fn = {Op.SUM: "tl.sum", Op.MAX: "_tw_max_rows", Op.MIN: "_tw_min_rows"}
    reduce_ops = frozenset(reduce_fn)

    # -- values ------------------------------------------------------------------
    def register_type(self, dtype) -> str:
        return "tl.float32" if dtype in HALF_TYPES else self.dtype_names[dtype]

    def render_const(self, value, dtype) -> str:
        if dtype is torch.bool:
            return "1" if value else "0"
        if dtype.is_floating_point:
            return _float(value)
        return str(int(value))

    def render_cast(self, x, src, dst) -> str:
        if dst is torch.bool:
            return f"({x} != 0)"
        if dst in HALF_TYPES:
            return f"({x}).to({self.dtype_names[dst]}).to(tl.float32)"
        return f"({x}).to({self.dtype_names[dst]})"

    def assign(self, name, code, dtype) -> str:
        return f"{name} = {code}"

    def mask(self, scope: Scope) -> str:
        return self.scope_masks.get(id(scope), "xmask")

    @staticmethod
    def as_block(index: str, index_expr: Expr) -> str:
        """Pointers must be blocks when masks are: an index that names no loop variable gets broadcast."""
        return index if any(map(_loop_variable, _written_variables(index_expr))) else f"{index} + 0 * xindex"

    def render(self, kernel: Kernel, sizes: size_args.SizeArgs | None = None) -> str:
        """`kernel`'s function; with `sizes`, one that takes its integers as those arguments."""
        self.sizes = sizes
        rendered = sizes.kernel if sizes else prepared(kernel)
        # the loop variables some value or index reads: the others are not written out
        self.read_variables = frozenset().union(*map(ir.variables, kernel_values(rendered)), *(
            ir.variables(st.index) for st in (*(st for stage in rendered.stages for st in stage.stores),
                                              *rendered.outer_stores)))
        return super().render(rendered)

    def size(self, value: int) -> str:
        """An integer of the kernel's sizes: its argument's name where it takes them, else itself."""
        name = self.sizes.name_of(value) if self.sizes else None
        if name is None and is_symbol_size(value):
            raise NotImplementedError(f"{self.kernel.name}: a symbolic size {value} it takes no argument for")
        return name or str(value)

    def eviction(self, index_expr: Expr) -> str:
        """Pointwise kernels too big for L2 stream their operands; broadcast operands are reused."""
        if self.kernel.is_reduction:
            return ""
        dims = {f"x{k}" for k, size in enumerate(self.kernel.outer) if size != 1}
        written = _written_variables(index_expr)
        if "xindex" not in written and not dims <= written:
            return ", eviction_policy='evict_last'"  # a broadcast read: each element is read many times
        # (a cache hint, right at any size: over symbols, chosen at the compiled call's)
        if hint(math.prod(self.kernel.outer)) >= tuning.streaming and _contiguous_in_x(index_expr):
            return ", eviction_policy='evict_first'"
        return ""

    def render_load(self, buffer, index, dtype, scope, index_expr, mask: str | None = None) -> str:
        if mask is None and _constant_index(index_expr):
            # one element (a 0-d input: Adam's step and betas, a batch norm's counter) loads as a
            # scalar, always in bounds: what computes with it alone runs once a thread, not on
            # every element of a block (Adam's bias corrections, two pows a parameter)
            code = f"tl.load({self.pointer(buffer)} + ({index}))"
        else:
            block_mask = self.mask(scope) if mask is None else f"{self.mask(scope)} & ({mask})"
            code = (f"tl.load({self.pointer(buffer)} + ({self.as_block(index, index_expr)}), {block_mask}, other=0"
                    f"{self.eviction(index_expr)})")
        if dtype in HALF_TYPES:
            code += ".to(tl.float32)"
        return code

    def store(self, store, scope) -> None:
        value = self.expr(store.value, scope)
        index = self.expr(store.index, scope)
        if self.kernel.is_reduction and not self.scope_masks.get(id(scope)):
            shape = "[XBLOCK, 1]"
        elif not self.kernel.is_reduction:
            shape = "[XBLOCK]"
        else:
            shape = "[XBLOCK, RBLOCK]"
        if store.value.op is Op.CONST:  # a literal is a constexpr, which broadcast_to does not take
            value = f"tl.full({shape}, {value}, {self.register_type(store.value.dtype)})"
        else:
            value = f"tl.broadcast_to({value}, {shape})"
        self.emit(scope, f"tl.store({self.pointer(store.buffer)} + ({self.as_block(index, store.index)}), {value}, {self.mask(scope)})")
        scope.forget_loads(store.buffer)

    # -- blocks ------------------------------------------------------------------
    def open_kernel(self, kernel: Kernel) -> Scope:
        self.scope_masks: dict[int, str] = {}
        self.row_scope: Scope | None = None
        generic = size_generic(kernel)
        params = ", ".join(f"{p}: tl.constexpr" if p in CONSTEXPRS else p for p in kernel_params(kernel))
        top = Scope(None, 0)
        unspecialized = unspecialized_params(kernel)
        self.emit(top, f"@triton.jit(do_not_specialize={list(unspecialized)})" if unspecialized else "@triton.jit")
        self.emit(top, f"def {kernel.name}({params}):")
        body = Scope(None, 1)
        xnumel = "xnumel" if generic else self.size(math.prod(kernel.outer))
        arange = "tl.arange(0, XBLOCK)[:, None]" if kernel.is_reduction else "tl.arange(0, XBLOCK)"
        pid = "tl.program_id(0).to(tl.int64)" if needs_int64(kernel) else "tl.program_id(0)"
        self.emit(body, f"xindex = {pid} * XBLOCK + {arange}")
        self.emit(body, f"xmask = xindex < {xnumel}")
        self.emit_unravel(body, "xindex", "x", kernel.outer)
        return body

    def emit_unravel(self, scope: Scope, flat: str, prefix: str, sizes) -> None:
        if self.sizes:
            return self.emit_unravel_by_arguments(scope, flat, prefix, sizes)
        first = True
        for k, (size, inner) in enumerate(zip(sizes, ir.inner_sizes(sizes))):
            if size == 1:
                continue
            q = flat if inner == 1 else f"({flat} // {inner})"
            if f"{prefix}{k}" in self.read_variables:
                self.emit(scope, f"{prefix}{k} = {q}" if first else f"{prefix}{k} = {q} % {size}")
            first = False

    def emit_unravel_by_arguments(self, scope: Scope, flat: str, prefix: str, sizes) -> None:
        """The unravelling of `flat` with sizes that are arguments: one division by magic number
        a dimension (`{prefix}q<k>` = flat // inner), and each dimension's index that quotient
        less the outer one's times its size (x1 = flat // 64 - flat // 2048 * 32)."""
        outer_quotient = None
        for k, (size, inner) in enumerate(zip(sizes, ir.inner_sizes(sizes))):
            if size == 1:
                continue
            quotient = flat
            if inner != 1:
                quotient = f"{prefix}q{k}"
                divided = f"{flat} // {self.size(inner)}" if is_symbol_size(inner) else \
                    f"_tw_divide({flat}, {self.sizes.divisors[inner]})"
                self.emit(scope, f"{quotient} = {divided}")
            index = quotient if outer_quotient is None else f"{quotient} - {outer_quotient} * {self.size(size)}"
            if f"{prefix}{k}" in self.read_variables:
                self.emit(scope, f"{prefix}{k} = {index}")
            outer_quotient = quotient

    def close_kernel(self, kernel: Kernel) -> None:
        pass

    def open_stage(self, i: int, stage: Stage, outer: Scope) -> Scope:
        rnumel = math.prod(self.kernel.reduced)
        _, rblock = block_sizes(self.kernel)
        looped = is_looped(self.kernel)
        steps = chunk_steps(rnumel, rblock) if looped else 0
        self.partials = {}  # accumulation -> (its running total, the partial sum of the chunk)
        for acc in stage.reductions:
            name = self.new_tmp("acc")
            self.reduced_names[acc.name] = name
            if steps and acc.reduce_op is Op.SUM and acc.dtype.is_floating_point:
                self.partials[acc.name] = (name, f"{name}p")
            init = self.reduce_init[acc.reduce_op]
            dtype = self.register_type(acc.dtype)
            if acc.dtype is torch.bool:
                dtype, init = "tl.int1", "0" if acc.reduce_op in (Op.MAX, Op.SUM) else "1"
            elif not acc.dtype.is_floating_point and acc.reduce_op in (Op.MAX, Op.MIN):
                info = torch.iinfo(acc.dtype)
                init = str(info.min if acc.reduce_op is Op.MAX else info.max)
            if acc.name in self.partials:
                dtype = "tl.float64"  # the running total of the chunks' partial sums
            self.emit(outer, f"{name} = tl.full([XBLOCK, RBLOCK], {init}, {dtype})")
        if not looped and self.row_scope is not None:
            # one block holds whole rows: the stages are one straight run of code, so a later
            # stage reads the values an earlier one loaded and computed instead of redoing
            # them (a layer norm's three passes load, and draw random numbers, once)
            return self.row_scope
        indent = outer.indent
        if steps:  # (rindex past the row's end is masked like the last step's)
            self.emit(outer, f"for rchunk in range(0, {self.size(rnumel)}, RBLOCK * {steps}):")
            indent += 1
            for acc in stage.reductions:
                if acc.name in self.partials:
                    total, partial = self.partials[acc.name]
                    self.emit(Scope(None, indent), f"{partial} = tl.full([XBLOCK, RBLOCK], 0, {self.register_type(acc.dtype)})")
                    self.reduced_names[acc.name] = partial
            end = f"rchunk + RBLOCK * {steps}"
            if is_symbol_size(rnumel):  # (a row of any length: no steps past its end, the last chunk short)
                end = f"tl.minimum({end}, {self.size(rnumel)})"
            self.emit(Scope(None, indent), f"for roffset in range(rchunk, {end}, RBLOCK):")
            indent += 1
            inner = Scope(outer, indent)
            self.emit(inner, "rindex = roffset + tl.arange(0, RBLOCK)[None, :]")
        elif looped:
            self.emit(outer, f"for roffset in range(0, {self.size(rnumel)}, RBLOCK):")
            indent += 1
            inner = Scope(outer, indent)
            self.emit(inner, "rindex = roffset + tl.arange(0, RBLOCK)[None, :]")
        else:
            inner = Scope(outer, indent)
            self.emit(inner, "rindex = tl.arange(0, RBLOCK)[None, :]")
        self.emit(inner, f"rmask = rindex < {self.size(rnumel)}")
        self.emit_unravel(inner, "rindex", "r", self.kernel.reduced)
        self.emit(inner, "xrmask = xmask & rmask")
        self.scope_masks[id(inner)] = "xrmask"
        if not looped:
            self.row_scope = inner
        return inner

    def close_stage(self, i: int, stage: Stage, outer: Scope) -> None:
        for total, partial in self.partials.values():
            self.emit(Scope(None, outer.indent + 1), f"{total} = {total} + {partial}.to(tl.float64)")
        for acc in stage.reductions:
            if acc.name in self.partials:
                self.reduced_names[acc.name] = self.partials[acc.name][0]
            name = self.reduced_names[acc.name]
            fn = self.reduce_fn[acc.reduce_op]
            if acc.dtype is torch.bool:
                fn = "tl.max" if acc.reduce_op in (Op.MAX, Op.SUM) else "tl.min"
                self.emit(outer, f"{name} = {fn}({name}.to(tl.int8), 1)[:, None] != 0")
            elif acc.name in self.partials:
                self.emit(outer, f"{name} = {fn}({name}, 1)[:, None].to({self.register_type(acc.dtype)})")
            else:
                self.emit(outer, f"{name} = {fn}({name}, 1)[:, None]")

    def accumulate(self, acc, value, scope) -> None:
        name = self.reduced_names[acc.name]
        combine = {
            Op.SUM: f"{name} + {value}",
            Op.MAX: self.code_for_op[Op.MAXIMUM](name, value),
            Op.MIN: self.code_for_op[Op.MINIMUM](name, value),
        }[acc.reduce_op]
        if acc.dtype is torch.bool:
            combine = f"{name} | {value}" if acc.reduce_op in (Op.MAX, Op.SUM) else f"{name} & {value}"
        self.emit(scope, f"{name} = tl.where(xrmask, {combine}, {name})")

    def render_modules(self, kernels: list[Kernel], buffer_dtypes: dict,
                       literal_members: int | None = None) -> Iterator[tuple[Kernel, str, str | None]]:
        """Per scheduled kernel, as it is rendered: (kernel, its function's name, the source
        of a module holding that function alone, or None where an earlier kernel's is the same).

        Functions are named by a hash of their text, so identical kernels (the repeated
        blocks of a network) are one function, compiled once per process and found in
        Triton's disk cache by the next. A kernel that differs from
        tuning.literal_family_members earlier ones only in its integers takes them as
        arguments (size_args.py), so that the later kernels of its family are one function
        too; the first ones keep their literals, handed over before the later ones are rendered.
        `literal_members` (default tuning.literal_family_members) of a family keep them: 0 for a
        graph compiled once per size (backends/weld_sizes.py), whose kernels then share one
        source, compiled once, across its sizes. One module per function lets each
        kernel be loaded and handed to the compilers while the next is rendered. (Rendering
        every kernel first and deciding then made densenet121's training step 255 compiles
        instead of 288 and lost that overlap: its inference's first call took 8.7 s, not 6.5.)"""
        from torchweld.disk_cache import content_hash

        self.buffer_dtypes = buffer_dtypes
        literal_members = tuning.literal_family_members if literal_members is None else literal_members
        families: dict[tuple, set[str]] = {}  # family(kernel) -> the texts of its first members
        done: set[str] = set()
        rendered: dict[tuple, tuple[str, size_args.SizeArgs | None]] = {}  # schedule.structure -> (text, sizes)
        for kernel in kernels:
            shape = structure(kernel)
            if shape in rendered:  # the same kernel as an earlier one but for its buffers' names
                text, sizes = rendered[shape]
                if sizes is not None:
                    size_args.choose(kernel, sizes)
            elif kernel.over_symbols:  # its sizes are arguments, whatever its family
                sizes = size_args.parameterized(prepared(kernel)) if not size_generic(kernel) else None
                if sizes is None and not size_generic(kernel) or needs_int64(kernel):
                    raise NotImplementedError(f"{kernel.name}: symbolic sizes it cannot take as 32-bit arguments")
                if sizes is not None:
                    size_args.choose(kernel, sizes)
                text = self.function_text(kernel, sizes)
                rendered[shape] = text, sizes
            else:
                text, sizes = self.function_text(kernel), None
                if config.size_generic_kernels and not size_generic(kernel) and not needs_int64(kernel):
                    members = families.setdefault(family(kernel), set())
                    if len(members) < literal_members or text in members:
                        members.add(text)
                    elif (sizes := size_args.parameterized(prepared(kernel))) is not None:
                        size_args.choose(kernel, sizes)
                        text = self.function_text(kernel, sizes)
                rendered[shape] = text, sizes
            name = f"k_{content_hash(text)[:20]}"
            if name in done:
                yield kernel, name, None
                continue
            done.add(name)
            header = ["import triton", "import triton.language as tl", ""] + ([HELPERS] if "_tw_" in text else [])
            yield kernel, name, "\n".join([*header, text.replace("def KERNEL(", f"def {name}(", 1)])

    def function_text(self, kernel: Kernel, sizes: size_args.SizeArgs | None = None) -> str:
        # named KERNEL in the text that is hashed: the same code under another kernel's name is one function
        return self.render(kernel, sizes).replace(f"def {kernel.name}(", "def KERNEL(", 1)


# =============================================================================
# Autotuning hooks (max-autotune): a few launch configurations per kernel
# =============================================================================


def launch_candidates(kernel: Kernel) -> list[dict]:
    """XBLOCK/RBLOCK/num_warps choices for `kernel`, the untuned default first.

    A persistent reduction keeps its RBLOCK (the source reads whole rows); a
    looped one may take any power of two, since its source loops over RBLOCK."""
    xblock, rblock = block_sizes(kernel)
    xcap = next_power_of_2(max(math.prod(kernel.outer), 1))
    default = {"num_warps": 4, **launch_config(kernel)}
    if not kernel.is_reduction:
        shapes = [(256, 2), (256, 4), (512, 4), (1024, 4), (1024, 8), (2048, 8)]
        found = [{"XBLOCK": x, "RBLOCK": 1, "num_warps": w} for x, w in shapes if x <= max(xcap, 256)]
    elif reads_across_rows(kernel):
        looped = math.prod(kernel.reduced) > rblock
        shapes = [(32, 32), (64, 32), (128, 32), (32, 64), (128, 64), (64, 128)] if looped else \
            [(x, rblock) for x in (16, 32, 64, 128) if x * rblock <= 8192]
        found = [{"XBLOCK": x, "RBLOCK": r, "num_warps": 4 if x * r <= 4096 else 8}
                 for x, r in shapes if x <= max(xcap, 16)]
    else:
        looped = math.prod(kernel.reduced) > tuning.max_persistent_rblock
        rblocks = (512, 1024, 2048) if looped else (rblock,)
        found = []
        for r in rblocks:
            for x in (1, 2, 4, 8, 16, 32, 64):
                if x <= xcap and x * r <= (4096 if looped else 8192):
                    found.append({"XBLOCK": x, "RBLOCK": r, "num_warps": 2 if x * r <= 512 else 4 if x * r <= 4096 else 8})
        found = found[::max(1, len(found) // 6)]  # a spread of at most ~7
    return [default] + [c for c in found if c != default]


def tune_launch(kernel: Kernel, fn, fn_name: str, arg_names: list[str], layouts: dict, source_path: str,
                options: dict) -> dict:
    """The fastest of launch_candidates(kernel), timed on buffers of the real shapes;
    the choice is kept in `<source_path>.tune.json` beside the kernel source."""
    from torchweld.runtime.autotune import Autotuner, device_name, synthetic_tensor

    args = [synthetic_tensor(*layouts[name]) for name in arg_names]
    xnumel = max(math.prod(kernel.outer), 1)

    def run(config: dict) -> None:
        fn[(-(-xnumel // config["XBLOCK"]),)](*args, *runtime_ints(kernel), **config)

    tuner = options.get("autotuner") or Autotuner(options.get("autotune_timer"))
    return tuner.choose(source_path + ".tune.json", f"{device_name(kernel.device)}/{fn_name}",
                        launch_candidates(kernel), run)
