"""Compile every Triton kernel for NVIDIA GPUs, ahead of time, on a machine with none.

The CPU tests run the kernels in Triton's interpreter, which never lowers them to GPU
code; this script does lower them (Triton IR -> LLVM -> PTX -> cubin, with the ptxas
that ships in the Triton wheel), for the architectures and dtypes the GPU tests use, so
a kernel that only a GPU compiler would reject fails in CI too.

Run it without TRITON_INTERPRET (``tests/test_ops_triton.py`` does, in a subprocess):

    python tests/compile_triton_kernels.py
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minipaged.ops import triton_fused as tf
from minipaged.ops import triton_kernels as tk
from minipaged.ops import triton_quant as tq

# (kernel, constexprs as a launch in triton_ops passes them): GQA 32/8 heads, head_dim 128.
# An unquantized cache (QUANTIZED=False): the scale pointers are unused.
DECODE = dict(
    GROUP=4,
    BLOCK_G=16,
    HEAD_DIM=128,
    BLOCK_D=128,
    BLOCK_N=64,
    DOT_PRECISION="tf32",
    QUANTIZED=False,
)
KERNELS = [
    (tk.write_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128)),
    (tk.decode_kernel, dict(DECODE, WRITE_LSE=False, lse_ptr=None)),  # one split: no lse
    (tk.decode_kernel, dict(DECODE, WRITE_LSE=True)),
    (tk.merge_splits_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32)),
    (
        tk.prefill_kernel,
        dict(
            GROUP=4,
            BLOCK_G=4,
            BLOCK_Q=16,
            HEAD_DIM=128,
            BLOCK_D=128,
            BLOCK_N=64,
            DOT_PRECISION="tf32",
            QUANTIZED=False,
        ),
    ),
]
# The layers' fused ops (hidden 896, head_dim 64) and the INT4 dequantizing GEMM.
KERNELS += [
    (tf.rms_norm_kernel, dict(ADD_RESIDUAL=False, BLOCK=1024)),
    (tf.rms_norm_kernel, dict(ADD_RESIDUAL=True, BLOCK=1024)),
    (tf.silu_and_mul_kernel, dict(BLOCK=1024)),
    (tf.rotary_kernel, dict(HALF=32)),
    (tq.quant_matmul_kernel, dict(BITS=4, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, PRECISION="tf32")),
]
TARGETS = [(80, "fp16"), (90, "bf16"), (90, "fp16")]
# Split-KV partial results and their log-sum-exps are float32 whatever the cache holds.
FLOAT32_POINTERS = {"partial_ptr", "lse_ptr"}


INDEX_POINTERS = {"slot_mapping_ptr", "block_tables_ptr", "context_lens_ptr", "query_start_loc_ptr"}
INDEX_POINTERS |= {"qweight_ptr", "zeros_ptr", "g_idx_ptr"}  # packed integers, group ids
FLOAT_ARGS = {"qk_scale", "eps"}


def signature(kernel, constexprs: dict, dtype: str) -> tuple[dict, dict, dict]:
    """Argument types, constants and alignment hints as a launch would bind them.

    Triton specialises an integer equal to 1 into a constant (so the innermost strides,
    head_dim's, are constants here too), and marks pointers and integers that are
    multiples of 16 as such (so it can load 16 bytes at a time): torch's allocations
    and the strides of a ``[.., 8, 128]`` layout are.
    """
    types, constants, hints = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs or name.endswith("d") and name.startswith("stride_"):
            types[name] = "constexpr"
            constants[(i,)] = constexprs.get(name, 1)
            continue
        if name in INDEX_POINTERS:
            types[name] = "*i32"
        elif name.endswith("_ptr"):
            types[name] = f"*{'fp32' if name in FLOAT32_POINTERS else dtype}"
        else:
            types[name] = "fp32" if name in FLOAT_ARGS else "i32"
        if name.endswith("_ptr") or name.startswith("stride_"):
            hints[(i,)] = [["tt.divisibility", 16]]
    return types, constants, hints


def main() -> int:
    for kernel, constexprs in KERNELS:
        for capability, dtype in TARGETS:
            types, constants, hints = signature(kernel, constexprs, dtype)
            source = ASTSource(fn=kernel, signature=types, constexprs=constants, attrs=hints)
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
            assert compiled.asm["cubin"], kernel.__name__
            ptx = compiled.asm["ptx"]
            loads = "16-byte loads" if "ld.global.v4" in ptx else "narrow loads"
            pipelined = ", pipelined (cp.async)" if "cp.async" in ptx else ""
            print(
                f"sm_{capability} {dtype:<5} {kernel.__name__:<20} "
                f"{compiled.metadata.shared:>6,} B shared, {loads}{pipelined}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
