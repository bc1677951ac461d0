"""`maxmoe plan`: memory, step time and cost of a config on a cluster, before renting it.

cluster.py: the cluster and device-kind files (configs/cluster/, configs/devices/).
estimate.py: analytic state bytes per device (no compile), the search's pre-ranker.
collectives.py: bytes per step by mesh axis and collective kind, read from compiled HLO.
roofline.py: step time, tokens/s, MFU, cost and checkpoint figures from those.
overlap.py: the communication an XLA:GPU compile's schedule leaves exposed (op_cost.py prices
its compute ops).
probe.py: compiles the real train step on fake CPU devices (one subprocess per layout).
gpu_aot.py: deviceless XLA:GPU compiles (needs jax[cuda12]; docs/gpu_aot.md).
"""
