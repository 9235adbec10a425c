/* The C guard evaluator: one cache entry's guards, run over the frame's arguments
 * without executing Python bytecode.
 *
 * guard_program.py lays the guards out as two tables:
 *
 *   nodes   one per value read from the frame: an argument, a constant (the frame's
 *           globals dict, builtins, sys.modules, its closure), or an attribute / item /
 *           nn.Module entry / method call on another node's value; a node names its
 *           parent by index, so the nodes form a tree rooted at arguments and constants.
 *   checks  one per guard, in the guards' order: a test of one node's value
 *           (identity, type, tensor metadata, ...), the relations between symbolic
 *           sizes (a small int64 program, see SizeProgram), or a compiled Python
 *           predicate over the arguments for anything the tables cannot express.
 *
 * A call runs the checks in order, as the generated `and` chain does, and reads each
 * node the first time a check needs it, into a slot that later checks reuse (a read
 * that finds nothing leaves the `absent` marker there). The first failing check makes
 * the call return False; so does an exception that is an Exception (the entry is a
 * miss, as the Python expression's try/except makes it); any other exception
 * (KeyboardInterrupt) propagates.
 *
 * Values are read as their Python spelling reads them, with five shortcuts that give
 * the same values:
 *  - attributes of objects whose type reads them as nn.Module does (object's
 *    __getattribute__, then torch.nn.Module.__getattr__ itself) are found without
 *    calling that Python function: module_store_lookup does what it does;
 *  - `hasattr(x, 'a')` reads node `x.a`, so a later guard on `x.a` does not read it again;
 *  - `x.forward.__func__` is the function on x's type where that is what binding would
 *    wrap (see unbound_function), without making the bound method;
 *  - an attribute that Python code reads (a class with its own __getattribute__, such
 *    as a transformers config) is read once per object and name per call, however many
 *    paths reach that object (`model.config`, `model.h[3].attn.config`). The Python
 *    expression already reads each path once per call; both rely on reads having no
 *    side effects;
 *  - a tensor's `.dim()` and `.size(d)` (symbolic sizes) are read from its `.shape`, once
 *    per call, where its type is exactly the one captured (torch.Tensor).
 *
 * Plain C API, no torch headers: torch objects are read through their Python
 * attributes and methods.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* -- interned names --------------------------------------------------------- */

static PyObject *s_dtype, *s_device, *s_shape, *s_stride, *s_requires_grad, *s_get_device, *s_next_id;
static PyObject *s_getattr, *s_getattribute, *s_dict, *s_parameters, *s_buffers, *s_modules, *s_func;
static PyObject *object_getattribute; /* object.__getattribute__, the slot wrapper */
static PyObject *absent;              /* a slot's value where its read found nothing */

static int init_statics(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return -1;
    INTERN(s_dtype, "dtype") INTERN(s_device, "device") INTERN(s_shape, "shape")
    INTERN(s_stride, "stride") INTERN(s_requires_grad, "requires_grad") INTERN(s_get_device, "get_device") INTERN(s_next_id, "next_id")
    INTERN(s_getattr, "__getattr__") INTERN(s_getattribute, "__getattribute__")
    INTERN(s_dict, "__dict__") INTERN(s_parameters, "_parameters")
    INTERN(s_buffers, "_buffers") INTERN(s_modules, "_modules") INTERN(s_func, "__func__")
#undef INTERN
    object_getattribute = _PyType_Lookup(&PyBaseObject_Type, s_getattribute);
    absent = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    return object_getattribute && absent ? 0 : -1;
}

/* -- the tables ------------------------------------------------------------- */

enum NodeKind { NODE_ARG, NODE_CONST, NODE_ATTR, NODE_ITEM, NODE_MODULE_ENTRY, NODE_CALL, NODE_PYTHON };
static const char *NODE_NAMES[] = {"arg", "const", "attr", "item", "module_entry", "call", "python", NULL};

enum CheckKind {
    CHECK_ID, CHECK_TYPE, CHECK_IS, CHECK_EQUALS, CHECK_LEN, CHECK_DICT_KEYS,
    CHECK_SAME, CHECK_HASATTR, CHECK_TENSOR, CHECK_CALL_IS, CHECK_PYTHON, CHECK_INSTANCE_DICT, CHECK_LACKS,
    CHECK_HELD_TENSOR, CHECK_FENCE, CHECK_SYMBOLIC_TENSOR, CHECK_SIZES
};
static const char *CHECK_NAMES[] = {
    "id", "type", "is", "equals", "len", "dict_keys", "same", "hasattr", "tensor", "call_is", "python",
    "instance_dict", "lacks", "held_tensor", "fence", "symbolic_tensor", "sizes", NULL
};

/* How a type reads attributes (see read_strategy). */
enum ReadStrategy { READS_IN_C, READS_LIKE_MODULE, READS_IN_PYTHON };

/* Borrowed pointers: the evaluator's `specs` owns every object they point at. */
typedef struct {
    int kind;
    int parent;          /* the node whose value this one reads from; -1: none */
    int second;          /* NODE_CALL: the node passed as first argument; else -1 */
    int same_name_prev;  /* NODE_ATTR: the previous ATTR node reading the same name; -1: none */
    int of_method;       /* NODE_ATTR: reads `__func__` of an ATTR node's value (a method, usually) */
    Py_ssize_t position; /* NODE_ARG: the argument's position */
    PyObject *a;         /* CONST: the object; ATTR: the name; ITEM: the key; MODULE_ENTRY: the store;
                            CALL: extra constant arguments (tuple); PYTHON: the function */
    PyObject *b;         /* MODULE_ENTRY: the entry's name */
    /* ATTR, MODULE_ENTRY: the read strategy of the type last read from, valid while that
       type keeps its version tag (the type is compared, never dereferenced) */
    PyTypeObject *seen_type;
    unsigned int seen_version;
    int seen_strategy;
} Node;

/* CHECK_SIZES: the relations between an entry's symbolic sizes (guards.py's `sizes`) as an
 * int64 program. Its reads fill one value slot each: a size, a stride or the number of dims
 * of a tensor node's value, or an int node's value itself (sizes come from the node of the
 * tensor's `shape`, which its CHECK_SYMBOLIC_TENSOR read already). Its code, postfix over a
 * stack of int64, pushes slots and constants, computes as Python computes on ints (floored
 * // and %) and `require`s each relation in turn; a relation guard_program.py cannot spell
 * is a Python function of the slots it names (`call`). Where the program cannot decide
 * exactly (a value not an int, or one beyond int64, an overflow, a zero divisor, a negative
 * power), the guard's own Python expression decides that call. */
enum ReadKind { READ_VALUE, READ_SIZE, READ_STRIDE, READ_DIMS };
static const char *READ_NAMES[] = {"value", "size", "stride", "dims", NULL};

