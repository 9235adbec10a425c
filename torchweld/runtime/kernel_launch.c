/* One launcher for every compiled weld kernel (runtime/triton_launch.py says when it is used).

   launch(grid_x, grid_y, grid_z, stream, function, threads, shared_bytes, *parameters)

calls the CUDA driver's cuLaunchKernel with blocks of `threads` threads and each
parameter passed as a 64-bit value: weld's kernels take pointers, then int32 sizes and
int64 packed divisors (compiler/codegen/size_args.py; the driver reads an int32 parameter's
4 bytes from the start of its 64-bit slot, its low half on the little-endian hosts CUDA
runs on, negative ones too), and Triton's trailing scratch pointers come last as zeros. Triton
builds a launcher like this per kernel signature with a C compiler, a second or more
of compile time each; this one is built once. cuLaunchKernel is looked up in
libcuda at first use, so no CUDA headers are needed to build it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

typedef int (*cu_launch_kernel_t)(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                  unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                  void *stream, void **parameters, void **extra);
typedef int (*cu_get_error_string_t)(int code, const char **text);
typedef int (*cu_ctx_get_current_t)(void **context);
typedef int (*cu_ctx_set_current_t)(void *context);
typedef int (*cu_device_get_t)(int *device, int ordinal);
typedef int (*cu_device_primary_ctx_retain_t)(void **context, int device);

static cu_launch_kernel_t cu_launch_kernel = NULL;
static cu_get_error_string_t cu_get_error_string = NULL;
static cu_ctx_get_current_t cu_ctx_get_current = NULL;
static cu_ctx_set_current_t cu_ctx_set_current = NULL;
static cu_device_get_t cu_device_get = NULL;
static cu_device_primary_ctx_retain_t cu_device_primary_ctx_retain = NULL;

#define MAX_PARAMETERS 1024

static int load_driver(void) {
    void *library = dlopen("libcuda.so.1", RTLD_NOW);
    if (library == NULL) {
        PyErr_Format(PyExc_RuntimeError, "torchweld: cannot open libcuda.so.1: %s", dlerror());
        return 0;
    }
    cu_get_error_string = (cu_get_error_string_t)dlsym(library, "cuGetErrorString");
    cu_ctx_get_current = (cu_ctx_get_current_t)dlsym(library, "cuCtxGetCurrent");
    cu_ctx_set_current = (cu_ctx_set_current_t)dlsym(library, "cuCtxSetCurrent");
    cu_device_get = (cu_device_get_t)dlsym(library, "cuDeviceGet");
    cu_device_primary_ctx_retain = (cu_device_primary_ctx_retain_t)dlsym(library, "cuDevicePrimaryCtxRetain_v2");
    if (cu_device_primary_ctx_retain == NULL) {
        cu_device_primary_ctx_retain = (cu_device_primary_ctx_retain_t)dlsym(library, "cuDevicePrimaryCtxRetain");
    }
    cu_launch_kernel = (cu_launch_kernel_t)dlsym(library, "cuLaunchKernel");
    if (cu_launch_kernel == NULL || cu_ctx_get_current == NULL || cu_ctx_set_current == NULL
        || cu_device_get == NULL || cu_device_primary_ctx_retain == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "torchweld: libcuda.so.1 lacks cuLaunchKernel or the context calls");
        return 0;
    }
    return 1;
}

static PyObject *cuda_error(const char *what, int code) {
    const char *text = "unknown error";
    if (cu_get_error_string != NULL) {
        cu_get_error_string(code, &text);
    }
    PyErr_Format(PyExc_RuntimeError, "torchweld: %s failed: CUDA error %d (%s)", what, code, text);
    return NULL;
}

/* ensure_context(device): make the device's primary context current on this thread where
   none is. torch makes it current lazily, at a thread's first runtime call: autograd's
   device thread may reach a weld backward's first launch without one (CUDA error 201). */
static PyObject *ensure_context(PyObject *self, PyObject *arg) {
    int ordinal = (int)PyLong_AsLong(arg);
    if (ordinal == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (cu_launch_kernel == NULL && !load_driver()) {
        return NULL;
    }
    void *context = NULL;
    int code = cu_ctx_get_current(&context);
    if (code == 0 && context != NULL) {
        Py_RETURN_NONE;
    }
    int device;
    if ((code = cu_device_get(&device, ordinal)) != 0) return cuda_error("cuDeviceGet", code);
    if ((code = cu_device_primary_ctx_retain(&context, device)) != 0) return cuda_error("cuDevicePrimaryCtxRetain", code);
    if ((code = cu_ctx_set_current(context)) != 0) return cuda_error("cuCtxSetCurrent", code);
    Py_RETURN_NONE;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t values[MAX_PARAMETERS];
    void *parameters[MAX_PARAMETERS];
    if (nargs < 7) {
        PyErr_SetString(PyExc_TypeError, "launch(grid_x, grid_y, grid_z, stream, function, threads, shared_bytes, "
                                         "*parameters)");
        return NULL;
    }
    Py_ssize_t count = nargs - 7;
    if (count > MAX_PARAMETERS) {
        PyErr_Format(PyExc_ValueError, "torchweld: a kernel with %zd parameters (at most %d)", count, MAX_PARAMETERS);
        return NULL;
    }
    unsigned long grid_x = PyLong_AsUnsignedLong(args[0]);
    unsigned long grid_y = PyLong_AsUnsignedLong(args[1]);
    unsigned long grid_z = PyLong_AsUnsignedLong(args[2]);
    void *stream = PyLong_AsVoidPtr(args[3]);
    void *function = PyLong_AsVoidPtr(args[4]);
    unsigned long threads = PyLong_AsUnsignedLong(args[5]);
    unsigned long shared_bytes = PyLong_AsUnsignedLong(args[6]);
    for (Py_ssize_t i = 0; i < count; i++) {
        values[i] = PyLong_AsUnsignedLongLongMask(args[7 + i]);  /* a negative int: its two's complement */
        parameters[i] = &values[i];
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (grid_x == 0 || grid_y == 0 || grid_z == 0) {
        Py_RETURN_NONE;
    }
    if (cu_launch_kernel == NULL && !load_driver()) {
        return NULL;
    }
    int code = cu_launch_kernel(function, (unsigned)grid_x, (unsigned)grid_y, (unsigned)grid_z, (unsigned)threads, 1,
                                1, (unsigned)shared_bytes, stream, parameters, NULL);
    if (code != 0) {
        return cuda_error("launching a kernel", code);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(grid_x, grid_y, grid_z, stream, function, threads, shared_bytes, *parameters)"},
    {"ensure_context", ensure_context, METH_O,
     "ensure_context(device): the device's primary context current on this thread, where none is"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kernel_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kernel_launch(void) { return PyModule_Create(&module); }
