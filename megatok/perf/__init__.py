"""How fast megatok runs: the benchmark (megatok-bench: the hot path, generation, the estimators' cost, a step's
profile by part), the GPU check (megatok-gpu-check), the ZeRO-3 construction check (megatok-zero-init-check) and
what they share (plain training steps, clocks, summaries). The science is in megatok.studies."""