enum SizeOp {
    OP_SLOT, OP_CONST, OP_CALL, OP_REQUIRE, OP_NEG, OP_ABS, OP_NOT,  /* then the binary ops */
    OP_ADD, OP_SUB, OP_MUL, OP_FLOORDIV, OP_MOD, OP_POW, OP_MAX, OP_MIN,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_AND, OP_OR
};
static const char *OP_NAMES[] = {
    "slot", "const", "call", "require", "neg", "abs", "not",
    "add", "sub", "mul", "floordiv", "mod", "pow", "max", "min",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", NULL
};

typedef struct {
    int node;         /* the node read */
    int shape;        /* READ_SIZE, READ_DIMS: the node of `node`'s shape */
    int what;         /* enum ReadKind */
    Py_ssize_t index; /* READ_SIZE, READ_STRIDE: the dim */
    PyObject *type;   /* the type the node's value must have exactly; another leaves it to Python */
} SizeRead;

typedef struct {
    Py_ssize_t n_reads, n_code, depth; /* depth: the most values the stack holds */
    SizeRead *reads;                   /* the slots' reads, in slot order */
    int64_t *code;                     /* ops, each followed by its operands: SLOT (slot), CONST (value),
                                          CALL (function index, argument count) */
} SizeProgram;

typedef struct {
    int kind;
    int node;        /* the node whose value is tested (HASATTR: the attribute's node); -1 for CALL_IS, PYTHON, SIZES */
    int second;      /* CHECK_SAME: the other node; CHECK_SYMBOLIC_TENSOR: the node of the tensor's shape */
    void *ident;     /* CHECK_ID: the expected id */
    Py_ssize_t n;    /* CHECK_LEN: the expected length */
    int present;     /* CHECK_HASATTR */
    PyObject *op[6]; /* the check's operands, in the order guards.py gives them */
    SizeProgram *sizes; /* CHECK_SIZES */
} Check;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t n_args;
    Py_ssize_t n_nodes, n_checks;
    Node *nodes;
    Check *checks;
    PyObject **slots;         /* node values of the running call; reentrant calls allocate their own */
    int busy;                 /* `slots` is in use by a call on the stack */
    PyObject *specs;          /* (nodes, checks) as given: owns what Node and Check point at */
    PyObject *module_getattr; /* torch.nn.Module.__getattr__, whose lookup module_store_lookup mirrors */
} Evaluator;

/* -- reading attributes ----------------------------------------------------- */

/* `getattr(obj, name)` as a status: 1 found (*result set), 0 no such attribute (no
 * exception set: an AttributeError was swallowed), -1 another error. */
static int optional_attr(PyObject *obj, PyObject *name, PyObject **result) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, result);
#else
    return _PyObject_LookupAttr(obj, name, result);
#endif
}

/* `mapping[key]` as a status: 1 found (*result a new reference), 0 missing, -1 error;
 * an exact dict without making a KeyError. */
static int lookup_key(PyObject *mapping, PyObject *key, PyObject **result) {
    if (PyDict_CheckExact(mapping)) {
        *result = Py_XNewRef(PyDict_GetItemWithError(mapping, key));
        return *result ? 1 : (PyErr_Occurred() ? -1 : 0);
    }
    int has = PySequence_Contains(mapping, key);
    if (has <= 0) return has;
    *result = PyObject_GetItem(mapping, key);
    return *result ? 1 : -1;
}

/* What torch.nn.Module.__getattr__(obj, name) does: self.__dict__'s `_parameters`,
 * `_buffers`, `_modules`, in that order; 0 (absent) where it raises AttributeError. */
static int module_store_lookup(PyObject *obj, PyObject *name, PyObject **result) {
    PyObject *stores[3] = {s_parameters, s_buffers, s_modules};
    PyObject *dict = PyObject_GenericGetAttr(obj, s_dict);
    if (dict == NULL) return -1;
    *result = NULL;
    int status = 0;
    for (int i = 0; i < 3 && status == 0; i++) {
        PyObject *store;
        status = lookup_key(dict, stores[i], &store);
        if (status <= 0) continue;
        status = lookup_key(store, name, result);
        Py_DECREF(store);
    }
    Py_DECREF(dict);
    return status;
}

/* `getattr(obj, name)` for a type that READS_LIKE_MODULE, as slot_tp_getattr_hook runs
 * it (object.__getattribute__, then on AttributeError Module.__getattr__), without
 * calling Module.__getattr__ nor making an AttributeError on the way. */
static int module_attr(PyObject *obj, PyObject *name, PyObject **result) {
    *result = _PyObject_GenericGetAttrWithDict(obj, name, NULL, 1);
    if (*result != NULL) return 1;
    if (PyErr_Occurred()) return -1;
    return module_store_lookup(obj, name, result);
}

/* READS_LIKE_MODULE: object.__getattribute__ and torch.nn.Module.__getattr__ itself;
 * READS_IN_PYTHON: a __getattribute__ or __getattr__ written in Python; else READS_IN_C.
 * Looked up on the type, remembered per node while the type's version tag holds (any
 * change to the type or its bases gives it a new tag). */
static int read_strategy(Evaluator *ev, Node *n, PyTypeObject *type) {
    if (type->tp_getattro == PyObject_GenericGetAttr) return READS_IN_C;
    if (type == n->seen_type && type->tp_version_tag != 0 && type->tp_version_tag == n->seen_version)
        return n->seen_strategy;
    PyObject *getattr = _PyType_Lookup(type, s_getattr);
    PyObject *getattribute = _PyType_Lookup(type, s_getattribute);
    int strategy = READS_IN_C;
    if (ev->module_getattr != NULL && getattr == ev->module_getattr && getattribute == object_getattribute)
        strategy = READS_LIKE_MODULE;
    else if ((getattr != NULL && PyFunction_Check(getattr)) || (getattribute != NULL && PyFunction_Check(getattribute)))
        strategy = READS_IN_PYTHON;
    n->seen_type = type;
    n->seen_version = type->tp_version_tag;
    n->seen_strategy = strategy;
    return strategy;
}

/* `getattr(obj, name)` as a status (see optional_attr), read as node `n` reads. */
static int lookup_attr(Evaluator *ev, Node *n, PyObject *obj, PyObject *name, PyObject **result) {
    if (read_strategy(ev, n, Py_TYPE(obj)) == READS_LIKE_MODULE) return module_attr(obj, name, result);
    return optional_attr(obj, name, result);
}

/* -- reading node values ---------------------------------------------------- */

/* A new reference to the value, `absent` for status 0, NULL for an error. */
static PyObject *value_or_absent(int status, PyObject *value) {
    if (status == 0) return Py_NewRef(absent);
    return status > 0 ? value : NULL;
}

