"""Does a BLAS read past the end of its operands? Each operand of a small `cblas_sgemm` is placed to end right
before a page with no access, so a read past its end faults: the process dies on the first such call.

    .venv/bin/python scripts/blas_overread.py /usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4 a
    .venv/bin/python scripts/blas_overread.py /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 a

The last argument names the operand guarded (a: the rows, b: the weights, c: the output). BLIS 0.9.0 dies on
A at m=4, n=64, k=172 with B transposed (the product's own call shape; it reads 128-256 floats past A), which
is why blas.py does not choose it by default (docs/cpu.md).
"""

import ctypes
import mmap
import sys

import numpy as np

PAGE = 4096
SHAPES = [(1, 64, 172), (4, 64, 172), (4, 172, 64), (4, 64, 64), (2, 4, 64), (5, 64, 172), (6, 64, 172), (7, 172, 64)]


def guarded(n: int, tight: bool, keep: list) -> tuple[np.ndarray, int]:
    """n floats that end right before a PROT_NONE page (tight), or 4096 floats before it."""
    extra = 0 if tight else 4096
    size = ((n + extra) * 4 + PAGE - 1) // PAGE * PAGE
    mm = mmap.mmap(-1, size + PAGE)
    buf = (ctypes.c_char * (size + PAGE)).from_buffer(mm)
    addr = ctypes.addressof(buf)
    ctypes.CDLL("libc.so.6").mprotect(ctypes.c_void_p(addr + size), PAGE, 0)
    start = addr + size - (n + extra) * 4
    arr = np.frombuffer((ctypes.c_float * n).from_address(start), dtype=np.float32)
    arr[:] = np.random.default_rng(0).standard_normal(n)
    keep.append((mm, buf))
    return arr, start


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    who = sys.argv[2] if len(sys.argv) > 2 else "a"
    keep: list = []
    for m, n, k in SHAPES:
        for trans_b in (111, 112):  # CblasNoTrans, CblasTrans
            a, pa = guarded(m * k, who == "a", keep)
            b, pb = guarded(n * k, who == "b", keep)
            c, pc = guarded(m * n, who == "c", keep)
            print(f"m={m} n={n} k={k} B {'transposed' if trans_b == 112 else 'as is'}", flush=True)
            lib.cblas_sgemm(101, 111, trans_b, m, n, k, ctypes.c_float(1.0), ctypes.c_void_p(pa), k,
                            ctypes.c_void_p(pb), k if trans_b == 112 else n, ctypes.c_float(0.0),
                            ctypes.c_void_p(pc), n)
            want = a.reshape(m, k) @ (b.reshape(n, k).T if trans_b == 112 else b.reshape(k, n))
            assert np.allclose(c.reshape(m, n), want, atol=1e-3), "wrong product"
    print(f"no read past {who}'s end")


if __name__ == "__main__":
    main()
