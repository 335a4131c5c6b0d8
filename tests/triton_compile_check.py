"""Compiles the Triton kernels for an H100 (sm_90) ahead of time, without a GPU: the tile sizes, dtypes and operations
that the interpreter accepts must also lower to PTX. Run as a script without ``TRITON_INTERPRET``: the decoding
kernels (by ``tests/test_attention_triton_decode.py``), or with ``attention`` the forward kernel (``attention
--backward``: and the backward kernels) with the launch options of a GPU (by ``tests/test_attention_triton.py``);
prints one line a variant compiled."""

import importlib.util
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "hf_sparsemax", "attention", "gpu", "triton_decode_kernels.py")
SETTINGS = os.path.join(HERE, "..", "hf_sparsemax", "attention", "gpu", "triton_decode.py")
ATTENTION = os.path.join(HERE, "..", "hf_sparsemax", "attention", "gpu", "_triton_kernels.py")
ATTENTION_SETTINGS = os.path.join(HERE, "..", "hf_sparsemax", "attention", "gpu", "triton_attention.py")


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(fn, pointers, ints, floats, constants, options=None):
    signature = {**pointers, **{name: "i32" for name in ints}, **{name: "fp32" for name in floats},
                 **{name: "constexpr" for name in constants}}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                   options=options)
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


def attention():
    """The forward kernel (bfloat16, d 64, causal, skipping; float32, d 128 and value heads of 64 (DeepSeek's MLA
    has value heads of another size), a bool mask, no skipping) and, with
    ``--backward``, the three backward kernels in both variants (unchanged by the forward's passes; each compile
    takes CI seconds), with the tile sizes and launch options of ``triton_attention.py``."""
    kernels = load(ATTENTION, "_triton_kernels")
    settings = read_settings(ATTENTION_SETTINGS, ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES", "HIST_BINS",
                                                  "HIST_ITER"))
    options = {"num_warps": settings["NUM_WARPS"], "num_stages": settings["NUM_STAGES"]}
    tiles = {"BLOCK_M": settings["BLOCK_M"], "BLOCK_N": settings["BLOCK_N"]}
    strides = [f"s{t}{axis}" for t in "qkvmo"
               for axis in ("b", "h", "m" if t in "qmo" else "n", "d" if t != "m" else "n")]
    sizes = ["H", "G", "n_q", "n_kv", "n_mblocks", "n_nblocks"]
    backward = "--backward" in sys.argv
    for dtype, dim, value_dim, mask, causal, skip in (("*bf16", 64, 64, None, True, True),
                                                      ("*fp32", 128, 64, "*u8", False, False)):
        precision = "ieee" if dtype == "*fp32" else "tf32"
        pointers = {"Q": dtype, "K": dtype, "V": dtype, "M": mask or "*fp32", "ALPHA": "*fp32", "O": dtype,
                    "T": "*fp32", "LIVE": "*i8", "TMAX": "*fp32", "LIST": "*i32", "WORK": "*i32"}
        build(kernels.attention_forward, pointers, strides + sizes + ["max_passes"],
              ("scaling", "mask_floor", "tolerance", "norm_tolerance", "speculate"),
              {"HAS_MASK": mask is not None, "MASK_BOOL": mask == "*u8", "CAUSAL": causal, "SKIP": skip,
               "HIST_BINS": settings["HIST_BINS"], "HIST_ITER": settings["HIST_ITER"], **tiles, "HEAD_D": dim,
               "HEAD_DV": value_dim, "PRECISION": precision}, options)
        if not backward:
            continue
        strides_b = strides[:16] + [f"sd{axis}" for axis in "bhmd"]
        common = {"Q": dtype, "K": dtype, "V": dtype, "M": mask or "*fp32", "ALPHA": "*fp32", "DO": dtype,
                  "T": "*fp32", "LIVE": "*i8", "DELTA": "*fp32"}
        constants = {"HAS_MASK": mask is not None, "MASK_BOOL": mask == "*u8", "CAUSAL": causal, **tiles,
                     "HEAD_D": dim, "HEAD_DV": value_dim, "PRECISION": precision}
        ints, floats = strides_b + sizes, ("scaling", "mask_floor")
        build(kernels.attention_backward_rows, {**common, "DALPHA": "*fp32"}, ints, floats,
              {**constants, "ALPHA_GRAD": True}, options)
        build(kernels.attention_backward_q, {**common, "DQ": dtype}, ints, floats, constants, options)
        build(kernels.attention_backward_kv, {**common, "DK": dtype, "DV": dtype}, ints, floats, constants, options)


def read_settings(path, names):
    """Integer constants of a module, read from its source (importing it would import the package)."""
    values = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            left, _, rest = line.partition(" = ")  # "NAME = 1" or "A, B = 1, 2"
            for name, value in zip(left.split(", "), rest.split("#")[0].split(",")):
                if name in names:
                    values[name] = int(value)
    return values


def read_constants():
    """The tile constants of triton_decode.py."""
    values = read_settings(SETTINGS, ("BLOCK_ROWS", "BLOCK_KEYS", "MAX_SPLITS", "SOLVE_BLOCK"))
    return values["BLOCK_ROWS"], values["BLOCK_KEYS"], values["MAX_SPLITS"], values["SOLVE_BLOCK"]


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: this compiles for a GPU")
    attention() if "attention" in sys.argv[1:] else main()
