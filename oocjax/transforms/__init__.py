"""The JAX side of a plan: trace a step, find its layers, rewrite it for what it recomputes, cut it
into segment functions, compile them and run the chain."""
