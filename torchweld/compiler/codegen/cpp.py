"""Render one scheduled kernel as a C++ function: OpenMP over the outer loops,
`omp simd` on the innermost loop so g++ vectorizes it.

A reduction whose loads are contiguous along the last outer dim rather than the
last reduced one (a column sum: bias and LayerNorm-weight gradients) is rendered
as an *outer reduction*: the last outer loop is cut into blocks of tuning.outer_block,
each accumulator becomes an array over the block, and the `omp simd` loop runs
over the block inside the reduced loops, so loads are unit-stride vectors instead
of one strided scalar per step.

A pointwise kernel whose innermost loop crosses the pieces of a concatenation or a
pad is rendered as one loop per piece (`index_ranges`): within a piece each
comparison and clamp of the loop variable is decided, so the loop is a plain,
vectorized copy or computation rather than clamped gathers and selects."""
from __future__ import annotations

import math

import torch

from torchweld.compiler.codegen import size_args
from torchweld.compiler.symbols import is_symbol_size, size_key
from torchweld.compiler.codegen.common import C_LIKE_OPS, KernelRenderer, Scope
from torchweld.compiler.codegen.cpp_reduction import reduced_loops
from torchweld.compiler import index_ranges, ir
from torchweld.compiler.ir import Op
from torchweld.compiler.schedule import Kernel, Stage, Store
from torchweld.tuning import tuning

HALF_TYPES = (torch.float16, torch.bfloat16)

# Helpers every generated file starts with: math on GCC's builtins, NaN-propagating
# max/min, Python-style integer division, and half/bfloat16 storage converted to float
# registers. No <cmath> or <algorithm>: parsing them took 80 and 45 ms of each g++ run
# (a whole CNN's kernels: 200 ms), in every cold compile.
PRELUDE = r"""
#include <cstdint>
#include <type_traits>
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#ifndef NAN
#define NAN __builtin_nanf("")
#endif
namespace tw {
// float and double as <cmath> overloads them; an integer argument is taken as a double
#define TW_MATH1(name) \
  static inline float name(float x) { return __builtin_##name##f(x); } \
  static inline double name(double x) { return __builtin_##name(x); } \
  template <typename T> static inline double name(T x) { return __builtin_##name((double)x); }
#define TW_MATH2(name) \
  static inline float name(float x, float y) { return __builtin_##name##f(x, y); } \
  static inline double name(double x, double y) { return __builtin_##name(x, y); }
TW_MATH1(exp) TW_MATH1(expm1) TW_MATH1(log) TW_MATH1(log1p) TW_MATH1(log2) TW_MATH1(sin) TW_MATH1(cos)
TW_MATH1(tan) TW_MATH1(tanh) TW_MATH1(atan) TW_MATH1(sqrt) TW_MATH1(erf) TW_MATH1(floor) TW_MATH1(ceil)
TW_MATH1(trunc) TW_MATH1(nearbyint)
TW_MATH2(pow) TW_MATH2(atan2) TW_MATH2(fmod) TW_MATH2(copysign)
static inline float fma(float x, float y, float z) { return __builtin_fmaf(x, y, z); }
static inline double fma(double x, double y, double z) { return __builtin_fma(x, y, z); }
static inline float abs(float x) { return __builtin_fabsf(x); }
static inline double abs(double x) { return __builtin_fabs(x); }
template <typename T> static inline T abs(T x) { return x < 0 ? -x : x; }
static inline bool isnan(float x) { return __builtin_isnan(x); }
static inline bool isnan(double x) { return __builtin_isnan(x); }
template <typename T> static inline bool isnan(T) { return false; }
}
#ifdef TW_MVEC
// glibc's libmvec has vector versions of these; declaring them `simd` lets g++
// vectorize loops that call them (glibc itself only does so under -ffast-math).
extern "C" {
#define TW_SIMD __attribute__((simd("notinbranch")))
TW_SIMD float sinf(float); TW_SIMD float cosf(float); TW_SIMD float tanf(float); TW_SIMD float expf(float);
TW_SIMD float expm1f(float); TW_SIMD float logf(float); TW_SIMD float log1pf(float); TW_SIMD float log2f(float);
TW_SIMD float tanhf(float); TW_SIMD float atanf(float); TW_SIMD float erff(float);
TW_SIMD float powf(float, float); TW_SIMD float atan2f(float, float);
}
#endif
template <typename T> static inline T tw_max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) { if (a != a) return a; if (b != b) return b; }
  return a > b ? a : b;
}
template <typename T> static inline T tw_min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) { if (a != a) return a; if (b != b) return b; }
  return a < b ? a : b;
}
// Python's (and aten's) a // b: of floats, from fmod as CPython's float_floor_div, so that
// 1.0 // 0.1 is 9 (floor(a / b) gave 10), -1.0 // inf is -1 and inf // x is NaN
template <typename T> static inline T tw_floordiv(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (b == 0) return a / b;
    T mod = tw::fmod(a, b);
    T div = (a - mod) / b;
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= T(1);
    if (div == 0) return tw::copysign(T(0), a / b);
    T q = tw::floor(div);
    return div - q > T(0.5) ? q + T(1) : q;
  }
  else { T q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
}
template <typename T> static inline T tw_mod(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) { T m = tw::fmod(a, b); return (m != 0 && ((m < 0) != (b < 0))) ? m + b : m; }
  else { T m = a % b; return (m != 0 && ((m < 0) != (b < 0))) ? m + b : m; }
}
template <typename T> static inline T tw_sign(T a) { return (T)((T(0) < a) - (a < T(0))); }
static inline float tw_bf16_to_float(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline uint16_t tw_float_to_bf16(float f) {
  uint32_t u; __builtin_memcpy(&u, &f, 4);
  if (f != f) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
static inline float tw_round_bf16(float f) { return tw_bf16_to_float(tw_float_to_bf16(f)); }
static inline float tw_round_half(float f) { return (float)(_Float16)f; }
// Philox4x32-10 at counter (offset, 0, 0, 0) with key (seed's low, high word), its first word
// made a float in [0, 1): the numbers Triton's tl.rand(seed, offset as uint32) gives, so a
// seed draws the same random numbers in C++ and Triton kernels.
static inline float tw_rand(int64_t seed, int64_t offset) {
  uint32_t k0 = (uint32_t)(uint64_t)seed, k1 = (uint32_t)((uint64_t)seed >> 32);
  uint32_t c0 = (uint32_t)offset, c1 = 0, c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    uint64_t a = (uint64_t)0xD2511F53u * c0, b = (uint64_t)0xCD9E8D57u * c2;
    c0 = (uint32_t)(b >> 32) ^ c1 ^ k0;
    c2 = (uint32_t)(a >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)b;
    c3 = (uint32_t)a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  int32_t x = (int32_t)c0;
  return (float)(x < 0 ? ~x : x) * 4.6566127342e-10f;
}
"""


