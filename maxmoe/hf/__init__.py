"""Hugging Face checkpoints as files: the safetensors format, the hub tensor <-> maxmoe param map,
config.json <-> maxmoe config, and slices of params read straight from a hub directory.

Below both train (train.init_from reads a hub directory slice by slice) and convert (the
`maxmoe convert` verbs, which also read and write maxmoe checkpoints).
"""