/* What an earlier ATTR node of this call read as the same name from this very object
 * (value or `absent`), or NULL. */
static PyObject *earlier_read(Evaluator *ev, PyObject **slots, Node *n, PyObject *base) {
    for (int j = n->same_name_prev; j >= 0; j = ev->nodes[j].same_name_prev)
        if (slots[j] != NULL && slots[ev->nodes[j].parent] == base) return slots[j];
    return NULL;
}

static PyObject *read_attr(Evaluator *ev, PyObject **slots, Node *n, PyObject *base) {
    PyObject *value;
    if (read_strategy(ev, n, Py_TYPE(base)) == READS_IN_PYTHON && (value = earlier_read(ev, slots, n, base)) != NULL)
        return Py_NewRef(value);
    int status = lookup_attr(ev, n, base, n->a, &value);
    return value_or_absent(status, value);
}

/* `obj[key]`; `absent` where an exact dict lacks the key (no KeyError made). */
static PyObject *read_item(PyObject *obj, PyObject *key) {
    if (PyDict_CheckExact(obj)) {
        PyObject *value = PyDict_GetItemWithError(obj, key);
        if (value == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(absent);
        return Py_NewRef(value);
    }
    return PyObject_GetItem(obj, key);
}

/* base.<store>[name] */
static PyObject *read_module_entry(Evaluator *ev, Node *n, PyObject *base) {
    PyObject *store;
    int status = lookup_attr(ev, n, base, n->a, &store);
    if (status <= 0) return value_or_absent(status, NULL);
    PyObject *value = read_item(store, n->b);
    Py_DECREF(store);
    return value;
}

static PyObject *node_value(Evaluator *ev, PyObject **slots, PyObject *const *args, int index);

/* base(first, *extra) */
static PyObject *read_call(Evaluator *ev, PyObject **slots, PyObject *const *args, Node *n, PyObject *base) {
    PyObject *first = node_value(ev, slots, args, n->second);
    if (first == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(absent);
    PyObject *call_args[8];
    Py_ssize_t n_extra = PyTuple_GET_SIZE(n->a);
    call_args[0] = first;
    for (Py_ssize_t i = 0; i < n_extra; i++) call_args[i + 1] = PyTuple_GET_ITEM(n->a, i);
    return PyObject_Vectorcall(base, call_args, 1 + n_extra, NULL);
}

/* A new reference to node `n`'s value read from `base`: the value, `absent`, or NULL on error. */
static PyObject *read_node(Evaluator *ev, PyObject **slots, PyObject *const *args, Node *n, PyObject *base) {
    switch (n->kind) {
    case NODE_ARG: return Py_NewRef(args[n->position]);
    case NODE_CONST: return Py_NewRef(n->a);
    case NODE_ATTR: return read_attr(ev, slots, n, base);
    case NODE_ITEM: return read_item(base, n->a);
    case NODE_MODULE_ENTRY: return read_module_entry(ev, n, base);
    case NODE_CALL: return read_call(ev, slots, args, n, base);
    case NODE_PYTHON: return PyObject_Vectorcall(n->a, args, ev->n_args, NULL);
    }
    PyErr_SetString(PyExc_SystemError, "guard_eval: unknown node kind");
    return NULL;
}

/* A new reference to what `obj.<method->a>.__func__` gives, where it is the plain
 * function on obj's type that generic attribute lookup would bind: the type reads
 * attributes with object.__getattribute__ (nn.Module's __getattr__ runs only after
 * it fails), the name is a plain function on the type, and obj has no instance
 * attribute of that name. NULL (no exception set) where any of that does not hold. */
static PyObject *unbound_function(Evaluator *ev, Node *method, PyObject *obj) {
    PyTypeObject *type = Py_TYPE(obj);
    if (obj == Py_None || (type->tp_getattro != PyObject_GenericGetAttr
                           && read_strategy(ev, method, type) != READS_LIKE_MODULE)) return NULL;
    PyObject *function = _PyType_Lookup(type, method->a);
    if (function == NULL || !PyFunction_Check(function)) return NULL;
    PyObject **dict = _PyObject_GetDictPtr(obj);
    if (dict == NULL && (type->tp_dictoffset != 0 || (type->tp_flags & Py_TPFLAGS_MANAGED_DICT))) {
        PyErr_Clear(); /* it has a dict that could not be made: let the plain read decide */
        return NULL;
    }
    if (dict != NULL && *dict != NULL) {
        PyObject *own = PyDict_GetItemWithError(*dict, method->a);
        if (own != NULL || PyErr_Occurred()) {
            PyErr_Clear();
            return NULL;
        }
    }
    return Py_NewRef(function);
}

/* Node `index`'s value, borrowed from `slots` (read on first use). NULL: the read,
 * or one of its parents', found nothing (no exception set: the guard fails) or raised. */
static PyObject *node_value(Evaluator *ev, PyObject **slots, PyObject *const *args, int index) {
    if (slots[index] == NULL) {
        Node *n = &ev->nodes[index];
        if (n->of_method && slots[n->parent] == NULL) { /* the method is read only if needed */
            Node *method = &ev->nodes[n->parent];
            PyObject *obj = node_value(ev, slots, args, method->parent);
            if (obj == NULL) return NULL;
            slots[index] = unbound_function(ev, method, obj);
        }
        PyObject *base = NULL;
        if (slots[index] == NULL) {
            if (n->parent >= 0 && (base = node_value(ev, slots, args, n->parent)) == NULL) return NULL;
            if ((slots[index] = read_node(ev, slots, args, n, base)) == NULL) return NULL;
        }
    }
    return slots[index] == absent ? NULL : slots[index];
}

/* -- checks: 1 holds, 0 fails, -1 error ------------------------------------- */

static int attr_is(PyObject *obj, PyObject *name, PyObject *expected) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    int same = value == expected;
    Py_DECREF(value);
    return same;
}

/* `value == expected` for values whose __eq__ is reflexive (devices, tuples of ints). */
static int steal_equals(PyObject *value, PyObject *expected) {
    if (value == NULL) return -1;
    int equal = PyObject_RichCompareBool(value, expected, Py_EQ);
    Py_DECREF(value);
    return equal;
}

/* type(t) is C and t.dtype is D and t.device == E and t.shape == S and t.stride() == T
 * and t.requires_grad is R; stride None: not strided, not checked. */
static int check_tensor(PyObject *t, PyObject **op) {
    int ok;
    if ((PyObject *)Py_TYPE(t) != op[0]) return 0;
    if ((ok = attr_is(t, s_dtype, op[1])) != 1) return ok;
    if ((ok = steal_equals(PyObject_GetAttr(t, s_device), op[2])) != 1) return ok;
    if ((ok = steal_equals(PyObject_GetAttr(t, s_shape), op[3])) != 1) return ok;
    if (op[4] != Py_None && (ok = steal_equals(PyObject_CallMethodNoArgs(t, s_stride), op[4])) != 1) return ok;
    return attr_is(t, s_requires_grad, op[5]);
}

/* t.dtype is D and t.get_device() == I and t.requires_grad is R: what a tensor a module holds
 * (guarded by identity too) can change in place (`module.double()`, `.cuda()`, `requires_grad_`). */
static int check_held_tensor(PyObject *t, PyObject **op) {
    int ok;
    if ((ok = attr_is(t, s_dtype, op[0])) != 1) return ok;
    if ((ok = steal_equals(PyObject_CallMethodNoArgs(t, s_get_device), op[1])) != 1) return ok;
    return attr_is(t, s_requires_grad, op[2]);
}

/* type(v) is C and v == K (any __eq__: the result's truth, as `and` takes it). */
static int check_equals(PyObject *v, PyObject **op) {
    if ((PyObject *)Py_TYPE(v) != op[0]) return 0;
    PyObject *result = PyObject_RichCompare(v, op[1], Py_EQ);
    if (result == NULL) return -1;
    int truth = PyObject_IsTrue(result);
    Py_DECREF(result);
    return truth;
}

/* type(v) is dict and list(v) == keys */
static int check_dict_keys(PyObject *v, PyObject *keys) {
    if (!PyDict_CheckExact(v)) return 0;
    if (PyDict_GET_SIZE(v) != PyList_GET_SIZE(keys)) return 0;
    return steal_equals(PyDict_Keys(v), keys);
}

/* In the object's own __dict__: each name of op[0] holds an empty container, and no name of
 * op[1] is there (an nn.Module without hooks and without a forward of its own). */
static int check_instance_dict(PyObject *v, PyObject **op) {
    PyObject **slot = _PyObject_GetDictPtr(v);
    PyObject *dict = slot != NULL && *slot != NULL ? Py_NewRef(*slot) : PyObject_GenericGetAttr(v, s_dict);
    if (dict == NULL) return -1;
    int ok = PyDict_Check(dict);
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(op[0]); i++) {
        PyObject *value = PyDict_GetItemWithError(dict, PyTuple_GET_ITEM(op[0], i));
        Py_ssize_t n = value == NULL ? -1 : PyObject_Length(value);
        ok = n == 0 ? 1 : (PyErr_Occurred() ? -1 : 0);
    }
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(op[1]); i++) {
        PyObject *value = PyDict_GetItemWithError(dict, PyTuple_GET_ITEM(op[1], i));
        ok = value != NULL ? 0 : (PyErr_Occurred() ? -1 : 1);
    }
    Py_DECREF(dict);
    return ok;
}

