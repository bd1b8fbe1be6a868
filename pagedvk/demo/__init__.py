"""Layer 7, a numpy transformer (model) and a continuous-batching serving loop over it (serve), run by
`pagedvk demo`. Uses the reference (pagedvk.testing) for its dense attention and the engine for its cache."""
