"""The CPU's own kernels: C sources built on first use (`native`) and the Python entry points of
the products they run: `int8_linear` (int8 weights), `bf16_linear` (bf16 weights), `gguf_linear`
(a GGUF file's Q4_0, Q4_1 and Q8_0 blocks) and `decoder_stack` (a model's blocks for a step of
decode rows). The paged decode attention's C source is here too; its entry point is
`infer.kernels.paged_attention_cpu`. Their public names are exported by `infer.kernels`."""
