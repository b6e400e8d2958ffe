"""Configuration search: candidate generation (space), ranking / Pareto / reasons (rank), one search and node
sweeps (engine), FLOP-balanced pipeline stages (stages). Pure numpy; the cost model evaluates."""
