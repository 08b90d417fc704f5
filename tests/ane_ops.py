"""The MIL ops our packages may use, each known to run on the Apple Neural Engine.

Apple publishes no list of ANE-supported MIL ops. Source of every entry below: the per-device op
catalog of ANEForge (github.com/sbryngelson/ANEForge, `aneforge/_op_catalog.py`, commit
067717ab376f025cb4965eea9a9f42cc2480a686), reverse-engineered from the ANE compiler and probed on
M1 silicon; columns M1..M5. We keep only ops that are 'native' on every family M1..M5, plus the
constant ops the compiler folds into the weights (never executed as ops). The note is the
catalog's, shortened. Eligibility is not placement: Core ML still decides at load time, and only a
Mac (Xcode performance report, MLComputePlan) shows where each op ran. tests/test_coreml_convert.py checks
that every op in every converted program is listed here, so a builder change that adds an op fails loudly.
"""

# op -> catalog note (native on M1, M2, M3, M4/M5)
NATIVE: dict[str, str] = {
    "add": "elementwise, const and tensor forms",
    "mul": "elementwise, const and tensor forms",
    "sub": "lowered to add of a negated const",
    "real_div": "general divide",
    "rsqrt": "LUT activation",
    "sigmoid": "SimpleActivation",
    "silu": "SimpleActivation (swish); coremltools fuses x*sigmoid(x) into it",
    "softmax": "Softmax",
    "layer_norm": "LayerNorm (native A13+); our RMSNorm is layer_norm over [x, -x]",
    "conv": "NE conv; every linear layer is a 1x1 conv on (1, C, 1, S)",
    "matmul": "NE lane / conv-fold; attention scores and values",
    "reshape": "metadata",
    "transpose": "capped by the max transpose extent (16384 on M1-M3), hence the split LM head",
    "concat": "DMA",
    "split": "DMA",
    "slice_by_size": "static-offset slice",
    "slice_update": "KV-cache write",
    "tile": "factors of {2,3,4,8}; GQA mask",
    "gather": "embedding and RoPE table lookups (software gather on M1, hardware A14+)",
    "cast": "fp16/fp32/bool native; coremltools adds int16/uint16 index casts before gathers",
    "select": "where; coremltools' negative-index guard before the embedding gather",
    "greater_equal": "compare; same guard",
    "read_state": "stateful (KV cache)",
    "coreml_update_state": "stateful; the catalog's write_state",
    "expand_dims": "metadata",
    "squeeze": "metadata",
}

# constants the ANE compiler folds into weights (the catalog's 'folded const' entries)
FOLDED: dict[str, str] = {
    "const": "folded at compile time",
    "constexpr_lut_to_dense": "LUT palette, streams natively from M1 (our lut4/lut6)",
    "constexpr_blockwise_shift_scale": "int8 weights; stream natively A15+, folded to fp16 on M1/M2",
    "constexpr_affine_dequantize": "int8 (older opset); folded to fp16 below A15",
}