def _float(value: float, suffix: str) -> str:
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "-INFINITY"
    return f"{value!r}{suffix}"


class CppRenderer(KernelRenderer):
    name = "CppRenderer"
    dtype_names = {
        torch.float32: "float", torch.float64: "double", torch.float16: "_Float16", torch.bfloat16: "uint16_t",
        torch.int64: "int64_t", torch.int32: "int32_t", torch.int16: "int16_t", torch.int8: "int8_t",
        torch.uint8: "uint8_t", torch.bool: "bool",
    }
    code_for_op = {
        **C_LIKE_OPS,
        Op.IDIV: lambda a, b: f"{a} / {b}",
        Op.ABS: lambda a: f"tw::abs({a})",
        Op.EXP: lambda a: f"tw::exp({a})",
        Op.EXPM1: lambda a: f"tw::expm1({a})",
        Op.LOG: lambda a: f"tw::log({a})",
        Op.LOG1P: lambda a: f"tw::log1p({a})",
        Op.LOG2: lambda a: f"tw::log2({a})",
        Op.SIN: lambda a: f"tw::sin({a})",
        Op.COS: lambda a: f"tw::cos({a})",
        Op.TAN: lambda a: f"tw::tan({a})",
        Op.TANH: lambda a: f"tw::tanh({a})",
        Op.ATAN: lambda a: f"tw::atan({a})",
        Op.SQRT: lambda a: f"tw::sqrt({a})",
        Op.RSQRT: lambda a: f"1 / tw::sqrt({a})",
        Op.SIGMOID: lambda a: f"1 / (1 + tw::exp(-{a}))",
        Op.ERF: lambda a: f"tw::erf({a})",
        Op.FLOOR: lambda a: f"tw::floor({a})",
        Op.CEIL: lambda a: f"tw::ceil({a})",
        Op.TRUNC: lambda a: f"tw::trunc({a})",
        Op.ROUND: lambda a: f"tw::nearbyint({a})",
        Op.SIGN: lambda a: f"tw_sign({a})",
        Op.ISNAN: lambda a: f"tw::isnan({a})",
        Op.LOGICAL_NOT: lambda a: f"!{a}",
        Op.FLOORDIV: lambda a, b: f"tw_floordiv({a}, {b})",
        Op.REMAINDER: lambda a, b: f"tw_mod({a}, {b})",
        Op.POW: lambda a, b: f"tw::pow({a}, {b})",
        Op.MAXIMUM: lambda a, b: f"tw_max({a}, {b})",
        Op.MINIMUM: lambda a, b: f"tw_min({a}, {b})",
        Op.ATAN2: lambda a, b: f"tw::atan2({a}, {b})",
        Op.LOGICAL_AND: lambda a, b: f"{a} && {b}",
        Op.LOGICAL_OR: lambda a, b: f"{a} || {b}",
        Op.LOGICAL_XOR: lambda a, b: f"{a} != {b}",
        Op.WHERE: lambda c, a, b: f"{c} ? {a} : {b}",
        Op.FMA: lambda a, b, c: f"tw::fma({a}, {b}, {c})",
        Op.RAND: lambda seed, offset: f"tw_rand({seed}, {offset})",
    }
    reduce_init = {Op.SUM: "0", Op.PROD: "1", Op.MAX: "-INFINITY", Op.MIN: "INFINITY"}
    reduce_ops = frozenset(reduce_init)

    # -- values ------------------------------------------------------------------
    def register_type(self, dtype: torch.dtype) -> str:
        return "float" if dtype in HALF_TYPES else self.dtype_names[dtype]

    def render_const(self, value, dtype) -> str:
        if dtype is torch.bool:
            return "true" if value else "false"
        if dtype is torch.float64:
            return _float(float(value), "")
        if dtype.is_floating_point:
            return _float(float(value), "f")
        if dtype is torch.int64:
            return "INT64_MIN" if int(value) == -(2**63) else f"INT64_C({int(value)})"  # 2**63 is no literal
        return f"(({self.dtype_names[dtype]}){int(value)})"

    def render_cast(self, x, src, dst) -> str:
        if dst is torch.bool:
            return f"({x} != 0)"
        if src is torch.bool:  # g++ vectorizes no loop with a static_cast of a bool (a mask times a tensor)
            one, zero = (self.render_const(v, torch.float32 if dst in HALF_TYPES else dst) for v in (1, 0))
            return f"({x} ? {one} : {zero})"
        if dst is torch.float16:
            return f"tw_round_half((float)({x}))"
        if dst is torch.bfloat16:
            return f"tw_round_bf16((float)({x}))"
        return f"static_cast<{self.register_type(dst)}>({x})"

    def assign(self, name, code, dtype) -> str:
        return f"{self.register_type(dtype)} {name} = {code};"

    def render_load(self, buffer, index, dtype, scope, index_expr) -> str:
        value = f"{self.pointer(buffer)}[{index}]"
        if dtype is torch.bfloat16:
            return f"tw_bf16_to_float({value})"
        if dtype is torch.float16:
            return f"(float){value}"
        return value

    def __init__(self):
        # kernel name -> its outer reduction's blocked variable (or None), decided before the
        # kernel took its sizes as arguments (render_kernels): its indices' terms are read then
        self.block_vars: dict[str, str | None] = {}

    def store(self, store, scope) -> None:
        value = self.expr(store.value, scope)
        dtype = self.buffer_dtypes[store.buffer]
        if dtype is torch.bfloat16:
            value = f"tw_float_to_bf16({value})"
        else:
            value = f"static_cast<{self.dtype_names[dtype]}>({value})"
        index = self.expr(store.index, scope)
        self.emit(scope, f"{self.pointer(store.buffer)}[{index}] = {value};")

    # -- loops -------------------------------------------------------------------
    def open_kernel(self, kernel: Kernel) -> Scope:
        """The function header and the loops; where the innermost loop is split into pieces
        (`_innermost_pieces`), all but it: render_outer_stores opens one loop per piece."""
        self.pieces = _innermost_pieces(kernel)
        split = self.pieces is not None
        taken = size_args.chosen(kernel)
        self.size_names = taken.names if taken else {}
        params = []
        for name in self.args:
            const = "" if name in kernel.writes else "const "
            params.append(f"{const}{self.dtype_names[self.buffer_dtypes[name]]}* __restrict__ {self.pointer(name)}")
        params += [f"const int64_t {name}" for name in self.size_names.values()]
        self.emit(Scope(None, 0), f'extern "C" void {kernel.name}({", ".join(params)}) {{')
        outer = [(f"x{k}", s) for k, s in enumerate(kernel.outer) if s != 1]
        numel = math.prod(kernel.outer) * max(math.prod(kernel.reduced), 1)
        if self.size_names and numel:
            numel = " * ".join(self.bound(s) for s in (*kernel.outer, *kernel.reduced) if s != 1) or "1"
        parallel = f" if({numel} > 32768)" if numel else ""
        self.block_var = self.block_vars[kernel.name] if kernel.name in self.block_vars else \
            _outer_reduction_var(kernel, outer)
        if self.block_var is not None:
            # threads share its blocks of columns, or, where there are few, its rows
            blocks = math.prod(s for _, s in outer[:-1]) * -(-outer[-1][1] // tuning.outer_block)
            self.walk = reduced_loops((blocks,), kernel.reduced, lanes=tuning.outer_block)
            return self.open_blocked_kernel(outer, "" if self.walk.threaded else parallel)
        self.walk = reduced_loops(kernel.outer, kernel.reduced)
        if split:
            outer = outer[:-1]
        self.open_loops = len(outer)
        indent = 1
        for k, (var, size) in enumerate(outer):
            pragma = None
            if split:
                if k == 0:
                    pragma = f"#pragma omp parallel for collapse({len(outer)}){parallel}"
            elif kernel.is_reduction and self.walk.threaded:
                pass  # the threads share each row (open_stage)
            elif kernel.is_reduction or len(outer) == 1:
                if k == 0:
                    simd = "" if kernel.is_reduction else " simd"
                    pragma = f"#pragma omp parallel for{simd} collapse({len(outer)}){parallel}" if len(outer) > 1 \
                        else f"#pragma omp parallel for{simd}{parallel}"
            elif k == 0:
                pragma = f"#pragma omp parallel for collapse({len(outer) - 1}){parallel}"
            elif k == len(outer) - 1:
                pragma = "#pragma omp simd"
            if pragma:
                self.emit(Scope(None, indent), pragma)
            self.emit(Scope(None, indent), f"for (int64_t {var} = 0; {var} < {self.bound(size)}; {var}++) {{")
            indent += 1
        return Scope(None, indent)

    def open_blocked_kernel(self, outer: list, parallel: str) -> Scope:
        """Outer loops of an outer reduction: the last one steps by tuning.outer_block (see the module doc)."""
        var, size = outer[-1]
        if not self.walk.threaded:
            self.emit(Scope(None, 1), f"#pragma omp parallel for collapse({len(outer)}){parallel}")
        indent = 1
        for v, s in outer[:-1]:
            self.emit(Scope(None, indent), f"for (int64_t {v} = 0; {v} < {s}; {v}++) {{")
            indent += 1
        block = tuning.outer_block
        self.emit(Scope(None, indent), f"for (int64_t {var}b = 0; {var}b < {size}; {var}b += {block}) {{")
        self.block_lanes = str(block) if size % block == 0 else \
            f"({size} - {var}b < {block} ? {size} - {var}b : INT64_C({block}))"
        self.open_loops = len(outer)
        return Scope(None, indent + 1)

    def open_lanes(self, indent: int) -> int:
        """Open the simd loop over one block's lanes, binding the blocked outer variable."""
        var = self.block_var
        self.emit(Scope(None, indent), "#pragma omp simd")
        self.emit(Scope(None, indent), f"for (int64_t {var}i = 0; {var}i < {self.block_lanes}; {var}i++) {{")
        self.emit(Scope(None, indent + 1), f"const int64_t {var} = {var}b + {var}i;")
        return indent + 1

    def render_pieces(self, scope: Scope) -> None:
        """One innermost loop per piece, each with the stores simplified for its range."""
        outer = [f"x{k}" for k, s in enumerate(self.kernel.outer) if s != 1]
        for lo, hi, stores in self.pieces:
            pragma = "#pragma omp simd" if len(outer) > 1 else f"#pragma omp parallel for simd if({hi - lo} > 32768)"
            self.emit(scope, pragma)
            self.emit(scope, f"for (int64_t {outer[-1]} = {lo}; {outer[-1]} < {hi}; {outer[-1]}++) {{")
            inner = Scope(scope, scope.indent + 1)
            for store in stores:
                self.store(store, inner)
            self.emit(scope, "}")

    def bound(self, size: int) -> str:
        """A loop's bound in the source: the size's argument where the kernel takes its sizes."""
        return self.size_names.get(size_key(size), str(size))

    def close_kernel(self, kernel: Kernel) -> None:
        for k in range(self.open_loops, -1, -1):
            self.emit(Scope(None, k), "}")

    def render_outer_stores(self, kernel: Kernel, scope: Scope) -> None:
        if self.pieces is not None:
            return self.render_pieces(scope)
        if self.block_var is None or not kernel.outer_stores:
            return super().render_outer_stores(kernel, scope)
        indent = self.open_lanes(scope.indent)
        lanes = Scope(scope, indent)
        for store in kernel.outer_stores:
            self.store(store, lanes)
        self.emit(Scope(None, indent - 1), "}")

    # -- reduction stages (the walk of the reduced loops: cpp_reduction.py) ---------------
    def varies_in_stage(self, variable: str) -> bool:
        # an outer reduction's blocked variable is set in the simd loop over lanes, inside the stage
        return variable.startswith("r") or variable == self.block_var

    @property
    def reduced_fixed_in_stage(self) -> bool:
        return self.block_var is None


    def open_stage(self, i: int, stage: Stage, outer: Scope) -> Scope:
        """The accumulators, then the reduced loops: in chunks whose float partial sums go
        into double totals, and for a threaded walk within a loop over segments of chunks."""
        if self.block_var is not None:
            return self.open_blocked_stage(stage, outer)
        walk = self.walk
        self.nan_flags: dict[str, str] = {}
        self.stage_accs = []  # (accumulation, its variable's name, whether its chunks are summed in double)
        for acc in stage.reductions:
            name = self.new_tmp("acc")
            self.stage_accs.append((acc, name, walk.chunked and _summed_in_chunks(acc)))
            if _nan_propagating(acc):
                self.nan_flags[acc.name] = self.new_tmp("nan")
        indent = outer.indent
        if walk.threaded:  # each segment's results in arrays, combined in order at close_stage
            for acc, name, wide in self.stage_accs:
                self.emit(outer, f"{self.register_type(acc.dtype)} {name};")
                self.emit(outer, f"{'double' if wide else self.accumulator_type(acc)} {name}s[{tuning.segments}];")
                if acc.name in self.nan_flags:
                    self.emit(outer, f"int {self.nan_flags[acc.name]}s[{tuning.segments}];")
            self.emit(outer, "#pragma omp parallel for schedule(static)")
            self.emit(outer, f"for (int64_t rseg = 0; rseg < {tuning.segments}; rseg++) {{")
            indent += 1
        here = Scope(None, indent)
        for acc, name, wide in self.stage_accs:
            local = f"{name}l" if walk.threaded else name if not _multiplied_in_double(acc) else f"{name}d"
            if wide:
                self.emit(here, f"double {name}w = 0;")
            else:
                self.emit(here, f"{self.accumulator_type(acc)} {local} = {self.accumulator_init(acc)};")
            self.reduced_names[acc.name] = f"{name}p" if wide else local
            if acc.name in self.nan_flags:
                self.emit(here, f"int {self.nan_flags[acc.name]} = 0;")
        indent = self.open_row_loops(indent, stage)
        return Scope(outer, indent)

    def open_row_loops(self, indent: int, stage: Stage | None) -> int:
        """The reduced loops, from the chunk loop (if the walk has chunks) in; the innermost
        gets `omp simd` with the stage's reduction clauses (none for a blocked stage, whose
        simd loop runs over lanes: stage None). Returns the indent of the loop body."""
        walk = self.walk
        loops = [(var, "0", self.bound(size)) for var, size in walk.loops]
        self.chunk_open = walk.chunked
        if walk.chunked:
            var, size = walk.loops[walk.split]
            per_pass, chunks = walk.chunks_per_pass, walk.chunks
            if is_symbol_size(size):  # counted at run time, from the size arguments
                per_pass = f"(({self.bound(size)} + {walk.chunk - 1}) / {walk.chunk})"
                chunks = " * ".join([*(self.bound(s) for _, s in walk.loops[:walk.split]), per_pass])
            lo, hi = ("0", f"{chunks}") if not walk.threaded else \
                (f"rseg * {chunks} / {tuning.segments}", f"(rseg + 1) * {chunks} / {tuning.segments}")
            self.emit(Scope(None, indent), f"for (int64_t rq = {lo}; rq < {hi}; rq++) {{")
            indent += 1
            body = Scope(None, indent)
            rest = "rq"
            first = f"{var}c" if walk.chunk > 1 else var  # a chunk of one iteration: the variable itself
            self.emit(body, f"const int64_t {first} = ({rest} % {per_pass}) * {walk.chunk};" if walk.chunk > 1
                      else f"const int64_t {first} = {rest} % {per_pass};")
            rest = f"({rest} / {per_pass})"
            for outer_var, outer_size in reversed(walk.loops[:walk.split]):
                self.emit(body, f"const int64_t {outer_var} = {rest} % {self.bound(outer_size)};")
                rest = f"({rest} / {self.bound(outer_size)})"
            for acc, name, wide in (self.stage_accs if stage is not None else self.blocked_accs):
                if wide and stage is not None:
                    self.emit(body, f"{self.register_type(acc.dtype)} {name}p = 0;")
                elif wide:
                    self.emit(body, f"{self.register_type(acc.dtype)} {name}p[{tuning.outer_block}] = {{}};")
            end = f"{var}c + {walk.chunk}" if not is_symbol_size(size) and size % walk.chunk == 0 else \
                f"({var}c + {walk.chunk} < {self.bound(size)} ? {var}c + {walk.chunk} : (int64_t)({self.bound(size)}))"
            loops = ([(var, f"{var}c", end)] if walk.chunk > 1 else []) + loops[walk.split + 1:]
        for k, (var, lo, hi) in enumerate(loops):
            if k == len(loops) - 1 and stage is not None:
                self.emit(Scope(None, indent), f"#pragma omp simd{self.simd_reductions(stage)}")
            self.emit(Scope(None, indent), f"for (int64_t {var} = {lo}; {var} < {hi}; {var}++) {{")
            indent += 1
        self.row_loops = len(loops)
        return indent

    def close_row_loops(self, indent: int) -> int:
        """Close what open_row_loops opened inside the chunk loop; returns the chunk body's indent
        (the loop that was opened at `indent`'s level when there are no chunks)."""
        for k in range(self.row_loops - 1, -1, -1):
            self.emit(Scope(None, indent + self.chunk_open + k), "}")
        return indent + self.chunk_open

    def simd_reductions(self, stage: Stage) -> str:
        """The `reduction(...)` clauses of a row stage's simd loop: one per operator, and `|`
        over the NaN flags of floating max/min (OpenMP's max drops NaN; the flag restores it)."""
        by_op: dict[str, list[str]] = {}
        for acc in stage.reductions:
            op = _simd_operator(acc)
            by_op.setdefault(op, []).append(self.reduced_names[acc.name])
        if self.nan_flags:
            by_op.setdefault("|", []).extend(self.nan_flags.values())
        return "".join(f" reduction({op}:{', '.join(names)})" for op, names in sorted(by_op.items()))

    def close_stage(self, i: int, stage: Stage, outer: Scope) -> None:
        if self.block_var is not None:
            return self.close_blocked_stage(outer)
        walk = self.walk
        indent = outer.indent + walk.threaded
        body = Scope(None, self.close_row_loops(indent))
        if walk.chunked:
            for acc, name, wide in self.stage_accs:
                if wide:
                    self.emit(body, f"{name}w += {name}p;")
            self.emit(Scope(None, indent), "}")
        if walk.threaded:
            here = Scope(None, indent)
            for acc, name, wide in self.stage_accs:
                self.emit(here, f"{name}s[rseg] = {name}w;" if wide else f"{name}s[rseg] = {name}l;")
                if acc.name in self.nan_flags:
                    flag = self.nan_flags[acc.name]
                    self.emit(here, f"{flag}s[rseg] = {flag};")
            self.emit(outer, "}")
            self.combine_segments(outer)
        for acc, name, wide in self.stage_accs:
            if wide and not walk.threaded:
                self.emit(outer, f"{self.register_type(acc.dtype)} {name} = static_cast<{self.register_type(acc.dtype)}>({name}w);")
            elif _multiplied_in_double(acc) and not walk.threaded:
                self.emit(outer, f"{self.register_type(acc.dtype)} {name} = static_cast<{self.register_type(acc.dtype)}>({name}d);")
            self.reduced_names[acc.name] = name
            if acc.name in self.nan_flags:
                self.emit(outer, f"if ({self.nan_flags[acc.name]}) {name} = NAN;")

    def combine_segments(self, outer: Scope) -> None:
        """Each accumulation's result from its segments' results, in segment order."""
        loop = f"for (int64_t rseg = 0; rseg < {tuning.segments}; rseg++)"
        for acc, name, wide in self.stage_accs:
            if wide:
                self.emit(outer, f"double {name}w = 0;")
                self.emit(outer, f"{loop} {name}w += {name}s[rseg];")
                self.emit(outer, f"{name} = static_cast<{self.register_type(acc.dtype)}>({name}w);")
            else:
                combined = f"{name}c"
                self.emit(outer, f"{self.accumulator_type(acc)} {combined} = {self.accumulator_init(acc)};")
                self.emit(outer, f"{loop} {combined} = {_combined(acc, combined, f'{name}s[rseg]')};")
                self.emit(outer, f"{name} = {combined};")
            if acc.name in self.nan_flags:
                flag = self.nan_flags[acc.name]
                self.emit(outer, f"int {flag} = 0;")
                self.emit(outer, f"{loop} {flag} |= {flag}s[rseg];")

    def open_blocked_stage(self, stage: Stage, outer: Scope) -> Scope:
        """Accumulator arrays over the block, the reduced loops, then the simd loop over lanes;
        for a threaded walk, each segment's arrays (combined in order at close_blocked_stage)."""
        lane, walk = f"{self.block_var}i", self.walk
        lanes = f"for (int64_t {lane} = 0; {lane} < {tuning.outer_block}; {lane}++)"
        self.blocked_accs = []
        indent = outer.indent
        for acc in stage.reductions:
            name = self.new_tmp("acc")
            wide = walk.chunked and _summed_in_chunks(acc)
            self.blocked_accs.append((acc, name, wide))
            self.emit(outer, f"{self.register_type(acc.dtype)} {name}[{tuning.outer_block}];")
            if walk.threaded:
                self.emit(outer, f"{'double' if wide else self.register_type(acc.dtype)} "
                                 f"{name}s[{tuning.segments}][{tuning.outer_block}];")
        if walk.threaded:
            self.emit(outer, "#pragma omp parallel for schedule(static)")
            self.emit(outer, f"for (int64_t rseg = 0; rseg < {tuning.segments}; rseg++) {{")
            indent += 1
        here = Scope(None, indent)
        for acc, name, wide in self.blocked_accs:
            local = f"{name}l" if walk.threaded else name
            if wide:
                self.emit(here, f"double {name}w[{tuning.outer_block}] = {{}};")
                self.reduced_names[acc.name] = f"{name}p[{lane}]"
            else:
                if walk.threaded:
                    self.emit(here, f"{self.register_type(acc.dtype)} {local}[{tuning.outer_block}];")
                self.emit(here, f"{lanes} {local}[{lane}] = {self.accumulator_init(acc)};")
                self.reduced_names[acc.name] = f"{local}[{lane}]"
        indent = self.open_lanes(self.open_row_loops(indent, None))
        return Scope(outer, indent)

    def close_blocked_stage(self, outer: Scope) -> None:
        lane, walk = f"{self.block_var}i", self.walk
        lanes = f"for (int64_t {lane} = 0; {lane} < {tuning.outer_block}; {lane}++)"
        indent = outer.indent + walk.threaded
        self.emit(Scope(None, indent + self.chunk_open + self.row_loops), "}")  # the lanes
        body = Scope(None, self.close_row_loops(indent))
        if self.chunk_open:
            for acc, name, wide in self.blocked_accs:
                if wide:
                    self.emit(body, f"{lanes} {name}w[{lane}] += {name}p[{lane}];")
            self.emit(Scope(None, indent), "}")
        if walk.threaded:
            here = Scope(None, indent)
            for acc, name, wide in self.blocked_accs:
                self.emit(here, f"{lanes} {name}s[rseg][{lane}] = {name}w[{lane}];" if wide
                          else f"{lanes} {name}s[rseg][{lane}] = {name}l[{lane}];")
            self.emit(outer, "}")
            for acc, name, wide in self.blocked_accs:
                total = f"{name}c"
                self.emit(outer, f"{lanes} {{")
                self.emit(Scope(None, outer.indent + 1), f"{'double' if wide else self.register_type(acc.dtype)} "
                                                          f"{total} = {0 if wide else self.accumulator_init(acc)};")
                part = f"{name}s[rseg][{lane}]"
                self.emit(Scope(None, outer.indent + 1), f"for (int64_t rseg = 0; rseg < {tuning.segments}; rseg++) "
                                                          f"{total} = {f'{total} + {part}' if wide else _combined(acc, total, part)};")
                self.emit(Scope(None, outer.indent + 1), f"{name}[{lane}] = static_cast<{self.register_type(acc.dtype)}>({total});")
                self.emit(outer, "}")
        for acc, name, wide in self.blocked_accs:
            if wide and not walk.threaded:
                self.emit(outer, f"{lanes} {name}[{lane}] = static_cast<{self.register_type(acc.dtype)}>({name}w[{lane}]);")
            self.reduced_names[acc.name] = f"{name}[{lane}]"

    def accumulator_type(self, acc) -> str:
        """A row stage's accumulator: floating products in double (cpp_reduction.py)."""
        return "double" if _multiplied_in_double(acc) else self.register_type(acc.dtype)

    def accumulator_init(self, acc) -> str:
        if acc.dtype is torch.bool:
            return "false" if acc.reduce_op in (Op.MAX, Op.SUM) else "true"
        if acc.reduce_op in (Op.MAX, Op.MIN) and not acc.dtype.is_floating_point:
            info = torch.iinfo(acc.dtype)
            return self.render_const(info.max if acc.reduce_op is Op.MIN else info.min, acc.dtype)
        return self.reduce_init[acc.reduce_op]

    def accumulate(self, acc, value, scope) -> None:
        name = self.reduced_names[acc.name]
        if self.block_var is None and acc.reduce_op in (Op.MAX, Op.MIN) and acc.dtype is not torch.bool:
            # the select g++ vectorizes under reduction(max/min), plus the NaN flag
            tmp = self.new_tmp()
            self.emit(scope, self.assign(tmp, value, acc.dtype))
            cmp = ">" if acc.reduce_op is Op.MAX else "<"
            self.emit(scope, f"{name} = {tmp} {cmp} {name} ? {tmp} : {name};")
            if acc.name in self.nan_flags:
                self.emit(scope, f"{self.nan_flags[acc.name]} |= {tmp} != {tmp};")
            return
        combine = {
            Op.SUM: f"{name} + {value}" if acc.dtype is not torch.bool else f"{name} || {value}",
            Op.PROD: f"{name} * {value}" if acc.dtype is not torch.bool else f"{name} && {value}",
            Op.MAX: f"tw_max({name}, {value})" if acc.dtype is not torch.bool else f"{name} || {value}",
            Op.MIN: f"tw_min({name}, {value})" if acc.dtype is not torch.bool else f"{name} && {value}",
        }[acc.reduce_op]
        self.emit(scope, f"{name} = {combine};")

    def render_kernels(self, kernels: list[Kernel], buffer_dtypes: dict, sizes_as_arguments: bool = False) -> str:
        """One C++ file with every kernel of a graph. With `sizes_as_arguments` (a graph weld
        compiles once per size: backends/weld_sizes.py), a kernel takes its loops' bounds and its
        index arithmetic's integers as arguments where it may (`_may_take_sizes`;
        `size_args.chosen(kernel)` says which, in order), so that the file of another size of
        the graph is the same text, whose library the disk cache has already built."""
        self.buffer_dtypes = buffer_dtypes
        parts = [PRELUDE]
        for kernel in kernels:
            if not _may_take_sizes(kernel) and any(map(is_symbol_size, (*kernel.outer, *kernel.reduced))):
                raise NotImplementedError(f"{kernel.name}: a C++ kernel that keeps its sizes in its source, "
                                          "over symbolic sizes")
            taking = size_args.with_loop_sizes(kernel) if sizes_as_arguments and _may_take_sizes(kernel) else None
            if taking is not None:
                size_args.choose(kernel, taking)
                self.block_vars[kernel.name] = _outer_reduction_var(
                    kernel, [(f"x{k}", s) for k, s in enumerate(kernel.outer) if s != 1])
            parts.append(self.render(taking.kernel if taking is not None else kernel))
        return "\n".join(parts)


def _simd_operator(acc) -> str:
    """The OpenMP reduction operator that combines `acc`'s partial results."""
    if acc.dtype is torch.bool:
        return "||" if acc.reduce_op in (Op.SUM, Op.MAX) else "&&"
    return {Op.SUM: "+", Op.PROD: "*", Op.MAX: "max", Op.MIN: "min"}[acc.reduce_op]


def _summed_in_chunks(acc) -> bool:
    """A floating sum: its chunks' partial sums go into a double total (cpp_reduction.py)."""
    return acc.reduce_op is Op.SUM and acc.dtype.is_floating_point


def _multiplied_in_double(acc) -> bool:
    """A floating product: each factor near 1 rounds the float product the same way (a
    product of 300000 factors 1 + 1e-6 x was 0.2% off in float, eager's too): it runs in double."""
    return acc.reduce_op is Op.PROD and acc.dtype.is_floating_point


def _combined(acc, a: str, b: str) -> str:
    """`acc`'s operator on two partial results (NaN-propagating for a floating max/min)."""
    if acc.dtype is torch.bool:
        return f"{a} || {b}" if acc.reduce_op in (Op.SUM, Op.MAX) else f"{a} && {b}"
    return {Op.SUM: f"{a} + {b}", Op.PROD: f"{a} * {b}", Op.MAX: f"tw_max({a}, {b})",
            Op.MIN: f"tw_min({a}, {b})"}[acc.reduce_op]


def _nan_propagating(acc) -> bool:
    """A floating max/min: torch returns NaN for a row holding one."""
    return acc.reduce_op in (Op.MAX, Op.MIN) and acc.dtype.is_floating_point


def _may_take_sizes(kernel: Kernel) -> bool:
    """Whether `kernel` may take its loops' bounds and its index arithmetic's integers as
    arguments: not where its code is made from the constants of its indices (the pieces of a
    concatenation, an outer reduction's choice). A reduction walked in chunks keeps the
    chunks' counts in its source: such a kernel is shared by the sizes whose reduced loops
    are the same (a layer norm over a fixed width), and no others."""
    if _innermost_pieces(kernel) is not None:
        return False
    outer = [(f"x{k}", s) for k, s in enumerate(kernel.outer) if s != 1]
    # over symbols, an outer reduction (its columns static) takes them, its choice made before
    return kernel.over_symbols or _outer_reduction_var(kernel, outer) is None


def _innermost_pieces(kernel: Kernel) -> list[tuple[int, int, list[Store]]] | None:
    """[(start, stop, the stores simplified for the innermost variable in start..stop-1)]
    for a pointwise kernel whose innermost loop crosses pieces of a cat or a pad; else None."""
    if kernel.is_reduction or kernel.stages or kernel.over_symbols:  # (over symbols: one clamped loop)
        return None
    outer = [(f"x{k}", s) for k, s in enumerate(kernel.outer) if s != 1]
    if not outer:
        return None
    var, size = outer[-1]
    stores = kernel.outer_stores
    points = index_ranges.breakpoints([e for st in stores for e in (st.index, st.value)], var, size)
    if not points or len(points) >= tuning.max_pieces:
        return None
    bounds = {v: (0, s - 1) for v, s in outer}
    pieces = []
    for lo, hi in zip([0] + points, points + [size]):
        bounds[var] = (lo, hi - 1)
        pieces.append((lo, hi, [Store(st.buffer, index_ranges.simplify(st.index, bounds),
                                      index_ranges.simplify(st.value, bounds)) for st in stores]))
    return pieces


def _outer_reduction_var(kernel: Kernel, outer: list) -> str | None:
    """The last outer variable, when vectorizing along it leaves fewer of the kernel's
    distinct loads and stores strided (gathered) than along the last reduced variable: a
    column reduction, its rows read across. A load that does not move along a variable
    (a row's mean, a column's weight) is a broadcast there, no gather."""
    reduced = [f"r{k}" for k, s in enumerate(kernel.reduced) if s != 1]
    if not reduced or not outer or any(is_symbol_size(s) for _, s in outer):  # (symbolic columns: walked one by one)
        return None
    x, r = outer[-1][0], reduced[-1]
    accesses = {}
    for stage in kernel.stages:
        values = [acc.value for acc in stage.reductions] + [st.value for st in stage.stores]
        for load in (n for value in values for n in ir.loads(value)):
            accesses[(load.arg, load.args[0].key())] = load.args[0]
        for st in stage.stores:
            accesses[(st.buffer, st.index.key())] = st.index
    terms = [t for t in (ir.affine_terms(index) for index in accesses.values()) if t is not None]

    def gathered(var: str) -> int:
        return sum(coefs.get(var, 0) not in (0, 1) for coefs, _ in terms)

    return x if gathered(x) < gathered(r) else None
