"""Opcodes that only move values on the stack."""
from __future__ import annotations

import sys

from torchweld.capture.handlers import handles
from torchweld.capture.values import NULL


@handles("NOP", "RESUME", "EXTENDED_ARG", "CACHE")
def nop(tx, inst):
    pass


@handles("PRECALL", until=(3, 11))
def precall(tx, inst):
    pass


@handles("POP_TOP")
def pop_top(tx, inst):
    tx.pop()


@handles("PUSH_NULL")
def push_null(tx, inst):
    tx.push(NULL)


@handles("COPY")
def copy(tx, inst):
    tx.push(tx.stack[-inst.arg])


@handles("SWAP")
def swap(tx, inst):
    tx.stack[-1], tx.stack[-inst.arg] = tx.stack[-inst.arg], tx.stack[-1]


@handles("END_FOR", since=(3, 12))
def end_for(tx, inst):
    tx.popn(2 if sys.version_info < (3, 13) else 1)  # 3.13: a POP_TOP after it pops the iterator


@handles("KW_NAMES", since=(3, 11), until=(3, 12))
def kw_names(tx, inst):
    tx.kw_names = tx.code.co_consts[inst.arg]