/* hasattr(base, name) is present, where c->node reads `base.name`. */
static int check_hasattr(Evaluator *ev, PyObject **slots, PyObject *const *args, Check *c) {
    if (node_value(ev, slots, args, ev->nodes[c->node].parent) == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *value = node_value(ev, slots, args, c->node);
    if (value == NULL && PyErr_Occurred()) return -1;
    return (value != NULL) == c->present;
}

static int check_truth(PyObject *result) {
    if (result == NULL) return -1;
    int truth = PyObject_IsTrue(result);
    Py_DECREF(result);
    return truth;
}

/* type(t) is C and t.dtype is D and t.device == E and t.dim() == len(S) and t.size(d) == S[d]
 * for each S[d] that is not None (a symbolic dim: CHECK_SIZES reads it) and t.requires_grad is R;
 * the shape read as node c->second, which CHECK_SIZES reads again. */
static int check_symbolic_tensor(Evaluator *ev, PyObject **slots, PyObject *const *args, Check *c, PyObject *t) {
    PyObject **op = c->op;
    int ok;
    if ((PyObject *)Py_TYPE(t) != op[0]) return 0;
    if ((ok = attr_is(t, s_dtype, op[1])) != 1) return ok;
    if ((ok = steal_equals(PyObject_GetAttr(t, s_device), op[2])) != 1) return ok;
    PyObject *shape = node_value(ev, slots, args, c->second);
    if (shape == NULL) return PyErr_Occurred() ? -1 : 0;
    ok = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == PyTuple_GET_SIZE(op[3]);
    for (Py_ssize_t d = 0; ok == 1 && d < PyTuple_GET_SIZE(shape); d++) {
        PyObject *expected = PyTuple_GET_ITEM(op[3], d);
        if (expected != Py_None) ok = PyObject_RichCompareBool(PyTuple_GET_ITEM(shape, d), expected, Py_EQ);
    }
    return ok == 1 ? attr_is(t, s_requires_grad, op[4]) : ok;
}

#define UNDECIDED 2 /* a size program's answer where it cannot decide exactly: Python decides */

/* Fills `values` by the program's reads: 1 done, 0 a read finds no such dim (Python's
 * IndexError, or a shorter stride tuple: the guard fails), -1 error, UNDECIDED. */
static int read_sizes(Evaluator *ev, PyObject **slots, PyObject *const *args, SizeProgram *p, int64_t *values) {
    PyObject *strides = NULL; /* the last stride read's tuple, which the reads after it share (slot order) */
    int strides_node = -1, ok = 1;
    for (Py_ssize_t i = 0; i < p->n_reads && ok == 1; i++) {
        SizeRead *r = &p->reads[i];
        PyObject *v = node_value(ev, slots, args, r->node), *seq = NULL, *item = v;
        if (v == NULL) {
            ok = PyErr_Occurred() ? -1 : 0;
            break;
        }
        if ((PyObject *)Py_TYPE(v) != r->type) {
            ok = UNDECIDED;
            break;
        }
        if (r->what == READ_STRIDE) {
            if (strides_node != r->node) {
                Py_XDECREF(strides);
                strides = PyObject_CallMethodNoArgs(v, s_stride);
                strides_node = r->node;
                if (strides == NULL) {
                    ok = -1;
                    break;
                }
            }
            seq = strides;
        } else if (r->what != READ_VALUE && (seq = node_value(ev, slots, args, r->shape)) == NULL) {
            ok = PyErr_Occurred() ? -1 : 0;
            break;
        }
        if (seq != NULL) {
            if (!PyTuple_Check(seq)) {
                ok = UNDECIDED;
                break;
            }
            if (r->what == READ_DIMS) {
                values[i] = PyTuple_GET_SIZE(seq);
                continue;
            }
            if (r->index >= PyTuple_GET_SIZE(seq)) {
                ok = 0;
                break;
            }
            item = PyTuple_GET_ITEM(seq, r->index);
        }
        int overflow = 1;
        if (PyLong_CheckExact(item)) values[i] = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) ok = UNDECIDED;
    }
    Py_XDECREF(strides);
    return ok;
}

