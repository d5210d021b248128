"""One-question scripts: each answered one question, recorded in experiments/README.md. Not maintained
suites (those are in benchmarks/); no package imports this one."""
