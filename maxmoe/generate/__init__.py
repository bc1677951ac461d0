"""Text generation from a checkpoint (`maxmoe generate`, maxmoe/commands/generate.py): the
decode loop with its KV cache (decode.py), token choice (sampling.py) and the decode mesh
(mesh.py). The cache-aware model paths are `extend` in maxmoe/model/."""