/* base ** exp for exp >= 0; -1 where it is not an int64 (overflow, a negative exp: a float) */
static int int_pow(int64_t base, int64_t exp, int64_t *result) {
    int64_t r = 1;
    if (exp < 0) return -1;
    while (exp > 0) {
        if ((exp & 1) && __builtin_mul_overflow(r, base, &r)) return -1;
        exp >>= 1;
        if (exp > 0 && __builtin_mul_overflow(base, base, &base)) return -1;
    }
    *result = r;
    return 0;
}

/* `a <op> b` as Python computes it on ints (bools are 0 and 1, `a and b` is b where a is true);
 * -1 where the result is no int64: an overflow, a zero divisor, a negative power. */
static int size_binary(int op, int64_t a, int64_t b, int64_t *r) {
    switch (op) {
    case OP_ADD: return __builtin_add_overflow(a, b, r) ? -1 : 0;
    case OP_SUB: return __builtin_sub_overflow(a, b, r) ? -1 : 0;
    case OP_MUL: return __builtin_mul_overflow(a, b, r) ? -1 : 0;
    case OP_FLOORDIV:
    case OP_MOD: {
        if (b == 0 || (a == INT64_MIN && b == -1)) return -1;
        int64_t q = a / b, m = a % b;
        if (m != 0 && (m < 0) != (b < 0)) { /* C truncates; Python floors */
            q -= 1;
            m += b;
        }
        *r = op == OP_FLOORDIV ? q : m;
        return 0;
    }
    case OP_POW: return int_pow(a, b, r);
    case OP_MAX: *r = a >= b ? a : b; return 0;
    case OP_MIN: *r = a <= b ? a : b; return 0;
    case OP_EQ: *r = a == b; return 0;
    case OP_NE: *r = a != b; return 0;
    case OP_LT: *r = a < b; return 0;
    case OP_LE: *r = a <= b; return 0;
    case OP_GT: *r = a > b; return 0;
    case OP_GE: *r = a >= b; return 0;
    case OP_AND: *r = a ? b : a; return 0;
    case OP_OR: *r = a ? a : b; return 0;
    }
    return -1;
}

/* fn(*values) for a relation left to Python: its truth, or -1 */
static int call_relation(PyObject *fn, const int64_t *values, Py_ssize_t n) {
    PyObject *argv = PyTuple_New(n);
    if (argv == NULL) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(values[i]);
        if (v == NULL) {
            Py_DECREF(argv);
            return -1;
        }
        PyTuple_SET_ITEM(argv, i, v);
    }
    PyObject *result = PyObject_Call(fn, argv, NULL);
    Py_DECREF(argv);
    return check_truth(result);
}

/* The code over the read `values` (parse_sizes checked its stack use): 1 every relation holds,
 * 0 one fails, -1 error (a Python relation raised), UNDECIDED. */
static int run_size_code(SizeProgram *p, const int64_t *values, int64_t *stack, PyObject *functions) {
    Py_ssize_t top = 0; /* stack[top - 1] is the top value */
    for (const int64_t *code = p->code, *end = p->code + p->n_code; code < end;) {
        int op = (int)*code++;
        switch (op) {
        case OP_SLOT: stack[top++] = values[*code++]; break;
        case OP_CONST: stack[top++] = *code++; break;
        case OP_REQUIRE:
            if (!stack[--top]) return 0;
            break;
        case OP_CALL: {
            top -= code[1];
            int truth = call_relation(PyTuple_GET_ITEM(functions, code[0]), stack + top, code[1]);
            code += 2;
            if (truth < 0) return -1;
            stack[top++] = truth;
            break;
        }
        case OP_NEG:
        case OP_ABS:
            if (stack[top - 1] == INT64_MIN) return UNDECIDED;
            if (op == OP_NEG || stack[top - 1] < 0) stack[top - 1] = -stack[top - 1];
            break;
        case OP_NOT: stack[top - 1] = !stack[top - 1]; break;
        default:
            top--;
            if (size_binary(op, stack[top - 1], stack[top], &stack[top - 1]) < 0) return UNDECIDED;
        }
    }
    return 1;
}

/* The relations between symbolic sizes (SizeProgram; op: reads, code, functions, the guard's
 * Python expression as a function of the frame's arguments, which decides where they cannot). */
