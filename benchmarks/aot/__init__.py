"""Ahead-of-time sm_90 compiles of the gate kernels (aot_sm90) and the streaming decode kernel
(aot_stream_sm90), without a GPU."""
