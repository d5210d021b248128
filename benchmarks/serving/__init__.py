"""vLLM serving on CPU: generation throughput with operators (bench_vllm), live swaps on the OpenAI
server (bench_vllm_swap), and their shared inputs (vllm_inputs)."""
