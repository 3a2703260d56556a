"""ringflash's benchmarks: run each from the repository root as a module, e.g.
`python -m benchmarks.bench_local` (one device) or `ringflash-run -m benchmarks.bench_ring`
(several processes). Shared pieces live in benchmarks.common."""