static int check_sizes(Evaluator *ev, PyObject **slots, PyObject *const *args, Check *c) {
    SizeProgram *p = c->sizes;
    int64_t local[64], *values = local;
    Py_ssize_t need = p->n_reads + p->depth;
    if (need > 64 && (values = PyMem_Malloc(need * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int ok = read_sizes(ev, slots, args, p, values);
    if (ok == 1) ok = run_size_code(p, values, values + p->n_reads, c->op[2]);
    if (values != local) PyMem_Free(values);
    if (ok == UNDECIDED) ok = check_truth(PyObject_Vectorcall(c->op[3], args, ev->n_args, NULL));
    return ok;
}

/* `fn() is expected` */
static int check_call_is(PyObject *fn, PyObject *expected) {
    PyObject *result = PyObject_CallNoArgs(fn);
    if (result == NULL) return -1;
    int same = result == expected;
    Py_DECREF(result);
    return same;
}

/* The checks that take no node, or read their node themselves. */
static int run_check_without_node(Evaluator *ev, PyObject **slots, PyObject *const *args, Check *c) {
    switch (c->kind) {
    case CHECK_HASATTR: return check_hasattr(ev, slots, args, c);
    case CHECK_CALL_IS: return check_call_is(c->op[0], c->op[1]);
    case CHECK_PYTHON: return check_truth(PyObject_Vectorcall(c->op[0], args, ev->n_args, NULL));
    case CHECK_SIZES: return check_sizes(ev, slots, args, c);
    }
    PyErr_SetString(PyExc_SystemError, "guard_eval: unknown check kind");
    return -1;
}

static int run_check(Evaluator *ev, PyObject **slots, PyObject *const *args, Check *c) {
    if (c->kind == CHECK_HASATTR || c->node < 0) return run_check_without_node(ev, slots, args, c);
    PyObject *v = node_value(ev, slots, args, c->node);
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    switch (c->kind) {
    case CHECK_ID: return (void *)v == c->ident;
    case CHECK_TYPE: return (PyObject *)Py_TYPE(v) == c->op[0];
    case CHECK_IS: return v == c->op[0];
    case CHECK_EQUALS: return check_equals(v, c->op);
    case CHECK_LEN: {
        if ((PyObject *)Py_TYPE(v) != c->op[0]) return 0;
        Py_ssize_t n = PyObject_Length(v);
        return n < 0 ? -1 : n == c->n;
    }
    case CHECK_DICT_KEYS: return check_dict_keys(v, c->op[0]);
    case CHECK_SAME: {
        PyObject *other = node_value(ev, slots, args, c->second);
        if (other == NULL) return PyErr_Occurred() ? -1 : 0;
        return v == other;
    }
    case CHECK_TENSOR: return check_tensor(v, c->op);
    case CHECK_INSTANCE_DICT: return check_instance_dict(v, c->op);
    case CHECK_HELD_TENSOR: return check_held_tensor(v, c->op);
    case CHECK_SYMBOLIC_TENSOR: return check_symbolic_tensor(ev, slots, args, c, v);
    case CHECK_LACKS: { /* key not in v (a globals dict, which a builtin's name must not shadow) */
        int has = PySequence_Contains(v, c->op[0]);
        return has < 0 ? -1 : !has;
    }
    }
    PyErr_SetString(PyExc_SystemError, "guard_eval: unknown check kind");
    return -1;
}

/* -- calling the evaluator -------------------------------------------------- */

static void release_slots(PyObject **slots, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) Py_CLEAR(slots[i]);
}

/* A fence (op: RemovableHandle, [the count when last passed], n) and the n checks after it:
 * while the count of hook handles torch made has not moved, those checks (no module has
 * hooks) still hold and are skipped; else they run, and once they hold the count is noted. */
static int run_fence(Evaluator *ev, PyObject **slots, PyObject *const *args, Py_ssize_t at) {
    Check *fence = &ev->checks[at];
    PyObject *count = PyObject_GetAttr(fence->op[0], s_next_id);
    if (count == NULL) return -1;
    int same = PyObject_RichCompareBool(count, PyList_GET_ITEM(fence->op[1], 0), Py_EQ);
    int ok = same < 0 ? -1 : 1;
    for (Py_ssize_t i = at + 1; same == 0 && ok == 1 && i <= at + fence->n; i++)
        ok = run_check(ev, slots, args, &ev->checks[i]);
    if (same == 0 && ok == 1 && PyList_SetItem(fence->op[1], 0, Py_NewRef(count)) < 0) ok = -1;
    Py_DECREF(count);
    return ok;
}

/* All checks in order: 1 they hold, 0 one fails (or raised an Exception), -1 a
 * BaseException that must propagate. */
static int run_checks(Evaluator *ev, PyObject **slots, PyObject *const *args) {
    int ok = 1;
    for (Py_ssize_t i = 0; i < ev->n_checks && ok == 1; i++) {
        Check *c = &ev->checks[i];
        if (c->kind == CHECK_FENCE) {
            ok = run_fence(ev, slots, args, i);
            i += c->n;
        } else {
            ok = run_check(ev, slots, args, c);
        }
    }
    if (ok < 0 && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        ok = 0;
    }
    return ok;
}

static PyObject *evaluator_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Evaluator *ev = (Evaluator *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != ev->n_args || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_Format(PyExc_TypeError, "guard evaluator takes %zd positional arguments (%zd given)", ev->n_args, nargs);
        return NULL;
    }
    PyObject **slots = ev->slots;
    if (ev->busy) { /* called again from Python code a check ran (a property, __eq__) */
        slots = PyMem_Calloc(ev->n_nodes ? ev->n_nodes : 1, sizeof(PyObject *));
        if (slots == NULL) return PyErr_NoMemory();
    } else {
        ev->busy = 1;
    }
    Py_INCREF(self); /* a check's Python code could drop the last other reference */
    int ok = run_checks(ev, slots, args);
    PyObject *pending_type, *pending_value, *pending_tb;
    PyErr_Fetch(&pending_type, &pending_value, &pending_tb);
    release_slots(slots, ev->n_nodes);
    PyErr_Restore(pending_type, pending_value, pending_tb);
    if (slots == ev->slots) ev->busy = 0; else PyMem_Free(slots);
    Py_DECREF(self);
    if (ok < 0) return NULL;
    return PyBool_FromLong(ok);
}

/* -- building the tables ---------------------------------------------------- */

static int kind_index(PyObject *name, const char **names) {
    const char *text = PyUnicode_AsUTF8(name);
    if (text == NULL) return -1;
    for (int i = 0; names[i] != NULL; i++)
        if (strcmp(names[i], text) == 0) return i;
    PyErr_Format(PyExc_ValueError, "guard_eval: unknown kind %R", name);
    return -1;
}

/* An index into the node table read from `obj`: -1 (none) or 0 <= i < limit. */
static int node_index(PyObject *obj, Py_ssize_t limit, int *out) {
    long i = PyLong_AsLong(obj);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < -1 || i >= limit) {
        PyErr_Format(PyExc_ValueError, "guard_eval: node index %ld out of range", i);
        return -1;
    }
    *out = (int)i;
    return 0;
}

/* One (kind, parent, second, payload) tuple; parents must come earlier in the table. */
static int parse_node(Evaluator *ev, PyObject *spec, Py_ssize_t index, Node *n) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4) {
        PyErr_SetString(PyExc_TypeError, "guard_eval: a node is (kind, parent, second, payload)");
        return -1;
    }
    PyObject *payload = PyTuple_GET_ITEM(spec, 3);
    memset(n, 0, sizeof(*n));
    n->same_name_prev = -1;
    if ((n->kind = kind_index(PyTuple_GET_ITEM(spec, 0), NODE_NAMES)) < 0
        || node_index(PyTuple_GET_ITEM(spec, 1), index, &n->parent) < 0
        || node_index(PyTuple_GET_ITEM(spec, 2), index, &n->second) < 0) return -1;
    n->a = payload;
    int needs_parent = n->kind == NODE_ATTR || n->kind == NODE_ITEM || n->kind == NODE_MODULE_ENTRY
                       || n->kind == NODE_CALL;
    if (needs_parent != (n->parent >= 0) || (n->kind == NODE_CALL) != (n->second >= 0)) {
        PyErr_SetString(PyExc_ValueError, "guard_eval: a node's parents do not fit its kind");
        return -1;
    }
    switch (n->kind) {
    case NODE_ARG:
        n->position = PyLong_AsSsize_t(payload);
        if (n->position == -1 && PyErr_Occurred()) return -1;
        if (n->position < 0 || n->position >= ev->n_args) {
            PyErr_SetString(PyExc_ValueError, "guard_eval: argument position out of range");
            return -1;
        }
        return 0;
    case NODE_ATTR:
        if (!PyUnicode_CheckExact(payload)) break;
        return 0;
    case NODE_MODULE_ENTRY:
        if (!PyTuple_Check(payload) || PyTuple_GET_SIZE(payload) != 2
            || !PyUnicode_CheckExact(PyTuple_GET_ITEM(payload, 0))) break;
        n->a = PyTuple_GET_ITEM(payload, 0);
        n->b = PyTuple_GET_ITEM(payload, 1);
        return 0;
    case NODE_CALL:
        if (!PyTuple_Check(payload) || PyTuple_GET_SIZE(payload) > 7) break;
        return 0;
    case NODE_PYTHON:
        if (!PyCallable_Check(payload)) break;
        return 0;
    default:
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "guard_eval: bad payload for a %s node", NODE_NAMES[n->kind]);
    return -1;
}

