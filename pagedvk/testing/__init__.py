"""Layer 5, what checks and measures the library: the float64 numpy reference of every op (reference) and the
benchmark harness (bench, suite). Above the engine, below the demo and the command line."""
