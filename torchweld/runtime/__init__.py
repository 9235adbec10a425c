"""Running generated code: the on-disk kernel cache, and loading C++ and Triton kernels."""