/* The number of operands each check kind takes. */
static const int CHECK_ARITY[] = {1, 1, 1, 2, 2, 1, 0, 2, 6, 2, 1, 2, 1, 3, 3, 5, 4};

/* CHECK_SIZES operands (reads, code, functions, fallback) as c->sizes: each read a (node, kind
 * name, dim, type, shape node or -1) tuple; the code a tuple of op names, each followed by its int operands; its
 * slots, functions and stack use checked here, so that running it needs no checks. */
static int parse_sizes(Evaluator *ev, Check *c) {
    PyObject *reads = c->op[0], *code = c->op[1], *functions = c->op[2];
    if (!PyTuple_Check(reads) || !PyTuple_Check(code) || !PyTuple_Check(functions) || !PyCallable_Check(c->op[3]))
        goto bad;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(functions); i++)
        if (!PyCallable_Check(PyTuple_GET_ITEM(functions, i))) goto bad;
    SizeProgram *p = c->sizes = PyMem_Calloc(1, sizeof(SizeProgram));
    if (p == NULL) return PyErr_NoMemory(), -1;
    p->n_reads = PyTuple_GET_SIZE(reads);
    p->reads = PyMem_Calloc(p->n_reads ? p->n_reads : 1, sizeof(SizeRead));
    p->code = PyMem_Calloc(PyTuple_GET_SIZE(code) ? PyTuple_GET_SIZE(code) : 1, sizeof(int64_t));
    if (p->reads == NULL || p->code == NULL) return PyErr_NoMemory(), -1;
    for (Py_ssize_t i = 0; i < p->n_reads; i++) {
        PyObject *spec = PyTuple_GET_ITEM(reads, i);
        SizeRead *r = &p->reads[i];
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 5 || !PyType_Check(PyTuple_GET_ITEM(spec, 3))) goto bad;
        if (node_index(PyTuple_GET_ITEM(spec, 0), ev->n_nodes, &r->node) < 0
            || (r->what = kind_index(PyTuple_GET_ITEM(spec, 1), READ_NAMES)) < 0
            || ((r->index = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 2))) == -1 && PyErr_Occurred())
            || node_index(PyTuple_GET_ITEM(spec, 4), ev->n_nodes, &r->shape) < 0) return -1;
        if (r->node < 0 || r->index < 0 || (r->shape >= 0) != (r->what == READ_SIZE || r->what == READ_DIMS)) goto bad;
        r->type = PyTuple_GET_ITEM(spec, 3);
    }
    Py_ssize_t depth = 0, n = PyTuple_GET_SIZE(code);
    for (Py_ssize_t i = 0; i < n;) {
        int op = kind_index(PyTuple_GET_ITEM(code, i++), OP_NAMES);
        if (op < 0) return -1;
        p->code[p->n_code++] = op;
        int n_operands = op == OP_CALL ? 2 : op == OP_SLOT || op == OP_CONST;
        if (i + n_operands > n) goto bad;
        int64_t *operand = &p->code[p->n_code];
        for (int k = 0; k < n_operands; k++) {
            operand[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(code, i++));
            if (operand[k] == -1 && PyErr_Occurred()) return -1;
        }
        p->n_code += n_operands;
        Py_ssize_t pops = op >= OP_ADD ? 2 : op == OP_CALL ? operand[1] : op != OP_SLOT && op != OP_CONST;
        if ((op == OP_SLOT && (operand[0] < 0 || operand[0] >= p->n_reads))
            || (op == OP_CALL && (operand[0] < 0 || operand[0] >= PyTuple_GET_SIZE(functions) || operand[1] < 0))
            || pops > depth) goto bad;
        depth += (op != OP_REQUIRE) - pops;
        if (depth > p->depth) p->depth = depth;
    }
    if (depth == 0) return 0;
bad:
    PyErr_SetString(PyExc_TypeError, "guard_eval: bad operands for a sizes check");
    return -1;
}

/* One (kind, node, second, operands) tuple. */
static int parse_check(Evaluator *ev, PyObject *spec, Check *c) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(spec, 3))) {
        PyErr_SetString(PyExc_TypeError, "guard_eval: a check is (kind, node, second, operands tuple)");
        return -1;
    }
    PyObject *ops = PyTuple_GET_ITEM(spec, 3);
    memset(c, 0, sizeof(*c));
    if ((c->kind = kind_index(PyTuple_GET_ITEM(spec, 0), CHECK_NAMES)) < 0
        || node_index(PyTuple_GET_ITEM(spec, 1), ev->n_nodes, &c->node) < 0
        || node_index(PyTuple_GET_ITEM(spec, 2), ev->n_nodes, &c->second) < 0) return -1;
    int takes_node = c->kind != CHECK_CALL_IS && c->kind != CHECK_PYTHON && c->kind != CHECK_FENCE && c->kind != CHECK_SIZES;
    int takes_second = c->kind == CHECK_SAME || c->kind == CHECK_SYMBOLIC_TENSOR;
    if (PyTuple_GET_SIZE(ops) != CHECK_ARITY[c->kind] || takes_node != (c->node >= 0) || takes_second != (c->second >= 0)) {
        PyErr_Format(PyExc_ValueError, "guard_eval: malformed %s check", CHECK_NAMES[c->kind]);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ops); i++) c->op[i] = PyTuple_GET_ITEM(ops, i);
    switch (c->kind) {
    case CHECK_ID:
        c->ident = PyLong_AsVoidPtr(c->op[0]);
        return c->ident == NULL && PyErr_Occurred() ? -1 : 0;
    case CHECK_LEN:
        c->n = PyLong_AsSsize_t(c->op[1]);
        return c->n == -1 && PyErr_Occurred() ? -1 : 0;
    case CHECK_DICT_KEYS:
        if (PyList_CheckExact(c->op[0])) return 0;
        break;
    case CHECK_INSTANCE_DICT:
        if (PyTuple_CheckExact(c->op[0]) && PyTuple_CheckExact(c->op[1])) return 0;
        break;
    case CHECK_SYMBOLIC_TENSOR:
        if (PyTuple_Check(c->op[3])) return 0;
        break;
    case CHECK_SIZES:
        return parse_sizes(ev, c);
    case CHECK_FENCE: /* the checks it guards follow it */
        if (!PyList_CheckExact(c->op[1]) || PyList_GET_SIZE(c->op[1]) != 1) break;
        c->n = PyLong_AsSsize_t(c->op[2]);
        if (c->n == -1 && PyErr_Occurred()) return -1;
        if (c->n >= 0) return 0;
        break;
    case CHECK_HASATTR: /* its node reads the attribute */
        if (!PyUnicode_CheckExact(c->op[0]) || ev->nodes[c->node].kind != NODE_ATTR
            || PyUnicode_Compare(c->op[0], ev->nodes[c->node].a) != 0) break;
        c->present = PyObject_IsTrue(c->op[1]);
        return c->present < 0 ? -1 : 0;
    default:
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "guard_eval: bad operands for a %s check", CHECK_NAMES[c->kind]);
    return -1;
}

