"""Gate kernel microbenchmark: timings (bench_gate), its report and plots (bench_gate_report), and the
per-kernel GPU profile (gate_profile)."""
