"""Differential fuzzer: generated programs, compiled by torchweld and run eagerly,
called several times with the program's state changed between calls; every call's
result and side effects must equal eager's. See tests/fuzz/README.md."""