/* Chains each ATTR node to the previous ATTR node reading the same name (earlier_read
 * walks them), and marks the `__func__` reads of attribute values (node_value may skip
 * making the bound method). */
static int link_attribute_nodes(Evaluator *ev) {
    PyObject *last = PyDict_New(); /* name -> index of the last ATTR node reading it */
    if (last == NULL) return -1;
    int status = 0;
    for (Py_ssize_t i = 0; i < ev->n_nodes && status == 0; i++) {
        Node *n = &ev->nodes[i];
        if (n->kind != NODE_ATTR) continue;
        n->of_method = ev->nodes[n->parent].kind == NODE_ATTR && PyUnicode_Compare(n->a, s_func) == 0;
        PyObject *prev = PyDict_GetItemWithError(last, n->a);
        if (prev != NULL) n->same_name_prev = (int)PyLong_AsLong(prev);
        PyObject *index = prev == NULL && PyErr_Occurred() ? NULL : PyLong_FromSsize_t(i);
        status = index == NULL || PyDict_SetItem(last, n->a, index) < 0 ? -1 : 0;
        Py_XDECREF(index);
    }
    Py_DECREF(last);
    return status;
}

static int evaluator_fill(Evaluator *ev, PyObject *nodes, PyObject *checks) {
    ev->n_nodes = PyList_GET_SIZE(nodes);
    ev->n_checks = PyList_GET_SIZE(checks);
    ev->nodes = PyMem_Calloc(ev->n_nodes ? ev->n_nodes : 1, sizeof(Node));
    ev->checks = PyMem_Calloc(ev->n_checks ? ev->n_checks : 1, sizeof(Check));
    ev->slots = PyMem_Calloc(ev->n_nodes ? ev->n_nodes : 1, sizeof(PyObject *));
    if (!ev->nodes || !ev->checks || !ev->slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < ev->n_nodes; i++)
        if (parse_node(ev, PyList_GET_ITEM(nodes, i), i, &ev->nodes[i]) < 0) return -1;
    if (link_attribute_nodes(ev) < 0) return -1;
    for (Py_ssize_t i = 0; i < ev->n_checks; i++)
        if (parse_check(ev, PyList_GET_ITEM(checks, i), &ev->checks[i]) < 0) return -1;
    for (Py_ssize_t i = 0; i < ev->n_checks; i++)
        if (ev->checks[i].kind == CHECK_FENCE && i + ev->checks[i].n >= ev->n_checks) {
            PyErr_SetString(PyExc_ValueError, "guard_eval: a fence guards more checks than follow it");
            return -1;
        }
    return 0;
}

static void evaluator_free_tables(Evaluator *ev) {
    for (Py_ssize_t i = 0; ev->checks != NULL && i < ev->n_checks; i++) {
        SizeProgram *p = ev->checks[i].sizes;
        if (p == NULL) continue;
        PyMem_Free(p->reads);
        PyMem_Free(p->code);
        PyMem_Free(p);
    }
    PyMem_Free(ev->nodes);
    PyMem_Free(ev->checks);
    PyMem_Free(ev->slots);
    ev->nodes = NULL;
    ev->checks = NULL;
    ev->slots = NULL;
    ev->n_nodes = ev->n_checks = 0;
}

static PyObject *evaluator_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"n_args", "nodes", "checks", "module_getattr", NULL};
    Py_ssize_t n_args;
    PyObject *nodes, *checks, *module_getattr;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nO!O!O:Evaluator", keywords, &n_args, &PyList_Type, &nodes,
                                     &PyList_Type, &checks, &module_getattr))
        return NULL;
    Evaluator *ev = (Evaluator *)type->tp_alloc(type, 0);
    if (ev == NULL) return NULL;
    ev->vectorcall = evaluator_vectorcall;
    ev->n_args = n_args;
    ev->module_getattr = module_getattr == Py_None ? NULL : Py_NewRef(module_getattr);
    /* copies of the lists: later edits of the caller's lists cannot reach the tables */
    ev->specs = Py_BuildValue("(NN)", PyList_GetSlice(nodes, 0, PY_SSIZE_T_MAX),
                              PyList_GetSlice(checks, 0, PY_SSIZE_T_MAX));
    if (ev->specs == NULL
        || evaluator_fill(ev, PyTuple_GET_ITEM(ev->specs, 0), PyTuple_GET_ITEM(ev->specs, 1)) < 0) {
        Py_DECREF(ev);
        return NULL;
    }
    return (PyObject *)ev;
}

static int evaluator_traverse(Evaluator *ev, visitproc visit, void *arg) {
    Py_VISIT(ev->specs);
    Py_VISIT(ev->module_getattr);
    return 0;
}

static int evaluator_clear(Evaluator *ev) {
    if (ev->busy) return 0;
    evaluator_free_tables(ev); /* the tables borrow from specs */
    Py_CLEAR(ev->specs);
    Py_CLEAR(ev->module_getattr);
    return 0;
}

static void evaluator_dealloc(Evaluator *ev) {
    PyObject_GC_UnTrack(ev);
    evaluator_clear(ev);
    Py_TYPE(ev)->tp_free((PyObject *)ev);
}

static PyTypeObject EvaluatorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "guard_eval.Evaluator",
    .tp_doc = "Evaluator(n_args, nodes, checks, module_getattr): called with the frame's arguments, "
              "True when every guard holds.",
    .tp_basicsize = sizeof(Evaluator),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = evaluator_new,
    .tp_dealloc = (destructor)evaluator_dealloc,
    .tp_traverse = (traverseproc)evaluator_traverse,
    .tp_clear = (inquiry)evaluator_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Evaluator, vectorcall),
};

static struct PyModuleDef guard_eval_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "guard_eval",
    .m_doc = "Runs a cache entry's guards in C (see guard_program.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit_guard_eval(void) {
    if (init_statics() < 0 || PyType_Ready(&EvaluatorType) < 0) return NULL;
    PyObject *module = PyModule_Create(&guard_eval_module);
    if (module == NULL) return NULL;
    Py_INCREF(&EvaluatorType);
    if (PyModule_AddObject(module, "Evaluator", (PyObject *)&EvaluatorType) < 0) {
        Py_DECREF(&EvaluatorType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
