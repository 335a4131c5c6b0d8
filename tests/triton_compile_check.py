"""Compiles the Triton decoding kernels for an H100 (sm_90) ahead of time, without a GPU: the tile sizes, dtypes and
operations that the interpreter accepts must also lower to PTX. Run as a script (by
``tests/test_attention_triton_decode.py``) without ``TRITON_INTERPRET``; prints one line a variant compiled."""

import importlib.util
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "hf_sparsemax", "attention", "triton_decode_kernels.py")
SETTINGS = os.path.join(HERE, "..", "hf_sparsemax", "attention", "triton_decode.py")


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(fn, pointers, ints, floats, constants):
    signature = {**pointers, **{name: "i32" for name in ints}, **{name: "fp32" for name in floats},
                 **{name: "constexpr" for name in constants}}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=GPUTarget("cuda", 90, 32))
    print(fn.__name__, constants, "compiled", flush=True)


def main():
    kernels = load(SOURCE, "triton_decode_kernels")
    block_rows, block_keys, max_splits, solve_block = read_constants()
    ints = ("sq_b sq_h sq_r sq_d sk_b sk_h sk_n sk_d sm_b sm_h sm_r sm_n kv_heads groups q_rows rows keys dim "
            "row_blocks splits split_len").split()
    for half, block_d, kind, mask in ((True, 64, 0, "*fp32"), (True, 128, 1, "*u8"), (False, 128, 2, "*bf16"),
                                      (False, 16, 2, "*fp32")):
        build(kernels.scores_kernel, {"q_ptr": "*bf16" if half else "*fp32", "k_ptr": "*bf16", "m_ptr": mask,
                                      "s_ptr": "*fp32", "top_ptr": "*fp32", "bad_ptr": "*i32"},
              ints, ("scaling", "masked"),
              {"BLOCK_R": block_rows, "BLOCK_N": block_keys, "BLOCK_D": block_d, "MASK_KIND": kind, "HALF": half})
    for alpha in ("*fp64", "*fp32"):
        build(kernels.solve_kernel, {"s_ptr": "*fp32", "top_ptr": "*fp32", "bad_ptr": "*i32", "c_ptr": "*fp64",
                                     "alpha_ptr": alpha, "tau_ptr": "*fp64", "m_ptr": "*fp32", "state_ptr": "*i32"},
              ("alpha_stride", "heads", "q_rows", "keys", "splits", "max_iter"), ("tolerance",),
              {"BLOCK_S": max_splits, "BLOCK_C": solve_block})
    ints = "sv_b sv_h sv_n sv_d kv_heads groups q_rows rows keys value_dim row_blocks splits split_len".split()
    for half, block_dv, out in ((True, 64, "*bf16"), (True, 128, "*fp16"), (False, 128, "*fp32")):
        build(kernels.values_kernel, {"s_ptr": "*fp32", "v_ptr": "*bf16" if half else "*fp32", "alpha_ptr": "*fp64",
                                      "tau_ptr": "*fp64", "m_ptr": "*fp32", "state_ptr": "*i32", "o_ptr": "*fp32",
                                      "count_ptr": "*i32", "out_ptr": out},
              ["alpha_stride"] + ints, (),
              {"BLOCK_R": block_rows, "BLOCK_N": block_keys, "BLOCK_DV": block_dv, "HALF": half,
               "BFLOAT16": out == "*bf16"})


def read_constants():
    """The tile constants of triton_decode.py, read from its source (importing it would import the package)."""
    values = {}
    with open(SETTINGS, encoding="utf-8") as handle:
        for line in handle:
            name, _, rest = line.partition(" = ")
            if name in ("BLOCK_ROWS", "BLOCK_KEYS", "MAX_SPLITS", "SOLVE_BLOCK"):
                values[name] = int(rest.split("#")[0])
    return values["BLOCK_ROWS"], values["BLOCK_KEYS"], values["MAX_SPLITS"], values["SOLVE_BLOCK"]


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: this compiles for a GPU")
    main()
