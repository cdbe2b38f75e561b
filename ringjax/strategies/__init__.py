"""How sharded work is spread over the mesh (ring, all-gather, Ulysses, hybrid) and the cost
model that compares them."""
